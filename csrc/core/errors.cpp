#include "errors.hpp"

#include <c10/core/ScalarType.h>

namespace cam {

std::string dtype_name(int dtype) {
  return c10::toString(static_cast<c10::ScalarType>(dtype));
}

std::string describe_bytes(int64_t nbytes, int dtype) {
  return str(nbytes, " bytes of ", dtype_name(dtype));
}

}  // namespace cam
