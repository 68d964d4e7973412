#include "moe_rows.hpp"

#include "isa.hpp"

namespace cam::kernels {

// The per-ISA builds of moe_rows_kernel.cpp (see CMakeLists.txt).
#define CAM_MOE_ROWS_DECLARE(ns)                                                          \
  namespace ns {                                                                          \
  void quantize_row_int8(c10::ScalarType, const void*, const float*, int64_t, int8_t*,    \
                         float*);                                                         \
  void load_row(c10::ScalarType, float*, const void*, int64_t);                           \
  void accumulate_row(c10::ScalarType, float*, const void*, float, int64_t);              \
  void accumulate_row_int8(float*, const int8_t*, float, float, int64_t);                 \
  void store_row(c10::ScalarType, void*, const float*, int64_t);                          \
  }
#if defined(__x86_64__)
CAM_MOE_ROWS_DECLARE(avx512)
CAM_MOE_ROWS_DECLARE(avx2)
#endif
CAM_MOE_ROWS_DECLARE(generic)
#undef CAM_MOE_ROWS_DECLARE

#if defined(__x86_64__)
#define CAM_MOE_ROWS_CALL(fn, ...)                             \
  switch (isa()) {                                             \
    case Isa::kAvx512: return avx512::fn(__VA_ARGS__);         \
    case Isa::kAvx2: return avx2::fn(__VA_ARGS__);             \
    default: return generic::fn(__VA_ARGS__);                  \
  }
#else
#define CAM_MOE_ROWS_CALL(fn, ...) return generic::fn(__VA_ARGS__);
#endif

bool moe_row_dtype_supported(c10::ScalarType t) {
  return t == c10::ScalarType::Float || t == c10::ScalarType::BFloat16 || t == c10::ScalarType::Half;
}

void quantize_row_int8(c10::ScalarType dtype, const void* src, const float* smooth, int64_t n,
                       int8_t* q, float* scale) {
  CAM_MOE_ROWS_CALL(quantize_row_int8, dtype, src, smooth, n, q, scale)
}
void load_row(c10::ScalarType dtype, float* acc, const void* src, int64_t n) {
  CAM_MOE_ROWS_CALL(load_row, dtype, acc, src, n)
}
void accumulate_row(c10::ScalarType dtype, float* acc, const void* src, float w, int64_t n) {
  CAM_MOE_ROWS_CALL(accumulate_row, dtype, acc, src, w, n)
}
void accumulate_row_int8(float* acc, const int8_t* q, float scale, float w, int64_t n) {
  CAM_MOE_ROWS_CALL(accumulate_row_int8, acc, q, scale, w, n)
}
void store_row(c10::ScalarType dtype, void* dst, const float* acc, int64_t n) {
  CAM_MOE_ROWS_CALL(store_row, dtype, dst, acc, n)
}
#undef CAM_MOE_ROWS_CALL

}  // namespace cam::kernels
