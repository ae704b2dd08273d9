// StepSource (thdpack/step_runner.h): the steps of a run as a loop takes them - the step runner
// on the caller's thread (depth 0), or on a thread of its own ahead of the caller, over a
// communicator of its own.
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

Status StepSourceOptions::Check() const {
  if (depth < 0 || depth > kMaxDepth) {
    return Status::InvalidArgument("depth = " + std::to_string(depth) + " must be in [0, " +
                                   std::to_string(kMaxDepth) + "] steps");
  }
  if (steps < -1) {
    return Status::InvalidArgument("steps = " + std::to_string(steps) +
                                   " must be >= 0, or -1 for no bound");
  }
  return Status::Ok();
}

// Shared by the StepSource and its thread: whichever lets go last frees it (the thread, when a
// Close timed out or was called on the thread itself), so the thread never outlives what it
// uses.
class StepSource::Impl {
 public:
  Impl(ProcessGroup& world, std::shared_ptr<ProcessGroup> data_world,
       std::unique_ptr<StepRunner> runner, std::optional<CpGroupCache> cache,
       StepSourceOptions options)
      : world_(world),
        data_world_(std::move(data_world)),
        runner_(std::move(runner)),
        cache_(std::move(cache)),
        depth_(options.depth),
        steps_(options.steps),
        on_step_(std::move(options.on_step)),
        state_(runner_->state()) {}

  ~Impl() {
    // The last owner: the thread has ended (or is this thread, which the StepSource let go).
    if (thread_.joinable()) {
      if (thread_.get_id() == std::this_thread::get_id()) {
        thread_.detach();
      } else {
        thread_.join();
      }
    }
    queue_.clear();
    // Members go in reverse order: the runner before the communicator it uses.
  }

  Status Restore(const RunState& state) {
    if (taken_ > 0 || thread_.joinable()) {
      return Status::InvalidArgument(
          "StepSource::Restore: a step was made (restore before the first Next())");
    }
    THDPACK_RETURN_IF_ERROR(runner_->Restore(state));
    state_ = runner_->state();
    return Status::Ok();
  }

