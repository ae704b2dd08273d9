// keep_groups' group ids (thdpack/step_runner.h: StepRunnerOptions::group_field): the group
// field checked against keep_groups, the scheduler and the schema when the runner opens
// (FindGroupField, from Init in step_open.cc), and the group id a sample carries (GroupOf),
// which the lengths exchange sends beside its length (step_lengths.cc) for the planners to keep
// each group together. Sends nothing itself. Depends on: nothing but the options.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "runtime/step_runner_impl.h"
#include "thdpack/fields.h"

namespace thdpack {

using namespace runner_internal;  // NOLINT: the runtime area's own helpers

Status StepRunner::Impl::FindGroupField() {
  const bool keep = opts_.schedule.keep_groups != ScheduleOptions::KeepGroups::kNone;
  const std::string mode(KeepGroupsName(opts_.schedule.keep_groups));
  if (opts_.group_field.empty()) {
    if (!keep) return Status::Ok();
    return Status::InvalidArgument("StepRunner: keep_groups '" + mode +
                                   "' needs group_field, the sample field holding each "
                                   "sample's group id");
  }
  THDPACK_RETURN_IF_ERROR(CheckKeepGroups(opts_.schedule, "group_field '" + opts_.group_field +
                                                              "'")
                              .WithContext("StepRunner"));
  for (size_t f = 0; f < opts_.fields.size(); ++f) {
    const FieldSpec& spec = opts_.fields[f];
    if (spec.name != opts_.group_field) continue;
    if (spec.kind != FieldKind::kSample || spec.width() != 1 ||
        (spec.dtype != FieldDtype::kInt32 && spec.dtype != FieldDtype::kInt64)) {
      return Status::InvalidArgument("StepRunner: group_field '" + opts_.group_field +
                                     "' is " + spec.ToString() +
                                     "; a group id must be a sample field of int32 or int64, "
                                     "shape []");
    }
    group_field_ = static_cast<int>(f);
    return Status::Ok();
  }
  std::string declared;
  for (const FieldSpec& spec : opts_.fields) {
    declared += (declared.empty() ? "" : ", ") + spec.ToString();
  }
  return Status::InvalidArgument("StepRunner: group_field '" + opts_.group_field +
                                 "' is not one of the " + std::to_string(opts_.fields.size()) +
                                 " declared fields" +
                                 (declared.empty() ? "" : " (" + declared + ")"));
}

int64_t StepRunner::Impl::GroupOf(const Sample& x) const {
  const std::vector<std::byte>& b = x.fields[static_cast<size_t>(group_field_)];
  if (opts_.fields[static_cast<size_t>(group_field_)].dtype == FieldDtype::kInt32) {
    int32_t v = 0;
    std::memcpy(&v, b.data(), sizeof v);
    return v;
  }
  int64_t v = 0;
  std::memcpy(&v, b.data(), sizeof v);
  return v;
}

}  // namespace thdpack
