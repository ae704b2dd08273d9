// python/src/bind_topology.cc: thdpack.Topology, the C++ Topology (thdpack/topology.h) - the
// one owner of how world ranks map to (tp, cp, dp, pp) under a rank order, and of which ranks
// form each group. Python asks it (thdpack.torch.Groups checks the caller's groups against it)
// instead of restating the arithmetic.
//
//   thdpack.Topology(tp=1, cp=1, dp=1, pp=1, order="tp-cp-dp-pp")
//       .sizes -> {"tp", "cp", "dp", "pp"}    .order -> "tp-cp-dp-pp"    .world_size
//       .coord_of(rank) -> {"tp", "cp", "dp", "pp"}
//       .rank_of(tp=0, cp=0, dp=0, pp=0) -> int
//       .group_of(kind, rank) -> [world ranks]   kind: "tp" | "cp" | "dp" | "dp-cp" | "pp"
#include <string>
#include <vector>

#include "common.h"
#include "thdpack/topology.h"

namespace thdpack::python {
namespace {

GroupKind ParseGroupKind(const std::string& kind) {
  for (GroupKind k : {GroupKind::kTp, GroupKind::kCp, GroupKind::kDp, GroupKind::kDpCp,
                      GroupKind::kPp}) {
    if (kind == GroupKindName(k)) return k;
  }
  throw py::value_error("kind: \"" + kind + "\" is not one of tp, cp, dp, dp-cp, pp");
}

py::dict CoordDict(const Coord& c) {
  py::dict d;
  d["tp"] = c.tp;
  d["cp"] = c.cp;
  d["dp"] = c.dp;
  d["pp"] = c.pp;
  return d;
}

}  // namespace

void BindTopology(py::module_& m) {
  py::class_<Topology>(m, "Topology",
                       "The parallel layout of a world: sizes, the rank order (fastest first) "
                       "and the groups each rank belongs to (thdpack/topology.h).")
      .def(py::init([](int tp, int cp, int dp, int pp, const std::string& order) {
             return ValueOrThrow(Topology::Create(tp, cp, dp, pp, order));
           }),
           py::arg("tp") = 1, py::arg("cp") = 1, py::arg("dp") = 1, py::arg("pp") = 1,
           py::arg("order") = std::string(kDefaultRankOrder))
      .def_property_readonly("sizes",
                             [](const Topology& t) {
                               return CoordDict(Coord{t.tp_size(), t.cp_size(), t.dp_size(),
                                                      t.pp_size()});
                             })
      .def_property_readonly("order", &Topology::order)
      .def_property_readonly("world_size", &Topology::world_size)
      .def(
          "coord_of",
          [](const Topology& t, int rank) { return CoordDict(ValueOrThrow(t.CoordOf(rank))); },
          py::arg("rank"), "The coordinates of world rank `rank`.")
      .def(
          "rank_of",
          [](const Topology& t, int tp, int cp, int dp, int pp) {
            return ValueOrThrow(t.RankOf(Coord{tp, cp, dp, pp}));
          },
          py::kw_only(), py::arg("tp") = 0, py::arg("cp") = 0, py::arg("dp") = 0,
          py::arg("pp") = 0, "The world rank at these coordinates.")
      .def(
          "group_of",
          [](const Topology& t, const std::string& kind, int rank) {
            return ValueOrThrow(t.GroupOf(ParseGroupKind(kind), rank));
          },
          py::arg("kind"), py::arg("rank"),
          "The world ranks of `rank`'s group of `kind` (tp, cp, dp, dp-cp, pp), in group order.")
      .def("__repr__", &Topology::ToString);
}

}  // namespace thdpack::python
