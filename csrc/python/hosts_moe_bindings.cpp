// torch_cam._C.HostsMoe: MoE dispatch and combine on groups that span hosts
// (csrc/moe/hosts_moe.hpp), with the same Python signature as CamBackend's.
#include <torch/csrc/utils/pybind.h>
#include <pybind11/stl.h>
#include <torch/csrc/Dtype.h>

#include <optional>

#include "../moe/hosts_moe.hpp"
#include "../runtime/done_work.hpp"
#include "moe_op_bindings.hpp"

namespace py = pybind11;

void bind_hosts_moe(py::module& m) {
  using cam::moe::HostsMoe;
  py::class_<HostsMoe, std::shared_ptr<HostsMoe>> cls(
      m, "HostsMoe", "MoE dispatch and combine of a group across hosts, over the group's collectives");
  cls.def(py::init<c10::intrusive_ptr<c10d::Backend>, int, int>(), py::arg("backend"), py::arg("rank"),
          py::arg("size"))
      .def("runs_on", [](const HostsMoe& h, const c10::intrusive_ptr<c10d::Backend>& b) { return h.backend() == b; },
           py::arg("backend"), "Whether this runs over `backend`")
      .def_property_readonly("rank", &HostsMoe::rank)
      .def_property_readonly("size", &HostsMoe::size)
      .def_property("inline_ints", &HostsMoe::inline_ints, &HostsMoe::set_inline_ints,
                    "Counts that ride inline in the first all-gather; longer ones take a second")
      .def_property("two_hop_min_bytes", &HostsMoe::two_hop_min_bytes, &HostsMoe::set_two_hop_min_bytes,
                    "Bytes between hosts from which dispatch and combine cross in two hops (where hosts allow it; 0: always)")
      .def_property_readonly("two_hop_possible", &HostsMoe::two_hop_possible,
                             "Whether this group's hosts allow two hops (equal sizes, more than one rank each)")
      .def_property_readonly("host_of", &HostsMoe::host_of,
                             "Each group rank's host index where two hops are possible (else empty): what "
                             "moe_reference's `hosts` takes")
      .def(
          "refuse",
          [](HostsMoe& h, const std::string& kind, const std::string& op, const std::string& reason) {
            h.refuse(kind, op, reason);
          },
          py::arg("kind"), py::arg("op"), py::arg("reason"), py::call_guard<py::gil_scoped_release>(),
          "Takes part in the group's next MoE op as a refusal: every rank raises naming this rank and the reason")
      .def(
          "all_gather_counts",
          [](HostsMoe& h, const std::string& op, std::optional<at::Tensor> counts, const std::string& reason) {
            return h.all_gather_counts(op, counts.value_or(at::Tensor()), reason);
          },
          py::arg("op"), py::arg("counts"), py::arg("reason"), py::call_guard<py::gil_scoped_release>(),
          "(W, n) int32: every rank's counts, or any rank's refusal raised on every rank")
      .def(
          "moe_empty",
          [](HostsMoe&, const std::vector<int64_t>& sizes, py::object dtype) {
            return at::empty(sizes, reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type);
          },
          py::arg("sizes"), py::arg("dtype"), "An MoE output tensor")
      .def(
          "stats",
          [](HostsMoe& h) {
            py::dict d;
            d["two_hop_dispatches"] = h.two_hop_dispatches();
            d["direct_dispatches"] = h.direct_dispatches();
            d["two_hop_combines"] = h.two_hop_combines();
            d["direct_combines"] = h.direct_combines();
            return d;
          },
          "Dispatches and combines so far by path (nothing is staged across hosts)");
  cam::python::def_moe_ops(
      cls,
      [](HostsMoe& h, cam::MoeDispatchArgs a, std::chrono::milliseconds) {
        h.dispatch(a);
        return cam::done_work(h.rank(), c10d::OpType::UNKNOWN, {a.out_rows});
      },
      [](HostsMoe& h, cam::MoeCombineArgs a, std::chrono::milliseconds) {
        h.combine(a);
        return cam::done_work(h.rank(), c10d::OpType::UNKNOWN, {a.out});
      });
}
