// One ISA's build of the reduction kernels. CMake compiles this file once per ISA with
// CAM_ISA set (and the matching -m flags and CPU_CAPABILITY_* macro), so at::vec picks
// that ISA's intrinsics; reduce.cpp chooses among the builds at run time.
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/complex.h>

#include "reduce.hpp"

#ifndef CAM_ISA
#error "CAM_ISA must name the ISA this file is compiled for"
#endif

namespace cam::kernels::CAM_ISA {

using at::vec::Vectorized;

namespace {

// Full vectors take the plain unaligned load; only the tail pays for the partial one.
template <typename V, typename T>
inline V load(const T* p, int64_t count) {
  return count == V::size() ? V::loadu(p) : V::loadu(p, count);
}

template <typename V>
inline V combine(RedOp op, const V& a, const V& b) {
  switch (op) {
    case RedOp::kSum:
    case RedOp::kAvg: return a + b;
    case RedOp::kProduct: return a * b;
    case RedOp::kMin: return at::vec::minimum(a, b);
    case RedOp::kMax: return at::vec::maximum(a, b);
    default: return a;  // bitwise ops are handled by combine_bits
  }
}

template <typename V>
inline V combine_bits(RedOp op, const V& a, const V& b) {
  switch (op) {
    case RedOp::kBand: return a & b;
    case RedOp::kBor: return a | b;
    case RedOp::kBxor: return a ^ b;
    default: return combine(op, a, b);
  }
}

// Types whose arithmetic happens in their own width: fp32, fp64, integers.
template <typename T>
void reduce_native(RedOp op, T* dst, const T* const* srcs, int nsrc, int64_t n, int64_t divisor) {
  using V = Vectorized<T>;
  constexpr int64_t W = V::size();
  auto one = [&](int64_t i, int64_t count) {
    V acc = load<V>(srcs[0] + i, count);
    for (int r = 1; r < nsrc; ++r) {
      V x = load<V>(srcs[r] + i, count);
      if constexpr (std::is_integral_v<T>) acc = combine_bits(op, acc, x);
      else acc = combine(op, acc, x);
    }
    if constexpr (std::is_floating_point_v<T>) {
      if (op == RedOp::kAvg) acc = acc / V(T(divisor));
    }
    acc.store(dst + i, count);
  };
  int64_t i = 0;
  for (; i + W <= n; i += W) one(i, W);
  if (i < n) one(i, n - i);
}

// bf16 / fp16: widen to fp32, accumulate, round once.
template <typename T>
void reduce_widened(RedOp op, T* dst, const T* const* srcs, int nsrc, int64_t n, int64_t divisor) {
  using V = Vectorized<T>;
  using F = Vectorized<float>;
  constexpr int64_t W = V::size();
  auto one = [&](int64_t i, int64_t count) {
    auto [lo, hi] = at::vec::convert_to_float<T>(load<V>(srcs[0] + i, count));
    for (int r = 1; r < nsrc; ++r) {
      auto [xlo, xhi] = at::vec::convert_to_float<T>(load<V>(srcs[r] + i, count));
      lo = combine(op, lo, xlo);
      hi = combine(op, hi, xhi);
    }
    if (op == RedOp::kAvg) {
      lo = lo / F(float(divisor));
      hi = hi / F(float(divisor));
    }
    at::vec::convert_from_float<T>(lo, hi).store(dst + i, count);
  };
  int64_t i = 0;
  for (; i + W <= n; i += W) one(i, W);
  if (i < n) one(i, n - i);
}

// bool: 0/1 bytes, so SUM and MAX are OR, PRODUCT and MIN are AND (as torch's own reductions
// of bool tensors).
void reduce_bool(RedOp op, uint8_t* dst, const uint8_t* const* srcs, int nsrc, int64_t n) {
  RedOp bit = op;
  if (op == RedOp::kSum || op == RedOp::kMax) bit = RedOp::kBor;
  if (op == RedOp::kProduct || op == RedOp::kMin) bit = RedOp::kBand;
  reduce_native<uint8_t>(bit, dst, srcs, nsrc, n, 1);
}

// Complex: SUM, AVG and PRODUCT only; rare enough that scalar code serves.
template <typename T>
void reduce_complex(RedOp op, T* dst, const T* const* srcs, int nsrc, int64_t n, int64_t divisor) {
  for (int64_t i = 0; i < n; ++i) {
    T acc = srcs[0][i];
    for (int r = 1; r < nsrc; ++r) acc = op == RedOp::kProduct ? acc * srcs[r][i] : acc + srcs[r][i];
    if (op == RedOp::kAvg) acc /= typename T::value_type(divisor);
    dst[i] = acc;
  }
}

template <typename T>
const T* const* typed(const void* const* srcs) {
  return reinterpret_cast<const T* const*>(srcs);
}

}  // namespace

void reduce(c10::ScalarType dtype, RedOp op, void* dst, const void* const* srcs, int nsrc,
            int64_t n, int64_t divisor) {
  switch (dtype) {
#define CAM_NATIVE(T, NAME)                                                        \
  case c10::ScalarType::NAME:                                                     \
    return reduce_native<T>(op, static_cast<T*>(dst), typed<T>(srcs), nsrc, n, divisor);
    CAM_NATIVE(float, Float)
    CAM_NATIVE(double, Double)
    CAM_NATIVE(int8_t, Char)
    CAM_NATIVE(uint8_t, Byte)
    CAM_NATIVE(int16_t, Short)
    CAM_NATIVE(int32_t, Int)
    CAM_NATIVE(int64_t, Long)
#undef CAM_NATIVE
    case c10::ScalarType::BFloat16:
      return reduce_widened<c10::BFloat16>(op, static_cast<c10::BFloat16*>(dst),
                                           typed<c10::BFloat16>(srcs), nsrc, n, divisor);
    case c10::ScalarType::Half:
      return reduce_widened<c10::Half>(op, static_cast<c10::Half*>(dst), typed<c10::Half>(srcs),
                                       nsrc, n, divisor);
    case c10::ScalarType::Bool:
      return reduce_bool(op, static_cast<uint8_t*>(dst), typed<uint8_t>(srcs), nsrc, n);
    case c10::ScalarType::ComplexFloat:
      return reduce_complex(op, static_cast<c10::complex<float>*>(dst),
                            typed<c10::complex<float>>(srcs), nsrc, n, divisor);
    case c10::ScalarType::ComplexDouble:
      return reduce_complex(op, static_cast<c10::complex<double>*>(dst),
                            typed<c10::complex<double>>(srcs), nsrc, n, divisor);
    default:
      TORCH_INTERNAL_ASSERT(false, "cam reduce kernel: unsupported dtype ", dtype);
  }
}

}  // namespace cam::kernels::CAM_ISA
