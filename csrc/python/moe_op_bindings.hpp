// The Python signature of the two MoE ops (torch_cam/moe.py and moe_buffer.py call them by
// keyword), stated once for every class that runs them: CamBackend (one host) and HostsMoe
// (groups across hosts). `dispatch` / `combine` take (self, args, timeout) and return a Work.
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <chrono>
#include <optional>

#include "../moe/moe_ops.hpp"

namespace cam::python {

template <class Class, class Dispatch, class Combine>
void def_moe_ops(Class& cls, Dispatch dispatch, Combine combine) {
  namespace py = pybind11;
  using Self = typename Class::type;
  cls.def(
      "moe_dispatch",
      [dispatch](Self& self, at::Tensor rows, at::Tensor ids, std::optional<at::Tensor> weights,
                 std::optional<at::Tensor> aux, at::Tensor token_active, std::optional<at::Tensor> smooth,
                 int64_t smooth_shift, int64_t num_experts, int64_t shared_ranks, int64_t experts_per_rank, bool quant,
                 int64_t slab_rows, int64_t max_tokens, at::Tensor out_rows, std::optional<at::Tensor> out_scales,
                 std::optional<at::Tensor> out_weights, std::optional<at::Tensor> out_info, int64_t info_stride,
                 std::optional<at::Tensor> out_aux, at::Tensor out_counts, std::optional<at::Tensor> out_occurrence,
                 std::optional<at::Tensor> wait_us, double timeout_s) {
        MoeDispatchArgs a;
        a.rows = rows;
        a.ids = ids;
        a.weights = weights.value_or(at::Tensor());
        a.aux = aux.value_or(at::Tensor());
        a.token_active = token_active;
        a.smooth = smooth.value_or(at::Tensor());
        a.smooth_shift = smooth_shift;
        a.num_experts = num_experts;
        a.shared_ranks = int32_t(shared_ranks);
        a.experts_per_rank = int32_t(experts_per_rank);
        a.quant = quant;
        a.slab_rows = slab_rows;
        a.max_tokens = max_tokens;
        a.out_rows = out_rows;
        a.out_scales = out_scales.value_or(at::Tensor());
        a.out_weights = out_weights.value_or(at::Tensor());
        a.out_info = out_info.value_or(at::Tensor());
        a.info_stride = info_stride;
        a.out_aux = out_aux.value_or(at::Tensor());
        a.out_counts = out_counts;
        a.out_occurrence = out_occurrence.value_or(at::Tensor());
        a.wait_us = wait_us.value_or(at::Tensor());
        return dispatch(self, std::move(a), std::chrono::milliseconds(int64_t(timeout_s * 1000)));
      },
      py::arg("rows"), py::arg("ids"), py::arg("weights"), py::arg("aux"), py::arg("token_active"), py::arg("smooth"),
      py::arg("smooth_shift"), py::arg("num_experts"), py::arg("shared_ranks"), py::arg("experts_per_rank"),
      py::arg("quant"), py::arg("slab_rows"), py::arg("max_tokens"), py::arg("out_rows"), py::arg("out_scales"),
      py::arg("out_weights"), py::arg("out_info"), py::arg("info_stride"), py::arg("out_aux"), py::arg("out_counts"),
      py::arg("out_occurrence") = py::none(), py::arg("wait_us") = py::none(), py::arg("timeout_s") = 0.0,
      py::call_guard<py::gil_scoped_release>(), "MoE dispatch (see torch_cam/moe.py); returns a Work");
  cls.def(
      "moe_combine",
      [combine](Self& self, at::Tensor rows, at::Tensor segments, bool quant, at::Tensor plan_peer, at::Tensor plan_seg,
                at::Tensor plan_off, std::optional<at::Tensor> plan_weight, std::optional<at::Tensor> add,
                bool add_first, at::Tensor out, std::optional<at::Tensor> wait_us, double timeout_s) {
        MoeCombineArgs a;
        a.rows = rows;
        a.segments = segments;
        a.quant = quant;
        a.plan_peer = plan_peer;
        a.plan_seg = plan_seg;
        a.plan_off = plan_off;
        a.plan_weight = plan_weight.value_or(at::Tensor());
        a.add = add.value_or(at::Tensor());
        a.add_first = add_first;
        a.out = out;
        a.wait_us = wait_us.value_or(at::Tensor());
        return combine(self, std::move(a), std::chrono::milliseconds(int64_t(timeout_s * 1000)));
      },
      py::arg("rows"), py::arg("segments"), py::arg("quant"), py::arg("plan_peer"), py::arg("plan_seg"),
      py::arg("plan_off"), py::arg("plan_weight"), py::arg("add"), py::arg("add_first"), py::arg("out"),
      py::arg("wait_us") = py::none(), py::arg("timeout_s") = 0.0, py::call_guard<py::gil_scoped_release>(),
      "MoE combine (see torch_cam/moe.py); returns a Work");
}

}  // namespace cam::python
