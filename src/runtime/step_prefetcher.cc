// StepPrefetcher (thdpack/step_runner.h): the step runner on a thread of its own, ahead of the
// caller, over a communicator split for it.
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "thdpack/comm.h"
#include "thdpack/step_runner.h"

namespace thdpack {

class StepPrefetcher::Impl {
 public:
  Impl(ProcessGroup& world, std::unique_ptr<ProcessGroup> data_world,
       std::unique_ptr<StepRunner> runner, std::optional<CpGroupCache> cache, int depth,
       int64_t steps)
      : world_(world),
        data_world_(std::move(data_world)),
        runner_(std::move(runner)),
        cache_(std::move(cache)),
        depth_(depth),
        steps_(steps),
        state_(runner_->state()) {}

  ~Impl() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    room_.notify_all();
    if (thread_.joinable()) thread_.join();
    // Members go in reverse order: the runner before the communicator it uses.
  }

  Status Restore(const RunState& state) {
    if (thread_.joinable()) {
      return Status::InvalidArgument(
          "StepPrefetcher::Restore: the thread has started (restore before the first Next())");
    }
    THDPACK_RETURN_IF_ERROR(runner_->Restore(state));
    state_ = runner_->state();
    return Status::Ok();
  }

  Result<RankStep> Next(double* waited) {
    if (failed_) {
      return Status::InvalidArgument(
          "StepPrefetcher::Next: an earlier step failed; destroy the prefetcher");
    }
    if (!thread_.joinable()) thread_ = std::thread([this] { Produce(); });
    const auto t0 = std::chrono::steady_clock::now();
    std::optional<Result<RankStep>> next;
    {
      std::unique_lock<std::mutex> lk(mu_);
      ready_.wait(lk, [&] { return !queue_.empty() || finished_; });
      if (!queue_.empty()) {
        next.emplace(std::move(queue_.front()));
        queue_.pop_front();
      }
    }
    room_.notify_one();
    if (waited) {
      *waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    if (!next) {
      failed_ = true;
      return Status::OutOfRange("StepPrefetcher::Next: the " + std::to_string(steps_) +
                                " steps it was created for are done");
    }
    if (!next->ok()) {
      failed_ = true;
      return std::move(*next).status();
    }
    RankStep step = std::move(**next);
    if (cache_ && step.dynamic) {
      // The groups from the caller's world, on the caller's thread.
      Status s = cache_->AttachAgreed(world_, step);
      if (!s.ok()) {
        failed_ = true;
        return s;
      }
    }
    state_ = step.after;
    return step;
  }

  const RunState& state() const { return state_; }

 private:
  // The thread: runner steps into the queue, at most depth_ ahead, until steps_, an error, or
  // a stop once depth_ steps are ready (every rank's thread then made the same steps).
  void Produce() {
    for (int64_t made = 0; steps_ < 0 || made < steps_; ++made) {
      {
        std::unique_lock<std::mutex> lk(mu_);
        room_.wait(lk, [&] { return stop_ || static_cast<int>(queue_.size()) < depth_; });
        if (stop_ && static_cast<int>(queue_.size()) >= depth_) break;
      }
      Result<RankStep> step = runner_->Next();
      const bool failed = !step.ok();
      {
        std::lock_guard<std::mutex> lk(mu_);
        queue_.push_back(std::move(step));
      }
      ready_.notify_one();
      if (failed) break;
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      finished_ = true;
    }
    ready_.notify_one();
  }

  ProcessGroup& world_;
  std::unique_ptr<ProcessGroup> data_world_;
  std::unique_ptr<StepRunner> runner_;
  std::optional<CpGroupCache> cache_;
  const int depth_;
  const int64_t steps_;
  RunState state_;
  bool failed_ = false;  // the caller's thread only

  std::mutex mu_;
  std::condition_variable room_, ready_;
  std::deque<Result<RankStep>> queue_;
  bool stop_ = false;
  bool finished_ = false;
  std::thread thread_;  // last: started after every member above exists
};

Result<std::unique_ptr<StepPrefetcher>> StepPrefetcher::Create(ProcessGroup& world,
                                                               const Topology& topology,
                                                               const StepRunnerOptions& options,
                                                               int depth, int64_t steps) {
  // Local checks of arguments every rank holds alike: the same answer everywhere, no
  // collective needed.
  if (depth < 1 || depth > 64) {
    return Status::InvalidArgument("StepPrefetcher: depth = " + std::to_string(depth) +
                                   " must be in [1, 64] steps");
  }
  if (steps < -1) {
    return Status::InvalidArgument("StepPrefetcher: steps = " + std::to_string(steps) +
                                   " must be >= 0, or -1 for no bound");
  }
  std::vector<int> all(static_cast<size_t>(world.size()));
  for (int r = 0; r < world.size(); ++r) all[static_cast<size_t>(r)] = r;
  const std::vector<std::vector<int>> lists = {all};
  THDPACK_ASSIGN_OR_RETURN(std::unique_ptr<ProcessGroup> data_world, world.Split(lists));
  if (!data_world) return Status::Internal("StepPrefetcher: the world's split holds no group");
  data_world->set_timeout(world.timeout());
  StepRunnerOptions o = options;
  o.defer_cp_groups = true;
  THDPACK_ASSIGN_OR_RETURN(std::unique_ptr<StepRunner> runner,
                           StepRunner::Create(*data_world, topology, o));
  std::optional<CpGroupCache> cache;
  if (o.schedule.scheduler == ScheduleOptions::Scheduler::kDynamic) {
    cache.emplace(topology, o.max_cp_groups);
  }
  return std::unique_ptr<StepPrefetcher>(new StepPrefetcher(std::make_unique<Impl>(
      world, std::move(data_world), std::move(runner), std::move(cache), depth, steps)));
}

StepPrefetcher::StepPrefetcher(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
StepPrefetcher::~StepPrefetcher() = default;
Status StepPrefetcher::Restore(const RunState& state) { return impl_->Restore(state); }
Result<RankStep> StepPrefetcher::Next(double* waited) { return impl_->Next(waited); }
const RunState& StepPrefetcher::state() const { return impl_->state(); }

}  // namespace thdpack
