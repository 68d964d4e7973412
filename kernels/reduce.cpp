#include "reduce.hpp"

#include <c10/util/Exception.h>

#include "isa.hpp"

namespace cam::kernels {

// The per-ISA builds of reduce_kernel.cpp (see CMakeLists.txt).
#if defined(__x86_64__)
namespace avx512 { void reduce(c10::ScalarType, RedOp, void*, const void* const*, int, int64_t, int64_t); }
namespace avx2 { void reduce(c10::ScalarType, RedOp, void*, const void* const*, int, int64_t, int64_t); }
#endif
namespace generic { void reduce(c10::ScalarType, RedOp, void*, const void* const*, int, int64_t, int64_t); }

namespace {
using ReduceFn = void (*)(c10::ScalarType, RedOp, void*, const void* const*, int, int64_t, int64_t);
ReduceFn pick() {
  switch (isa()) {
#if defined(__x86_64__)
    case Isa::kAvx512: return &avx512::reduce;
    case Isa::kAvx2: return &avx2::reduce;
#endif
    default: return &generic::reduce;
  }
}
}  // namespace

const char* red_op_name(RedOp op) {
  switch (op) {
    case RedOp::kSum: return "SUM";
    case RedOp::kAvg: return "AVG";
    case RedOp::kProduct: return "PRODUCT";
    case RedOp::kMin: return "MIN";
    case RedOp::kMax: return "MAX";
    case RedOp::kBand: return "BAND";
    case RedOp::kBor: return "BOR";
    case RedOp::kBxor: return "BXOR";
  }
  return "unknown";
}

const char* reduce_unsupported(c10::ScalarType t, RedOp op) {
  using c10::ScalarType;
  const bool bitwise = op == RedOp::kBand || op == RedOp::kBor || op == RedOp::kBxor;
  switch (t) {
    case ScalarType::Float:
    case ScalarType::Double:
    case ScalarType::BFloat16:
    case ScalarType::Half:
      return bitwise ? "bitwise reductions are defined for integer and bool tensors only" : "";
    case ScalarType::Char:
    case ScalarType::Byte:
    case ScalarType::Short:
    case ScalarType::Int:
    case ScalarType::Long:
      return op == RedOp::kAvg ? "AVG is defined for floating-point and complex tensors only" : "";
    case ScalarType::Bool:
      return op == RedOp::kAvg ? "AVG is not defined for bool tensors" : "";
    case ScalarType::ComplexFloat:
    case ScalarType::ComplexDouble:
      return op == RedOp::kSum || op == RedOp::kAvg || op == RedOp::kProduct
                 ? ""
                 : "complex tensors support SUM, AVG and PRODUCT only";
    default:
      return "cam reduces float32, float64, bfloat16, float16, complex, int8..int64, uint8 and "
             "bool tensors";
  }
}

void reduce(c10::ScalarType dtype, RedOp op, void* dst, const void* const* srcs, int nsrc,
            int64_t numel, int64_t divisor) {
  static const ReduceFn fn = pick();
  if (numel > 0) fn(dtype, op, dst, srcs, nsrc, numel, divisor);
}

const char* reduce_isa() { return isa_name(isa()); }

}  // namespace cam::kernels
