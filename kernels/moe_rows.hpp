// Row kernels of MoE dispatch and combine: the only arithmetic those ops do.
//   quantize_row_int8   dynamic per-row int8 (optionally after a smooth-scale multiply),
//                       fused into the copy of a row to its destination
//   load_row / accumulate_row(_int8) / store_row
//                       the fp32 weighted sum of combine: acc = init; acc += w * row; out = acc
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
// acc = float(src)
void load_row(c10::ScalarType dtype, float* acc, const void* src, int64_t n);
// acc += w * float(src)
void accumulate_row(c10::ScalarType dtype, float* acc, const void* src, float w, int64_t n);
// acc += w * (float(q) * scale)
void accumulate_row_int8(float* acc, const int8_t* q, float scale, float w, int64_t n);
// dst = acc rounded to dtype
void store_row(c10::ScalarType dtype, void* dst, const float* acc, int64_t n);

}  // namespace cam::kernels
