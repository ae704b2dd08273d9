// thdpack/topology.h: the parallel layout of the world and its process groups.
//
// World = TP x CP x DP x PP ranks. A rank's coordinates (tp, cp, dp, pp) map to a global rank
// by a rank order, a permutation of the four dimensions written fastest first. The default is
// Megatron's "tp-cp-dp-pp": rank = tp + TP*(cp + CP*(dp + DP*pp)).
//
// Groups are values derived from the topology: an ordered list of global ranks. Every function
// that communicates takes its group explicitly; there is no "current group" anywhere, and
// routing uses these lists rather than arithmetic that assumes one rank order.
//   TP group of a rank:    the ranks sharing (cp, dp, pp), ordered by tp.
//   CP group:              sharing (tp, dp, pp), ordered by cp.
//   DP group:              sharing (tp, cp, pp), ordered by dp.
//   DPxCP group:           sharing (tp, pp), ordered by dp then cp (cp fastest): position
//                          dp*CP + cp. This is the group gradients are reduced over.
//   PP group:              sharing (tp, cp, dp), ordered by pp (stage order).
//
// Thread-safety: an immutable value after Create; safe to share between threads.
#ifndef THDPACK_TOPOLOGY_H_
#define THDPACK_TOPOLOGY_H_

#include <array>
#include <string>
#include <string_view>
#include <vector>

#include "thdpack/status.h"

namespace thdpack {

enum class Dim : int { kTp = 0, kCp = 1, kDp = 2, kPp = 3 };

enum class GroupKind : int { kTp, kCp, kDp, kDpCp, kPp };

// "tp", "cp", "dp", "pp"; and "tp", "cp", "dp", "dp-cp", "pp" for groups.
std::string_view DimName(Dim dim);
std::string_view GroupKindName(GroupKind kind);

struct Coord {
  int tp = 0;
  int cp = 0;
  int dp = 0;
  int pp = 0;
  friend bool operator==(const Coord&, const Coord&) = default;
};

// The default rank order, Megatron's.
inline constexpr std::string_view kDefaultRankOrder = "tp-cp-dp-pp";

class Topology {
 public:
  // REQUIRES: every size >= 1, the world size fits int32, and `order` is a '-'-separated
  // permutation of tp, cp, dp, pp (fastest first). Errors name the bad argument.
  [[nodiscard]] static Result<Topology> Create(int tp, int cp, int dp, int pp,
                                               std::string_view order = kDefaultRankOrder);

  int tp_size() const { return size_[0]; }
  int cp_size() const { return size_[1]; }
  int dp_size() const { return size_[2]; }
  int pp_size() const { return size_[3]; }
  int size(Dim dim) const { return size_[static_cast<int>(dim)]; }
  int world_size() const { return world_size_; }
  // The order as given, normalised (e.g. "tp-cp-dp-pp").
  std::string order() const;

  // REQUIRES (checked, error otherwise): 0 <= rank < world_size.
  [[nodiscard]] Result<Coord> CoordOf(int rank) const;
  // REQUIRES (checked): every coordinate within its size.
  [[nodiscard]] Result<int> RankOf(const Coord& coord) const;

  // The group of `kind` that contains `rank`, ordered as documented above.
  [[nodiscard]] Result<std::vector<int>> GroupOf(GroupKind kind, int rank) const;
  // Every group of `kind`, each ordered as above; groups ordered by their smallest rank.
  // Together they partition the world.
  std::vector<std::vector<int>> AllGroups(GroupKind kind) const;

  // A rank's position inside its group of `kind` (e.g. its cp index for kCp, dp*CP+cp for kDpCp).
  int IndexInGroup(GroupKind kind, const Coord& c) const;

  // The dynamic scheduler's CP group of domain indices first .. first + count - 1 (the domain:
  // the DP x CP ranks, index dp*CP + cp) at (tp, pp): its world ranks in domain order. The one
  // rule the step runner, the CP group cache and the bindings use. REQUIRES (checked):
  // 0 <= first, 1 <= count, first + count <= DP*CP, tp and pp within their sizes.
  [[nodiscard]] Result<std::vector<int>> DomainRanks(int first, int count, int tp, int pp) const;

  // "TP=2 CP=2 DP=2 PP=1 (order tp-cp-dp-pp)".
  std::string ToString() const;

 private:
  Topology() = default;
  int RankOfUnchecked(const Coord& c) const;
  Coord CoordOfUnchecked(int rank) const;

  std::array<int, 4> size_{1, 1, 1, 1};      // indexed by Dim
  std::array<Dim, 4> order_{Dim::kTp, Dim::kCp, Dim::kDp, Dim::kPp};  // fastest first
  std::array<int, 4> stride_{1, 1, 1, 1};    // indexed by Dim
  int world_size_ = 1;
};

}  // namespace thdpack

#endif  // THDPACK_TOPOLOGY_H_
