#include "gathered_rows.hpp"

#include <cstring>
#include <vector>

#include "../../kernels/moe_rows.hpp"

namespace cam::moe {

namespace {
void need_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.defined() && t.device().is_cpu() && t.is_contiguous() && t.dim() == 2, "cam moe: ", what,
              " must be a contiguous 2-D CPU tensor");
}
}  // namespace

void place_rows(const at::Tensor& src, const at::Tensor& pos, at::Tensor& dst) {
  need_rows(dst, "the placed-into rows");
  TORCH_CHECK(src.defined() && src.device().is_cpu() && src.dim() == 2 && src.scalar_type() == at::kByte &&
                  dst.scalar_type() == at::kByte && src.stride(1) == 1 && src.size(1) == dst.size(1),
              "cam moe: rows to place must be uint8 rows of the destination's width");
  TORCH_CHECK(pos.defined() && pos.is_contiguous() && pos.scalar_type() == at::kLong && pos.numel() == src.size(0),
              "cam moe: one int64 position per row to place");
  const int64_t n = src.size(0), m = dst.size(0), width = dst.size(1), stride = src.stride(0);
  const int64_t* at = pos.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(at[i] >= 0 && at[i] < m, "cam moe: row ", i, " goes to position ", at[i], " of ", m);
  }
  const uint8_t* from = src.data_ptr<uint8_t>();
  uint8_t* to = dst.data_ptr<uint8_t>();
  for (int64_t i = 0; i < n; ++i) std::memcpy(to + at[i] * width, from + i * stride, static_cast<size_t>(width));
}

void quantize_rows(const at::Tensor& rows, const at::Tensor& smooth, const at::Tensor& smooth_index,
                   at::Tensor& q, at::Tensor& scales) {
  need_rows(rows, "rows");
  need_rows(q, "the int8 rows");
  const int64_t n = rows.size(0), H = rows.size(1);
  const auto dtype = rows.scalar_type();
  TORCH_CHECK(kernels::moe_row_dtype_supported(dtype), "cam moe: int8 quantization takes float rows, got ", dtype);
  TORCH_CHECK(q.scalar_type() == at::kChar && q.size(0) == n && q.size(1) == H, "cam moe: the int8 rows must be (",
              n, ", ", H, ") int8");
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kFloat && scales.numel() == n,
              "cam moe: scales must be ", n, " contiguous float32");
  const float* sm = nullptr;
  const int64_t* si = nullptr;
  if (smooth.defined()) {
    need_rows(smooth, "smooth scales");
    TORCH_CHECK(smooth.scalar_type() == at::kFloat && smooth.size(1) == H, "cam moe: smooth scales must be float32 (n, ", H, ")");
    TORCH_CHECK(smooth_index.defined() && smooth_index.is_contiguous() && smooth_index.scalar_type() == at::kLong &&
                    smooth_index.numel() == n, "cam moe: smooth rows must be ", n, " int64");
    sm = smooth.data_ptr<float>();
    si = smooth_index.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK(si[i] >= 0 && si[i] < smooth.size(0), "cam moe: smooth row ", si[i], " outside the ",
                  smooth.size(0), " rows of scales");
    }
  }
  const char* src = static_cast<const char*>(rows.data_ptr());
  const int64_t row_bytes = H * int64_t(rows.element_size());
  int8_t* out = q.data_ptr<int8_t>();
  float* sc = scales.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    kernels::quantize_row_int8(dtype, src + i * row_bytes, sm ? sm + si[i] * H : nullptr, H, out + i * H, sc + i);
  }
}

