// torch_cam._C's AFD part: the row loops of torch_cam/afd.py (csrc/afd/afd_rows.hpp). Python
// builds every tensor passed here from the channel's own buffers; the checks below keep a
// mistake there an exception rather than a stray write.
#include <torch/csrc/utils/pybind.h>
#include <pybind11/stl.h>

#include <optional>
#include <tuple>

#include "../afd/afd_rows.hpp"
#include "../../kernels/moe_rows.hpp"

namespace py = pybind11;

namespace {
using Posted = std::tuple<at::Tensor, at::Tensor, at::Tensor, std::optional<at::Tensor>, int64_t>;

void check_buffer(const at::Tensor& t, at::ScalarType dtype, int64_t min_numel, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == dtype && t.numel() >= min_numel,
              "cam afd: ", what, " must be a contiguous CPU ", dtype, " tensor of at least ", min_numel,
              " elements, got ", t.scalar_type(), " ", t.sizes());
}
}  // namespace

void bind_afd(py::module& m) {
  m.def(
      "afd_check_routing",
      [](const at::Tensor& ids, int64_t num_experts) {
        TORCH_CHECK(ids.dim() == 2, "cam afd: expert ids must be 2-D (tokens, top-k), got ", ids.sizes());
        check_buffer(ids, at::kInt, 0, "expert ids");
        return cam::afd::check_routing(ids.data_ptr<int32_t>(), ids.size(0), ids.size(1), num_experts);
      },
      py::arg("ids"), py::arg("num_experts"), py::call_guard<py::gil_scoped_release>());
  m.def(
      "afd_gather",
      [](const std::vector<Posted>& sources, int64_t topk, int64_t num_experts, int64_t first_expert,
         int64_t local_experts, bool shared, int64_t ffn_index, int64_t ffn_count, at::Tensor out_rows,
         std::optional<at::Tensor> out_scales, at::Tensor out_weights, at::Tensor out_info,
         at::Tensor out_counts, at::Tensor token_rows, int64_t max_tokens) {
        TORCH_CHECK(out_rows.dim() == 2 && out_rows.is_contiguous(), "cam afd: out_rows must be contiguous 2-D");
        const int64_t cap = out_rows.size(0);
        const int64_t row_bytes = out_rows.size(1) * int64_t(out_rows.element_size());
        const bool quantized = out_scales.has_value();
        if (quantized) check_buffer(*out_scales, at::kFloat, cap, "out_scales");
        check_buffer(out_weights, at::kFloat, cap, "out_weights");
        check_buffer(out_info, at::kInt, 3 * cap, "out_info");
        check_buffer(out_counts, at::kLong, local_experts + (shared ? 1 : 0), "out_counts");
        check_buffer(token_rows, at::kInt, int64_t(sources.size()) * max_tokens * (topk + 1), "token_rows");
        std::vector<cam::afd::PostedTokens> src;
        for (const auto& [ids, weights, rows, scales, bs] : sources) {
          check_buffer(ids, at::kInt, bs * topk, "posted ids");
          check_buffer(weights, at::kFloat, bs * topk, "posted weights");
          TORCH_CHECK(rows.is_contiguous() && int64_t(rows.nbytes()) >= bs * row_bytes,
                      "cam afd: posted rows hold fewer than ", bs, " rows of ", row_bytes, " bytes");
          TORCH_CHECK(scales.has_value() == quantized, "cam afd: posted scales must come with int8 rows");
          if (quantized) check_buffer(*scales, at::kFloat, bs, "posted scales");
          TORCH_CHECK(bs >= 0 && bs <= max_tokens, "cam afd: a posted batch of ", bs, " exceeds ", max_tokens);
          cam::afd::PostedTokens p;
          p.ids = ids.data_ptr<int32_t>();
          p.weights = weights.data_ptr<float>();
          p.rows = static_cast<const char*>(rows.data_ptr());
          p.scales = quantized ? scales->data_ptr<float>() : nullptr;
          p.bs = bs;
          src.push_back(p);
        }
        cam::afd::ExpertPlacement p;
        p.topk = topk;
        p.hidden = out_rows.size(1);
        p.num_experts = num_experts;
        p.first_expert = first_expert;
        p.local_experts = local_experts;
        p.shared = shared;
        p.ffn_index = ffn_index;
        p.ffn_count = ffn_count;
        return cam::afd::gather_tokens(src, p, row_bytes, quantized, cap, max_tokens,
                                       static_cast<char*>(out_rows.data_ptr()),
                                       quantized ? out_scales->data_ptr<float>() : nullptr,
                                       out_weights.data_ptr<float>(), out_info.data_ptr<int32_t>(),
                                       out_counts.data_ptr<int64_t>(), token_rows.data_ptr<int32_t>());
      },
      py::arg("sources"), py::arg("topk"), py::arg("num_experts"), py::arg("first_expert"),
      py::arg("local_experts"), py::arg("shared"), py::arg("ffn_index"), py::arg("ffn_count"),
      py::arg("out_rows"), py::arg("out_scales"), py::arg("out_weights"), py::arg("out_info"),
      py::arg("out_counts"), py::arg("token_rows"), py::arg("max_tokens"), py::call_guard<py::gil_scoped_release>(),
      "Rows of this FFN rank's experts from every posted message; returns the row count or -count-1");
  m.def(
      "afd_scatter",
      [](const at::Tensor& rows, const at::Tensor& info, const std::vector<at::Tensor>& dest,
         const std::vector<int64_t>& dest_tokens, int64_t rows_per_token) {
        TORCH_CHECK(rows.dim() == 2 && rows.is_contiguous(), "cam afd: expert outputs must be contiguous 2-D");
        const int64_t n = rows.size(0), row_bytes = rows.size(1) * int64_t(rows.element_size());
        check_buffer(info, at::kInt, 3 * n, "row info");
        TORCH_CHECK(dest.size() == dest_tokens.size(), "cam afd: one token count per destination");
        std::vector<char*> d;
        for (size_t a = 0; a < dest.size(); ++a) {
          TORCH_CHECK(dest[a].is_contiguous() &&
                          int64_t(dest[a].nbytes()) >= dest_tokens[a] * rows_per_token * row_bytes,
                      "cam afd: receive area ", a, " is smaller than ", dest_tokens[a], " tokens");
          d.push_back(static_cast<char*>(dest[a].data_ptr()));
        }
        const int32_t* in = info.data_ptr<int32_t>();
        for (int64_t i = 0; i < n; ++i) {
          const int32_t a = in[3 * i], t = in[3 * i + 1], k = in[3 * i + 2];
          TORCH_CHECK(a >= 0 && size_t(a) < d.size() && t >= 0 && t < dest_tokens[size_t(a)] && k >= 0 &&
                          k < rows_per_token,
                      "cam afd: row ", i, " names no receive slot (", a, ", ", t, ", ", k, ")");
        }
        cam::afd::scatter_outputs(static_cast<const char*>(rows.data_ptr()), n, row_bytes, in, d, rows_per_token);
      },
      py::arg("rows"), py::arg("info"), py::arg("dest"), py::arg("dest_tokens"), py::arg("rows_per_token"),
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "afd_reduce",
      [](const at::Tensor& rows, const at::Tensor& weights, const at::Tensor& token_rows,
         const std::vector<at::Tensor>& dest, const std::vector<int64_t>& tokens, int64_t max_tokens, int64_t topk,
         int64_t ffn_index, int64_t ffn_count) {
        TORCH_CHECK(rows.dim() == 2 && rows.is_contiguous() && cam::kernels::moe_row_dtype_supported(rows.scalar_type()),
                    "cam afd: expert outputs must be contiguous 2-D float32/bfloat16/float16");
        const int64_t n = rows.size(0), H = rows.size(1);
        check_buffer(weights, at::kFloat, n, "row weights");
        TORCH_CHECK(dest.size() == tokens.size(), "cam afd: one token count per destination");
        check_buffer(token_rows, at::kInt, int64_t(dest.size()) * max_tokens * (topk + 1), "token_rows");
        TORCH_CHECK(ffn_index >= 0 && ffn_index < ffn_count, "cam afd: ffn index ", ffn_index, " of ", ffn_count);
        std::vector<float*> d;
        for (size_t a = 0; a < dest.size(); ++a) {
          TORCH_CHECK(tokens[a] >= 0 && tokens[a] <= max_tokens, "cam afd: ", tokens[a], " tokens exceed ", max_tokens);
          check_buffer(dest[a], at::kFloat, tokens[a] * ffn_count * H, "receive area");
          d.push_back(dest[a].data_ptr<float>());
          const int32_t* tr = token_rows.data_ptr<int32_t>() + int64_t(a) * max_tokens * (topk + 1);
          for (int64_t i = 0; i < tokens[a] * (topk + 1); ++i) {
            TORCH_CHECK(tr[i] >= -1 && tr[i] < n, "cam afd: token row ", tr[i], " is not one of the ", n, " rows");
          }
        }
        cam::afd::reduce_outputs(static_cast<const char*>(rows.data_ptr()), rows.scalar_type(), H,
                                 weights.data_ptr<float>(), token_rows.data_ptr<int32_t>(), tokens, max_tokens, topk,
                                 d, ffn_index, ffn_count);
      },
      py::arg("rows"), py::arg("weights"), py::arg("token_rows"), py::arg("dest"), py::arg("tokens"),
      py::arg("max_tokens"), py::arg("topk"), py::arg("ffn_index"), py::arg("ffn_count"),
      py::call_guard<py::gil_scoped_release>(),
      "The FFN rank's weighted partial sums into the attention ranks' receive areas");
  m.def(
      "afd_combine_partials",
      [](const at::Tensor& recv, const at::Tensor& ids, int64_t experts_per_rank, bool shared, at::Tensor out) {
        TORCH_CHECK(recv.dim() == 3 && recv.is_contiguous() && recv.scalar_type() == at::kFloat && out.dim() == 2 &&
                        out.is_contiguous() && ids.dim() == 2 && cam::kernels::moe_row_dtype_supported(out.scalar_type()),
                    "cam afd: combine expects a contiguous (B, N, H) float32 receive area, (bs, K) ids, (bs, H) output");
        const int64_t bs = out.size(0), H = out.size(1), K = ids.size(1), N = recv.size(1);
        TORCH_CHECK(recv.size(0) >= bs && recv.size(2) == H && ids.size(0) == bs && N >= 1 && experts_per_rank >= 1,
                    "cam afd: receive area ", recv.sizes(), " does not fit ", bs, " tokens of H ", H);
        check_buffer(ids, at::kInt, bs * K, "ids");
        const int32_t* id = ids.data_ptr<int32_t>();
        for (int64_t i = 0; i < bs * K; ++i) {
          TORCH_CHECK(id[i] >= -1 && id[i] < N * experts_per_rank, "cam afd: expert id ", id[i], " out of range");
        }
        cam::afd::combine_partials(recv.data_ptr<float>(), id, bs, K, H, experts_per_rank, N, shared,
                                   out.scalar_type(), static_cast<char*>(out.data_ptr()));
      },
      py::arg("recv"), py::arg("ids"), py::arg("experts_per_rank"), py::arg("shared"), py::arg("out"),
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "afd_combine",
      [](const at::Tensor& recv, const at::Tensor& ids, const at::Tensor& weights, bool shared, at::Tensor out) {
        TORCH_CHECK(recv.dim() == 3 && recv.is_contiguous() && out.dim() == 2 && out.is_contiguous() && ids.dim() == 2,
                    "cam afd: combine expects a contiguous (B, K + shared, H) receive area, (bs, K) ids and (bs, H) output");
        const int64_t bs = out.size(0), H = out.size(1), K = ids.size(1);
        TORCH_CHECK(recv.size(0) >= bs && recv.size(1) == K + (shared ? 1 : 0) && recv.size(2) == H,
                    "cam afd: receive area ", recv.sizes(), " does not fit ", bs, " tokens of top-", K, " and H ", H);
        TORCH_CHECK(ids.size(0) == bs, "cam afd: ids ", ids.sizes(), " do not match ", bs, " tokens");
        check_buffer(ids, at::kInt, bs * K, "ids");
        check_buffer(weights, at::kFloat, bs * K, "weights");
        TORCH_CHECK(cam::kernels::moe_row_dtype_supported(recv.scalar_type()) &&
                        cam::kernels::moe_row_dtype_supported(out.scalar_type()),
                    "cam afd: combine handles float32, bfloat16 and float16");
        cam::afd::combine_outputs(static_cast<const char*>(recv.data_ptr()), recv.scalar_type(),
                                  ids.data_ptr<int32_t>(), weights.data_ptr<float>(), bs, K, H, shared,
                                  out.scalar_type(), static_cast<char*>(out.data_ptr()));
      },
      py::arg("recv"), py::arg("ids"), py::arg("weights"), py::arg("shared"), py::arg("out"),
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "afd_quantize",
      [](const at::Tensor& x, at::Tensor q, at::Tensor scales) {
        TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && cam::kernels::moe_row_dtype_supported(x.scalar_type()),
                    "cam afd: quantize expects contiguous 2-D float32/bfloat16/float16 rows");
        const int64_t bs = x.size(0), H = x.size(1);
        check_buffer(q, at::kChar, bs * H, "int8 rows");
        check_buffer(scales, at::kFloat, bs, "scales");
        cam::afd::quantize_tokens(static_cast<const char*>(x.data_ptr()), x.scalar_type(), bs, H,
                                  q.data_ptr<int8_t>(), scales.data_ptr<float>());
      },
      py::arg("x"), py::arg("q"), py::arg("scales"), py::call_guard<py::gil_scoped_release>());
}
