// torch_cam._C's MoE row loops for groups that span hosts (csrc/moe/gathered_rows.hpp).
#include <torch/csrc/utils/pybind.h>

#include <optional>

#include "../moe/gathered_rows.hpp"

namespace py = pybind11;

void bind_moe_rows(py::module& m) {
  m.def(
      "moe_place_rows",
      [](const at::Tensor& src, const at::Tensor& pos, at::Tensor dst) { cam::moe::place_rows(src, pos, dst); },
      py::arg("src"), py::arg("pos"), py::arg("dst"), py::call_guard<py::gil_scoped_release>(),
      "dst[pos[i]] = src[i] (uint8 rows, one memcpy each)");
  m.def(
      "moe_quantize_rows",
      [](const at::Tensor& rows, std::optional<at::Tensor> smooth, std::optional<at::Tensor> smooth_index) {
        at::Tensor q = at::empty(rows.sizes(), rows.options().dtype(at::kChar));
        at::Tensor scales = at::empty({rows.size(0)}, rows.options().dtype(at::kFloat));
        cam::moe::quantize_rows(rows, smooth.value_or(at::Tensor()), smooth_index.value_or(at::Tensor()), q, scales);
        return std::make_tuple(q, scales);
      },
      py::arg("rows"), py::arg("smooth") = py::none(), py::arg("smooth_index") = py::none(),
      py::call_guard<py::gil_scoped_release>(), "(int8 rows, float32 scales): dynamic int8 of each row");
  m.def(
      "moe_weighted_sum_rows",
      [](const at::Tensor& rows, std::optional<at::Tensor> scales, const at::Tensor& index,
         std::optional<at::Tensor> weights, std::optional<at::Tensor> add, bool add_first, at::Tensor out) {
        cam::moe::weighted_sum_rows(rows, scales.value_or(at::Tensor()), index, weights.value_or(at::Tensor()),
                                    add.value_or(at::Tensor()), add_first, out);
        return out;
      },
      py::arg("rows"), py::arg("scales"), py::arg("index"), py::arg("weights"), py::arg("add"),
      py::arg("add_first"), py::arg("out"), py::call_guard<py::gil_scoped_release>(),
      "out[t] = sum over s of weights[t, s] * rows[index[t, s]] (+ add), in fp32, rounded once");
}
