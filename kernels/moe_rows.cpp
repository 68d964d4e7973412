#include "moe_rows.hpp"

#include "isa.hpp"

namespace cam::kernels {

// The per-ISA builds of moe_rows_kernel.cpp (see CMakeLists.txt).
#define CAM_MOE_ROWS_DECLARE(ns)                                                          \
  namespace ns {                                                                          \
  void quantize_row_int8(c10::ScalarType, const void*, const float*, int64_t, int8_t*,    \
                         float*);                                                         \
  void weighted_sum_row(const WeightedRows&, c10::ScalarType, const void*, bool,          \
                        c10::ScalarType, void*, int64_t);                                 \
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
void weighted_sum_row(const WeightedRows& src, c10::ScalarType add_dtype, const void* add,
                      bool add_first, c10::ScalarType out_dtype, void* out, int64_t n) {
  CAM_MOE_ROWS_CALL(weighted_sum_row, src, add_dtype, add, add_first, out_dtype, out, n)
}
#undef CAM_MOE_ROWS_CALL

}  // namespace cam::kernels
