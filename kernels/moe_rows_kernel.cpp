// One ISA's build of the MoE row kernels (see moe_rows.hpp). CMake compiles this file once
// per ISA with CAM_ISA set and -ffp-contract=off: a fused multiply-add would round
// differently from the reference's separate multiply and add.
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include <tuple>
#include <type_traits>
#include <vector>

#include "moe_rows.hpp"

#ifndef CAM_ISA
#error "CAM_ISA must name the ISA this file is compiled for"
#endif

namespace cam::kernels::CAM_ISA {

using at::vec::Vectorized;
using F = Vectorized<float>;

namespace {

template <typename V, typename T>
inline V load(const T* p, int64_t count) {
  return count == V::size() ? V::loadu(p) : V::loadu(p, count);
}

// Calls fn(i, lo, hi) over the row as fp32 vector pairs (2 * F::size() elements at a time;
// count = how many are valid) for bf16/fp16, or fn(i, v, v) with one vector for fp32.
template <typename T, typename Fn>
inline void for_each_float(const T* src, int64_t n, Fn fn) {
  if constexpr (std::is_same_v<T, float>) {
    constexpr int64_t W = F::size();
    for (int64_t i = 0; i < n; i += W) {
      const int64_t c = std::min<int64_t>(W, n - i);
      F v = load<F>(src + i, c);
      fn(i, c, v, v);
    }
  } else {
    using V = Vectorized<T>;
    constexpr int64_t W = V::size();
    for (int64_t i = 0; i < n; i += W) {
      const int64_t c = std::min<int64_t>(W, n - i);
      auto [lo, hi] = at::vec::convert_to_float<T>(load<V>(src + i, c));
      fn(i, c, lo, hi);
    }
  }
}

template <typename T>
void load_row_t(float* acc, const T* src, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(acc, src, size_t(n) * sizeof(float));
  } else {
    for_each_float(src, n, [&](int64_t i, int64_t c, const F& lo, const F& hi) {
      lo.store(acc + i, std::min<int64_t>(c, F::size()));
      if (c > F::size()) hi.store(acc + i + F::size(), c - F::size());
    });
  }
}

template <typename T>
void quantize_row_t(const T* src, const float* smooth, int64_t n, int8_t* q, float* scale) {
  // Pass 1: xf (kept in a per-thread scratch row) and max|xf|.
  thread_local std::vector<float> xf;
  if (int64_t(xf.size()) < n) xf.resize(size_t(n));
  float* x = xf.data();
  load_row_t(x, src, n);
  constexpr int64_t W = F::size();
  F amax(0.f);
  for (int64_t i = 0; i < n; i += W) {
    const int64_t c = std::min<int64_t>(W, n - i);
    F v = load<F>(x + i, c);
    if (smooth != nullptr) {
      v = v * load<F>(smooth + i, c);
      v.store(x + i, c);
    }
    amax = at::vec::maximum(amax, v.abs());  // lanes past c load as 0
  }
  float m = 0.f;
  float lanes[W];
  amax.store(lanes);
  for (int64_t l = 0; l < W; ++l) m = std::max(m, lanes[l]);
  if (!(m > 0.f)) {
    std::memset(q, 0, size_t(n));
    *scale = 0.f;
    return;
  }
  // Pass 2: xf = round_half_even(xf * (127 / m)) in place (Vectorized::round rounds half to
  // even); pass 3 narrows the now-integral values, a plain loop the compiler vectorizes.
  const F inv(127.0f / m);
  const F lo(-127.f), hi(127.f);
  for (int64_t i = 0; i < n; i += W) {
    const int64_t c = std::min<int64_t>(W, n - i);
    at::vec::clamp((load<F>(x + i, c) * inv).round(), lo, hi).store(x + i, c);
  }
  for (int64_t i = 0; i < n; ++i) q[i] = static_cast<int8_t>(static_cast<int32_t>(x[i]));
  *scale = m / 127.0f;
}

}  // namespace

#define CAM_ROW_DTYPES(fn, ...)                                                             \
  switch (dtype) {                                                                          \
    case c10::ScalarType::Float: return fn<float>(__VA_ARGS__);                             \
    case c10::ScalarType::BFloat16: return fn<c10::BFloat16>(__VA_ARGS__);                  \
    case c10::ScalarType::Half: return fn<c10::Half>(__VA_ARGS__);                          \
    default: TORCH_INTERNAL_ASSERT(false, "cam moe row kernel: unsupported dtype ", dtype); \
  }

