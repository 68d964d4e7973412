// Row loops of MoE dispatch and combine on groups that span hosts (hosts_moe.hpp):
// there the rows arrive in one local buffer (an all_to_all of packed rows), and these loops do
// what the single-host ops do inside their pull, with the same kernels (kernels/moe_rows.hpp),
// so both paths give the same bits.
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace cam::moe {

// q[i] / scales[i] = dynamic int8 of rows[i] (H = rows.size(1)), after multiplying by
// smooth[smooth_index[i]] when smooth is defined.
// dst[pos[i]] = src[i] for the n rows of src (uint8 rows of dst's width, any row stride), one
// memcpy per row; positions are checked against dst's rows.
void place_rows(const at::Tensor& src, const at::Tensor& pos, at::Tensor& dst);

void quantize_rows(const at::Tensor& rows, const at::Tensor& smooth, const at::Tensor& smooth_index,
                   at::Tensor& q, at::Tensor& scales);

// out[t] = weighted sum over s of rows[index[t, s]] (index -1: none), in s order, with
// weights[t, s] (undefined: 1), int8 rows dequantized by scales; `add` (undefined: none) goes
// before the rows when add_first, else after them. Index bounds are checked here.
void weighted_sum_rows(const at::Tensor& rows, const at::Tensor& scales, const at::Tensor& index,
                       const at::Tensor& weights, const at::Tensor& add, bool add_first, at::Tensor& out);

// The rows each token's sum reads, in order, laid out as the row kernel takes them: where each
// lies, its dtype (kChar: int8, dequantized as q * scale), weight and scale. Token t's are
// [first[t], first[t + 1]).
struct RowTerms {
  std::vector<const void*> rows;
  std::vector<c10::ScalarType> dtypes;
  std::vector<float> weights, scales;
  std::vector<int64_t> first{0};

  void add(const void* row, c10::ScalarType dtype, float weight, float scale) {
    rows.push_back(row), dtypes.push_back(dtype), weights.push_back(weight), scales.push_back(scale);
  }
  void end_token() { first.push_back(int64_t(rows.size())); }
  int64_t tokens() const { return int64_t(first.size()) - 1; }
};
// out[t] = the sum of token t's terms in order, each weighted, with `add` as in
// weighted_sum_rows (H = out.size(1); every term's row holds H elements).
void sum_row_terms(const RowTerms& terms, const at::Tensor& add, bool add_first, at::Tensor& out);

}  // namespace cam::moe
