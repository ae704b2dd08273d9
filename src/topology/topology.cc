#include "thdpack/topology.h"

#include <algorithm>
#include <cstdint>

namespace thdpack {
namespace {

int Get(const Coord& c, Dim d) {
  switch (d) {
    case Dim::kTp: return c.tp;
    case Dim::kCp: return c.cp;
    case Dim::kDp: return c.dp;
    case Dim::kPp: return c.pp;
  }
  return 0;
}

void Set(Coord& c, Dim d, int v) {
  switch (d) {
    case Dim::kTp: c.tp = v; break;
    case Dim::kCp: c.cp = v; break;
    case Dim::kDp: c.dp = v; break;
    case Dim::kPp: c.pp = v; break;
  }
}

// The dimensions a group varies over, slowest first (so the position of a member in its group
// is the mixed-radix number formed by its coordinates along them).
std::vector<Dim> VaryingDims(GroupKind kind) {
  switch (kind) {
    case GroupKind::kTp: return {Dim::kTp};
    case GroupKind::kCp: return {Dim::kCp};
    case GroupKind::kDp: return {Dim::kDp};
    case GroupKind::kDpCp: return {Dim::kDp, Dim::kCp};
    case GroupKind::kPp: return {Dim::kPp};
  }
  return {};
}

}  // namespace

std::string_view DimName(Dim dim) {
  switch (dim) {
    case Dim::kTp: return "tp";
    case Dim::kCp: return "cp";
    case Dim::kDp: return "dp";
    case Dim::kPp: return "pp";
  }
  return "?";
}

std::string_view GroupKindName(GroupKind kind) {
  switch (kind) {
    case GroupKind::kTp: return "tp";
    case GroupKind::kCp: return "cp";
    case GroupKind::kDp: return "dp";
    case GroupKind::kDpCp: return "dp-cp";
    case GroupKind::kPp: return "pp";
  }
  return "?";
}

Result<Topology> Topology::Create(int tp, int cp, int dp, int pp, std::string_view order) {
  const int sizes[4] = {tp, cp, dp, pp};
  for (int i = 0; i < 4; ++i) {
    if (sizes[i] < 1) {
      return Status::InvalidArgument("topology: " + std::string(DimName(static_cast<Dim>(i))) +
                                     " size " + std::to_string(sizes[i]) + " must be >= 1");
    }
  }
  const int64_t world = int64_t{tp} * cp * dp * pp;
  if (world > INT32_MAX) {
    return Status::OutOfRange("topology: world size " + std::to_string(world) +
                              " (tp*cp*dp*pp) does not fit int32");
  }
  Topology t;
  t.size_ = {tp, cp, dp, pp};
  t.world_size_ = static_cast<int>(world);

  // Parse the order: a permutation of the four names, '-'-separated, fastest first.
  std::array<bool, 4> seen{};
  int n = 0;
  size_t pos = 0;
  while (pos <= order.size()) {
    size_t end = order.find('-', pos);
    if (end == std::string_view::npos) end = order.size();
    std::string_view name = order.substr(pos, end - pos);
    int d = -1;
    for (int i = 0; i < 4; ++i) {
      if (name == DimName(static_cast<Dim>(i))) d = i;
    }
    if (d < 0 || n >= 4 || seen[d]) {
      return Status::InvalidArgument(
          "topology: rank order \"" + std::string(order) +
          "\" must be a '-'-separated permutation of tp, cp, dp, pp (fastest first); " +
          (d < 0 ? "\"" + std::string(name) + "\" is not one of them"
                 : "\"" + std::string(name) + "\" appears twice or there are too many"));
    }
    seen[d] = true;
    t.order_[n++] = static_cast<Dim>(d);
    pos = end + 1;
  }
  if (n != 4) {
    return Status::InvalidArgument("topology: rank order \"" + std::string(order) +
                                   "\" names " + std::to_string(n) +
                                   " dimensions; it must name all of tp, cp, dp, pp");
  }
  int stride = 1;
  for (Dim d : t.order_) {
    t.stride_[static_cast<int>(d)] = stride;
    stride *= t.size(d);
  }
  return t;
}

std::string Topology::order() const {
  std::string s;
  for (int i = 0; i < 4; ++i) {
    if (i) s += '-';
    s += DimName(order_[i]);
  }
  return s;
}

int Topology::RankOfUnchecked(const Coord& c) const {
  int r = 0;
  for (int i = 0; i < 4; ++i) r += Get(c, static_cast<Dim>(i)) * stride_[i];
  return r;
}

Coord Topology::CoordOfUnchecked(int rank) const {
  Coord c;
  for (Dim d : order_) {
    Set(c, d, rank % size(d));
    rank /= size(d);
  }
  return c;
}

Result<Coord> Topology::CoordOf(int rank) const {
  if (rank < 0 || rank >= world_size_) {
    return Status::InvalidArgument("topology: rank " + std::to_string(rank) +
                                   " is outside the world [0, " + std::to_string(world_size_) +
                                   ")");
  }
  return CoordOfUnchecked(rank);
}

Result<int> Topology::RankOf(const Coord& c) const {
  for (int i = 0; i < 4; ++i) {
    const Dim d = static_cast<Dim>(i);
    const int v = Get(c, d);
    if (v < 0 || v >= size(d)) {
      return Status::InvalidArgument("topology: coordinate " + std::string(DimName(d)) + "=" +
                                     std::to_string(v) + " is outside [0, " +
                                     std::to_string(size(d)) + ")");
    }
  }
  return RankOfUnchecked(c);
}

int Topology::IndexInGroup(GroupKind kind, const Coord& c) const {
  int index = 0;
  for (Dim d : VaryingDims(kind)) index = index * size(d) + Get(c, d);
  return index;
}

Result<std::vector<int>> Topology::GroupOf(GroupKind kind, int rank) const {
  THDPACK_ASSIGN_OR_RETURN(Coord base, CoordOf(rank));
  const std::vector<Dim> dims = VaryingDims(kind);
  int count = 1;
  for (Dim d : dims) count *= size(d);
  std::vector<int> group(count);
  for (int i = 0; i < count; ++i) {
    Coord c = base;
    int rest = i;
    for (auto it = dims.rbegin(); it != dims.rend(); ++it) {  // last varying dim is fastest
      Set(c, *it, rest % size(*it));
      rest /= size(*it);
    }
    group[i] = RankOfUnchecked(c);
  }
  return group;
}

Result<std::vector<int>> Topology::DomainRanks(int first, int count, int tp, int pp) const {
  const int domain = dp_size() * cp_size();
  if (first < 0 || count < 1 || first > domain - count) {
    return Status::InvalidArgument("domain group [" + std::to_string(first) + ", +" +
                                   std::to_string(count) + ") outside the domain of " +
                                   std::to_string(domain) + " ranks (DP x CP) of " + ToString());
  }
  std::vector<int> out;
  out.reserve(static_cast<size_t>(count));
  for (int d = first; d < first + count; ++d) {
    THDPACK_ASSIGN_OR_RETURN(int r, RankOf(Coord{tp, d % cp_size(), d / cp_size(), pp}));
    out.push_back(r);
  }
  return out;
}

std::vector<std::vector<int>> Topology::AllGroups(GroupKind kind) const {
  std::vector<std::vector<int>> groups;
  std::vector<bool> placed(world_size_, false);
  for (int r = 0; r < world_size_; ++r) {
    if (placed[r]) continue;
    std::vector<int> g = GroupOf(kind, r).value();  // r is in range
    for (int m : g) placed[m] = true;
    groups.push_back(std::move(g));
  }
  return groups;
}

std::string Topology::ToString() const {
  return "TP=" + std::to_string(tp_size()) + " CP=" + std::to_string(cp_size()) +
         " DP=" + std::to_string(dp_size()) + " PP=" + std::to_string(pp_size()) + " (order " +
         order() + ")";
}

}  // namespace thdpack
