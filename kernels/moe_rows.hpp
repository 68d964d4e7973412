// Row kernels of MoE dispatch and combine: the only arithmetic those ops do.
//   quantize_row_int8   dynamic per-row int8 (optionally after a smooth-scale multiply),
//                       fused into the copy of a row to its destination
//   weighted_sum_row    the fp32 weighted sum of combine, all of a token's rows in one pass
// Rows are float32, bfloat16 or float16. Every step rounds exactly as the pure-PyTorch
// reference does (float32 multiply, then add; no fused multiply-add), so results match it bit
// for bit. Built once per ISA like the reduction kernels, chosen at load time.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>

namespace cam::kernels {

// Whether moe row kernels handle this dtype.
bool moe_row_dtype_supported(c10::ScalarType dtype);

// xf = float(src) (* smooth when given); m = max|xf|; q = round_half_even(xf * (127 / m)),
// *scale = m / 127; an all-zero row gives q = 0 and scale 0.
void quantize_row_int8(c10::ScalarType dtype, const void* src, const float* smooth, int64_t n,
                       int8_t* q, float* scale);
// One token of combine in one pass over memory: out = round(acc) with
//   acc = (add_first ? float(add) : 0) + w[0] * row[0] + ... + w[k-1] * row[k-1] (+ float(add))
// summed left to right exactly as the row-at-a-time kernels above would (same bits), but each
// element of acc stays in a register instead of making k round trips through memory.
// Source s is float32/bf16/fp16 (dtypes[s]) or int8 (kChar) dequantized as q * scales[s].
struct WeightedRows {
  const void* const* rows;
  const c10::ScalarType* dtypes;
  const float* weights;
  const float* scales;  // per source, int8 sources only
  int count;
};
void weighted_sum_row(const WeightedRows& src, c10::ScalarType add_dtype, const void* add,
                      bool add_first, c10::ScalarType out_dtype, void* out, int64_t n);

}  // namespace cam::kernels