  Result<RankStep> Next(const std::shared_ptr<Impl>& self, double* waited) {
    if (closed_) return Status::InvalidArgument("StepSource::Next: the source is closed");
    if (failed_) {
      return Status::InvalidArgument("StepSource::Next: an earlier step failed; close the source");
    }
    if (!end_.ok()) return end_;
    const auto t0 = std::chrono::steady_clock::now();
    Result<RankStep> next = depth_ == 0 ? MakeInline() : TakeAhead(self);
    if (waited) {
      *waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    if (!next.ok()) {
      if (next.status().code() == StatusCode::kEndOfData) {
        end_ = next.status();
      } else {
        failed_ = true;
      }
      return next;
    }
    if (cache_ && next->dynamic) {
      // The groups from the caller's world, on the caller's thread.
      Status s = cache_->AttachAgreed(world_, *next);
      if (!s.ok()) {
        failed_ = true;
        return s;
      }
    }
    ++taken_;
    state_ = next->after;
    return next;
  }

  Status Close(double timeout_seconds) {
    closed_ = true;
    if (let_go_ || !thread_.joinable()) return Status::Ok();
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    room_.notify_all();
    if (thread_.get_id() == std::this_thread::get_id()) {
      let_go_ = true;  // ends by itself after its steps
      return Status::Ok();
    }
    {
      std::unique_lock<std::mutex> lk(mu_);
      auto done = [&] { return finished_; };
      if (timeout_seconds < 0) {
        ready_.wait(lk, done);
      } else if (!ready_.wait_for(lk, std::chrono::duration<double>(timeout_seconds), done)) {
        let_go_ = true;  // it holds the Impl: the last of the two to let go frees it
        return Status::Aborted("StepSource::Close: the data plane's thread did not end within " +
                               std::to_string(timeout_seconds) +
                               " s (a peer's thread that stopped first leaves it in a "
                               "collective until the communicator's timeout); left to end on "
                               "its own");
      }
    }
    thread_.join();
    std::deque<Result<RankStep>> dropped;
    {
      std::lock_guard<std::mutex> lk(mu_);
      dropped.swap(queue_);
    }
    return Status::Ok();
  }

  const RunState& state() const { return state_; }
  bool ready() {
    if (depth_ == 0 || closed_ || !thread_.joinable()) return false;
    std::lock_guard<std::mutex> lk(mu_);
    return !queue_.empty() || finished_;
  }
  bool reads() const { return runner_->reads(); }
  int depth() const { return depth_; }

 private:
  // One step by the runner and the hook (agreed over `comm` when there is a hook).
  Result<RankStep> Make(ProcessGroup& comm) {
    Result<RankStep> step = runner_->Next();
    if (!step.ok() || !on_step_) return step;
    Status hooked = on_step_(comm, *step);
    THDPACK_RETURN_IF_ERROR(AgreeOnStatus(comm, hooked, "the step source's on_step"));
    return step;
  }

  Result<RankStep> MakeInline() {
    if (steps_ >= 0 && made_ >= steps_) return StepsDone();
    ++made_;
    return Make(world_);
  }

  Status StepsDone() const {
    return Status::EndOfData("StepSource: the " + std::to_string(steps_) +
                             " steps it was made for are done");
  }

  Result<RankStep> TakeAhead(const std::shared_ptr<Impl>& self) {
    if (!thread_.joinable()) {
      // The thread holds the Impl: what it uses lives as long as it runs.
      thread_ = std::thread([self] { self->Produce(); });
    }
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
    if (!next) return StepsDone();  // the thread ends after `steps`, an error or the end only
    return std::move(*next);
  }

  // The thread: steps into the queue, at most depth_ ahead, until steps_, an error, the end,
  // or a stop once depth_ steps are ready (every rank's thread then made the same steps).
  void Produce() {
    for (; steps_ < 0 || made_ < steps_; ++made_) {
      {
        std::unique_lock<std::mutex> lk(mu_);
        room_.wait(lk, [&] { return stop_ || static_cast<int>(queue_.size()) < depth_; });
        if (stop_ && static_cast<int>(queue_.size()) >= depth_) break;
      }
      Result<RankStep> step = Make(*data_world_);
      const bool last = !step.ok();
      {
        std::lock_guard<std::mutex> lk(mu_);
        queue_.push_back(std::move(step));
      }
      ready_.notify_all();
      if (last) break;
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      finished_ = true;
    }
    ready_.notify_all();
  }

  ProcessGroup& world_;
  std::shared_ptr<ProcessGroup> data_world_;
  std::unique_ptr<StepRunner> runner_;
  std::optional<CpGroupCache> cache_;
  const int depth_;
  const int64_t steps_;
  const std::function<Status(ProcessGroup&, RankStep&)> on_step_;
  // The caller's thread only.
  RunState state_;
  int64_t taken_ = 0;
  bool failed_ = false;
  bool closed_ = false;
  bool let_go_ = false;  // a Close timed out: the thread ends on its own
  Status end_;  // kEndOfData once the stream ended
  // Depth 0: the caller's thread; depth >= 1: the thread's, once started.
  int64_t made_ = 0;

  std::mutex mu_;
  std::condition_variable room_, ready_;
  std::deque<Result<RankStep>> queue_;
  bool stop_ = false;
  bool finished_ = false;
  std::thread thread_;
};

Result<std::unique_ptr<StepSource>> StepSource::Create(ProcessGroup& world,
                                                       const Topology& topology,
                                                       const StepRunnerOptions& options,
                                                       StepSourceOptions source_options) {
  // Local checks of arguments every rank holds alike: the same answer everywhere, no
  // collective needed.
  THDPACK_RETURN_IF_ERROR(source_options.Check().WithContext("StepSource"));
  const int depth = source_options.depth;
  StepRunnerOptions o = options;
  std::shared_ptr<ProcessGroup> data_world;
  std::optional<CpGroupCache> cache;
  if (depth > 0) {
    data_world = std::move(source_options.data_world);
    if (!data_world) {
      std::vector<int> all(static_cast<size_t>(world.size()));
      for (int r = 0; r < world.size(); ++r) all[static_cast<size_t>(r)] = r;
      const std::vector<std::vector<int>> lists = {all};
      THDPACK_ASSIGN_OR_RETURN(std::unique_ptr<ProcessGroup> split, world.Split(lists));
      if (!split) return Status::Internal("StepSource: the world's split holds no group");
      split->set_timeout(world.timeout());
      data_world = std::move(split);
    } else if (data_world->size() != world.size() || data_world->rank() != world.rank()) {
      return Status::InvalidArgument(
          "StepSource: data_world has " + std::to_string(data_world->size()) +
          " ranks with this one at " + std::to_string(data_world->rank()) + ", the world " +
          std::to_string(world.size()) + " at " + std::to_string(world.rank()) +
          " (the same ranks in the same order)");
    }
    o.defer_cp_groups = true;
    if (o.schedule.scheduler == ScheduleOptions::Scheduler::kDynamic) {
      cache.emplace(topology, o.max_cp_groups);
    }
  }
  source_options.data_world.reset();
  THDPACK_ASSIGN_OR_RETURN(std::unique_ptr<StepRunner> runner,
                           StepRunner::Create(depth > 0 ? *data_world : world, topology, o));
  return std::unique_ptr<StepSource>(new StepSource(std::make_shared<Impl>(
      world, std::move(data_world), std::move(runner), std::move(cache),
      std::move(source_options))));
}

StepSource::StepSource(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
StepSource::~StepSource() {
  if (impl_) (void)impl_->Close(-1);
}
Status StepSource::Restore(const RunState& state) { return impl_->Restore(state); }
Result<RankStep> StepSource::Next(double* waited) { return impl_->Next(impl_, waited); }
const RunState& StepSource::state() const { return impl_->state(); }
bool StepSource::ready() const { return impl_->ready(); }
bool StepSource::reads() const { return impl_->reads(); }
int StepSource::depth() const { return impl_->depth(); }
Status StepSource::Close(double timeout_seconds) { return impl_->Close(timeout_seconds); }

}  // namespace thdpack
