#include "errors.hpp"

#include <c10/core/ScalarType.h>

namespace cam {

std::string dtype_name(int dtype) {
  return c10::toString(static_cast<c10::ScalarType>(dtype));
}

std::string error_text(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const c10::Error& err) {
    return err.what_without_backtrace();
  } catch (const std::exception& err) {
    return err.what();
  } catch (...) {
    return "unknown error";
  }
}

std::string describe_bytes(int64_t nbytes, int dtype) {
  return str(nbytes, " bytes of ", dtype_name(dtype));
}

}  // namespace cam
