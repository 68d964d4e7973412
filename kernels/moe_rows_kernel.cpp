// One ISA's build of the MoE row kernels (see moe_rows.hpp). CMake compiles this file once
// per ISA with CAM_ISA set and -ffp-contract=off: a fused multiply-add would round
// differently from the reference's separate multiply and add.
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>
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
void accumulate_row_t(float* acc, const T* src, float w, int64_t n) {
  const F wv(w);
  if constexpr (std::is_same_v<T, float>) {
    for_each_float(src, n, [&](int64_t i, int64_t c, const F& v, const F&) {
      (load<F>(acc + i, c) + wv * v).store(acc + i, c);
    });
  } else {
    for_each_float(src, n, [&](int64_t i, int64_t c, const F& lo, const F& hi) {
      const int64_t c0 = std::min<int64_t>(c, F::size());
      (load<F>(acc + i, c0) + wv * lo).store(acc + i, c0);
      if (c > F::size()) {
        const int64_t c1 = c - F::size();
        (load<F>(acc + i + F::size(), c1) + wv * hi).store(acc + i + F::size(), c1);
      }
    });
  }
}

template <typename T>
void store_row_t(T* dst, const float* acc, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, acc, size_t(n) * sizeof(float));
  } else {
    using V = Vectorized<T>;
    constexpr int64_t W = V::size();
    for (int64_t i = 0; i < n; i += W) {
      const int64_t c = std::min<int64_t>(W, n - i);
      const int64_t c0 = std::min<int64_t>(c, F::size());
      F lo = load<F>(acc + i, c0);
      F hi = c > F::size() ? load<F>(acc + i + F::size(), c - F::size()) : F(0.f);
      at::vec::convert_from_float<T>(lo, hi).store(dst + i, c);
    }
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
  // Pass 2: q = round_half_even(xf * (127 / m)). Vectorized::round rounds half to even.
  const F inv(127.0f / m);
  const F lo(-127.f), hi(127.f);
  for (int64_t i = 0; i < n; i += W) {
    const int64_t c = std::min<int64_t>(W, n - i);
    F r = at::vec::clamp((load<F>(x + i, c) * inv).round(), lo, hi);
    r.store(lanes, c);
    for (int64_t l = 0; l < c; ++l) q[i + l] = int8_t(lanes[l]);
  }
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
template <typename T>
void load_dispatch(float* acc, const void* src, int64_t n) {
  load_row_t(acc, static_cast<const T*>(src), n);
}
template <typename T>
void accumulate_dispatch(float* acc, const void* src, float w, int64_t n) {
  accumulate_row_t(acc, static_cast<const T*>(src), w, n);
}
template <typename T>
void store_dispatch(void* dst, const float* acc, int64_t n) {
  store_row_t(static_cast<T*>(dst), acc, n);
}
}  // namespace

void quantize_row_int8(c10::ScalarType dtype, const void* src, const float* smooth, int64_t n,
                       int8_t* q, float* scale) {
  CAM_ROW_DTYPES(quantize_dispatch, src, smooth, n, q, scale)
}
void load_row(c10::ScalarType dtype, float* acc, const void* src, int64_t n) {
  CAM_ROW_DTYPES(load_dispatch, acc, src, n)
}
void accumulate_row(c10::ScalarType dtype, float* acc, const void* src, float w, int64_t n) {
  CAM_ROW_DTYPES(accumulate_dispatch, acc, src, w, n)
}
void store_row(c10::ScalarType dtype, void* dst, const float* acc, int64_t n) {
  CAM_ROW_DTYPES(store_dispatch, dst, acc, n)
}
#undef CAM_ROW_DTYPES

void accumulate_row_int8(float* acc, const int8_t* q, float scale, float w, int64_t n) {
  // w * (float(q) * scale), rounded as the reference's dequantize-then-weight.
  const F wv(w), sv(scale);
  constexpr int64_t W = F::size();
  float lanes[W];
  for (int64_t i = 0; i < n; i += W) {
    const int64_t c = std::min<int64_t>(W, n - i);
    for (int64_t l = 0; l < c; ++l) lanes[l] = float(q[i + l]);
    F deq = load<F>(lanes, c) * sv;
    (load<F>(acc + i, c) + wv * deq).store(acc + i, c);
  }
}

}  // namespace cam::kernels::CAM_ISA