void weighted_sum_rows(const at::Tensor& rows, const at::Tensor& scales, const at::Tensor& index,
                       const at::Tensor& weights, const at::Tensor& add, bool add_first, at::Tensor& out) {
  need_rows(rows, "rows");
  need_rows(out, "the output");
  need_rows(index, "the plan");
  const int64_t n = rows.size(0), H = rows.size(1), T = out.size(0), P = index.size(1);
  const auto dtype = rows.scalar_type(), out_dtype = out.scalar_type();
  const bool int8 = dtype == at::kChar;
  TORCH_CHECK(int8 || kernels::moe_row_dtype_supported(dtype), "cam moe: rows must be float or int8, got ", dtype);
  TORCH_CHECK(kernels::moe_row_dtype_supported(out_dtype) && out.size(1) == H, "cam moe: the output must be float (T, ", H, ")");
  TORCH_CHECK(index.scalar_type() == at::kLong && index.size(0) == T, "cam moe: the plan must be int64 (", T, ", P)");
  if (int8) {
    TORCH_CHECK(scales.defined() && scales.is_contiguous() && scales.scalar_type() == at::kFloat && scales.numel() == n,
                "cam moe: int8 rows need ", n, " float32 scales");
  }
  if (weights.defined()) {
    TORCH_CHECK(weights.is_contiguous() && weights.scalar_type() == at::kFloat && weights.sizes() == index.sizes(),
                "cam moe: weights must be float32 of the plan's shape");
  }
  const auto add_dtype = add.defined() ? add.scalar_type() : out_dtype;
  if (add.defined()) {
    TORCH_CHECK(add.is_contiguous() && add.sizes() == out.sizes() && kernels::moe_row_dtype_supported(add_dtype),
                "cam moe: the added rows must be float of the output's shape");
  }
  const int64_t* idx = index.data_ptr<int64_t>();
  for (int64_t i = 0; i < T * P; ++i) {
    TORCH_CHECK(idx[i] >= -1 && idx[i] < n, "cam moe: plan entry ", i, " names row ", idx[i], " of ", n);
  }
  const char* base = static_cast<const char*>(rows.data_ptr());
  const int64_t row_bytes = H * int64_t(rows.element_size());
  const float* sc = int8 ? scales.data_ptr<float>() : nullptr;
  const float* w = weights.defined() ? weights.data_ptr<float>() : nullptr;
  RowTerms terms;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t s = 0; s < P; ++s) {
      const int64_t r = idx[t * P + s];
      if (r >= 0) terms.add(base + r * row_bytes, dtype, w ? w[t * P + s] : 1.f, sc ? sc[r] : 1.f);
    }
    terms.end_token();
  }
  sum_row_terms(terms, add, add_first, out);
}

void sum_row_terms(const RowTerms& terms, const at::Tensor& add, bool add_first, at::Tensor& out) {
  need_rows(out, "the output");
  const int64_t T = out.size(0), H = out.size(1);
  const auto out_dtype = out.scalar_type(), add_dtype = add.defined() ? add.scalar_type() : out_dtype;
  TORCH_CHECK(terms.tokens() == T && terms.first.back() == int64_t(terms.rows.size()), "cam moe: ", T,
              " output rows for the terms of ", terms.tokens(), " tokens");
  TORCH_CHECK(!add.defined() || (add.is_contiguous() && add.sizes() == out.sizes()),
              "cam moe: the added rows must have the output's shape");
  const char* a = add.defined() ? static_cast<const char*>(add.data_ptr()) : nullptr;
  const int64_t add_row = H * int64_t(c10::elementSize(add_dtype));
  const int64_t out_row = H * int64_t(c10::elementSize(out_dtype));
  char* o = static_cast<char*>(out.data_ptr());
  for (int64_t t = 0; t < T; ++t) {
    const size_t f = size_t(terms.first[size_t(t)]);
    const kernels::WeightedRows src{terms.rows.data() + f, terms.dtypes.data() + f, terms.weights.data() + f,
                                    terms.scales.data() + f, int(terms.first[size_t(t) + 1] - terms.first[size_t(t)])};
    kernels::weighted_sum_row(src, add_dtype, a ? a + t * add_row : nullptr, add_first, out_dtype, o + t * out_row, H);
  }
}

}  // namespace cam::moe