namespace {
template <typename T>
void quantize_dispatch(const void* src, const float* smooth, int64_t n, int8_t* q, float* scale) {
  quantize_row_t(static_cast<const T*>(src), smooth, n, q, scale);
}
}  // namespace

void quantize_row_int8(c10::ScalarType dtype, const void* src, const float* smooth, int64_t n,
                       int8_t* q, float* scale) {
  CAM_ROW_DTYPES(quantize_dispatch, src, smooth, n, q, scale)
}
#undef CAM_ROW_DTYPES

namespace {
// Elements [i, i + c) of a row as two fp32 vectors (c <= 2 * F::size(); lanes past c are 0).
inline void load_pair(c10::ScalarType dtype, const void* row, float scale, int64_t i, int64_t c,
                      F& lo, F& hi) {
  constexpr int64_t W = F::size();
  const int64_t c0 = std::min<int64_t>(c, W), c1 = c - c0;
  switch (dtype) {
    case c10::ScalarType::Float: {
      const float* p = static_cast<const float*>(row) + i;
      lo = load<F>(p, c0);
      hi = c1 > 0 ? load<F>(p + W, c1) : F(0.f);
      return;
    }
    case c10::ScalarType::BFloat16: {
      using V = Vectorized<c10::BFloat16>;
      static_assert(V::size() == 2 * W);
      std::tie(lo, hi) = at::vec::convert_to_float<c10::BFloat16>(
          load<V>(static_cast<const c10::BFloat16*>(row) + i, c));
      return;
    }
    case c10::ScalarType::Half: {
      using V = Vectorized<c10::Half>;
      static_assert(V::size() == 2 * W);
      std::tie(lo, hi) = at::vec::convert_to_float<c10::Half>(load<V>(static_cast<const c10::Half*>(row) + i, c));
      return;
    }
    case c10::ScalarType::Char: {
      const int8_t* q = static_cast<const int8_t*>(row) + i;
      float lanes[2 * W] = {};
      for (int64_t l = 0; l < c; ++l) lanes[l] = float(q[l]);
      const F sv(scale);
      lo = F::loadu(lanes) * sv;
      hi = F::loadu(lanes + W) * sv;
      return;
    }
    default: TORCH_INTERNAL_ASSERT(false, "cam moe weighted_sum_row: unsupported dtype ", dtype);
  }
}

inline void store_pair(c10::ScalarType dtype, void* out, int64_t i, int64_t c, const F& lo, const F& hi) {
  constexpr int64_t W = F::size();
  const int64_t c0 = std::min<int64_t>(c, W), c1 = c - c0;
  switch (dtype) {
    case c10::ScalarType::Float: {
      float* p = static_cast<float*>(out) + i;
      lo.store(p, c0);
      if (c1 > 0) hi.store(p + W, c1);
      return;
    }
    case c10::ScalarType::BFloat16:
      at::vec::convert_from_float<c10::BFloat16>(lo, hi).store(static_cast<c10::BFloat16*>(out) + i, c);
      return;
    case c10::ScalarType::Half:
      at::vec::convert_from_float<c10::Half>(lo, hi).store(static_cast<c10::Half*>(out) + i, c);
      return;
    default: TORCH_INTERNAL_ASSERT(false, "cam moe weighted_sum_row: unsupported output dtype ", dtype);
  }
}
}  // namespace

