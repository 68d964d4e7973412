// Error types and the one message format of cam:
//   "cam <op> (seq <n>) on rank <r>: <what>"  (peer and expected-vs-received inside <what>)
#pragma once

#include <c10/util/Exception.h>

#include <exception>
#include <sstream>
#include <stdexcept>
#include <string>

namespace cam {

// An op was refused before any byte moved, on every rank alike (mismatched sizes, dtypes,
// splits, op order): the op fails but the group stays usable.
class ValidationError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A bad argument found by a rank's own checks while it builds an op, before anything is issued.
// Its text is the reason alone; the backend prefixes the op and turns it into a refusal that
// every rank of the op sees (RefusedOp), so the rank still takes part and the group stays usable.
class ArgumentError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Anything else (timeout, dead peer, peer failure) leaves the group unusable.
class FatalError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

template <typename... Args>
std::string str(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

// Throws ArgumentError(str(args...)) unless cond holds; the message is built only on failure.
#define CAM_CHECK_ARG(cond, ...)                                 \
  do {                                                           \
    if (!(cond)) throw ::cam::ArgumentError(::cam::str(__VA_ARGS__)); \
  } while (0)

// The message of an exception, without c10's backtrace ("unknown error" for a non-exception).
std::string error_text(const std::exception_ptr& e);

std::string describe_bytes(int64_t nbytes, int dtype);  // "4096 bytes of float32"
std::string dtype_name(int dtype);

}  // namespace cam
