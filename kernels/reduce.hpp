// Reduction kernels: dst[i] = src[0][i] op src[1][i] op ... op src[n-1][i], always in source
// order 0..n-1, so every rank that reduces the same sources gets bit-identical results.
// bf16 and fp16 are widened to fp32, accumulated there and rounded once at the end. Each
// pass loads all sources of one vector and stores once: one pass over memory whatever n is,
// where a chain of ATen adds would make n-1.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>

namespace cam::kernels {

enum class RedOp : int32_t { kSum = 0, kAvg, kProduct, kMin, kMax, kBand, kBor, kBxor };
const char* red_op_name(RedOp op);

// Empty when (dtype, op) is supported; otherwise why not (for the caller's error message).
const char* reduce_unsupported(c10::ScalarType dtype, RedOp op);

// AVG divides the sum by `divisor` (the group size). dst may alias any source element-wise.
void reduce(c10::ScalarType dtype, RedOp op, void* dst, const void* const* srcs, int nsrc,
            int64_t numel, int64_t divisor);

// The ISA the dispatcher picked at load time ("avx512", "avx2" or "default").
const char* reduce_isa();

}  // namespace cam::kernels