namespace {
// The same sum with every row of one float dtype T and the output of dtype O, loads and stores
// typed at compile time (no dispatch per vector: the common case, several times faster).
template <typename T>
inline void load_pair_typed(const T* row, int64_t i, int64_t c, F& lo, F& hi) {
  constexpr int64_t W = F::size();
  if constexpr (std::is_same_v<T, float>) {
    const int64_t c0 = std::min<int64_t>(c, W), c1 = c - c0;
    lo = load<F>(row + i, c0);
    hi = c1 > 0 ? load<F>(row + i + W, c1) : F(0.f);
  } else {
    std::tie(lo, hi) = at::vec::convert_to_float<T>(load<Vectorized<T>>(row + i, c));
  }
}

template <typename O>
inline void store_pair_typed(O* out, int64_t i, int64_t c, const F& lo, const F& hi) {
  constexpr int64_t W = F::size();
  if constexpr (std::is_same_v<O, float>) {
    const int64_t c0 = std::min<int64_t>(c, W), c1 = c - c0;
    lo.store(out + i, c0);
    if (c1 > 0) hi.store(out + i + W, c1);
  } else {
    at::vec::convert_from_float<O>(lo, hi).store(out + i, c);
  }
}

template <typename T, typename O>
void weighted_sum_typed(const WeightedRows& src, const T* add, bool add_first, O* out, int64_t n) {
  constexpr int64_t B = 2 * F::size();
  for (int64_t i = 0; i < n; i += B) {
    const int64_t c = std::min<int64_t>(B, n - i);
    F lo(0.f), hi(0.f), xlo, xhi;
    if (add != nullptr && add_first) load_pair_typed(add, i, c, lo, hi);
    for (int s = 0; s < src.count; ++s) {
      load_pair_typed(static_cast<const T*>(src.rows[s]), i, c, xlo, xhi);
      const F w(src.weights[s]);
      lo = lo + w * xlo;
      hi = hi + w * xhi;
    }
    if (add != nullptr && !add_first) {
      load_pair_typed(add, i, c, xlo, xhi);
      lo = lo + xlo;
      hi = hi + xhi;
    }
    store_pair_typed(out, i, c, lo, hi);
  }
}

template <typename T>
bool weighted_sum_typed_out(const WeightedRows& src, const void* add, bool add_first, c10::ScalarType out_dtype,
                            void* out, int64_t n) {
  const T* a = static_cast<const T*>(add);
  switch (out_dtype) {
    case c10::ScalarType::Float: weighted_sum_typed(src, a, add_first, static_cast<float*>(out), n); return true;
    case c10::ScalarType::BFloat16:
      weighted_sum_typed(src, a, add_first, static_cast<c10::BFloat16*>(out), n);
      return true;
    case c10::ScalarType::Half: weighted_sum_typed(src, a, add_first, static_cast<c10::Half*>(out), n); return true;
    default: return false;
  }
}

// Rows (and the addend) of one float dtype: the typed loop; false otherwise.
bool weighted_sum_uniform(const WeightedRows& src, c10::ScalarType add_dtype, const void* add, bool add_first,
                          c10::ScalarType out_dtype, void* out, int64_t n) {
  const c10::ScalarType d = src.count > 0 ? src.dtypes[0] : add_dtype;
  for (int s = 1; s < src.count; ++s) {
    if (src.dtypes[s] != d) return false;
  }
  if (add != nullptr && add_dtype != d) return false;
  switch (d) {
    case c10::ScalarType::Float: return weighted_sum_typed_out<float>(src, add, add_first, out_dtype, out, n);
    case c10::ScalarType::BFloat16:
      return weighted_sum_typed_out<c10::BFloat16>(src, add, add_first, out_dtype, out, n);
    case c10::ScalarType::Half: return weighted_sum_typed_out<c10::Half>(src, add, add_first, out_dtype, out, n);
    default: return false;
  }
}
}  // namespace

void weighted_sum_row(const WeightedRows& src, c10::ScalarType add_dtype, const void* add,
                      bool add_first, c10::ScalarType out_dtype, void* out, int64_t n) {
  if (weighted_sum_uniform(src, add_dtype, add, add_first, out_dtype, out, n)) return;
  constexpr int64_t B = 2 * F::size();
  for (int64_t i = 0; i < n; i += B) {
    const int64_t c = std::min<int64_t>(B, n - i);
    F lo(0.f), hi(0.f), xlo, xhi;
    if (add != nullptr && add_first) load_pair(add_dtype, add, 1.f, i, c, lo, hi);
    for (int s = 0; s < src.count; ++s) {
      load_pair(src.dtypes[s], src.rows[s], src.scales != nullptr ? src.scales[s] : 1.f, i, c, xlo, xhi);
      const F w(src.weights[s]);
      lo = lo + w * xlo;
      hi = hi + w * xhi;
    }
    if (add != nullptr && !add_first) {
      load_pair(add_dtype, add, 1.f, i, c, xlo, xhi);
      lo = lo + xlo;
      hi = hi + xhi;
    }
    store_pair(out_dtype, out, i, c, lo, hi);
  }
}

}  // namespace cam::kernels::CAM_ISA
