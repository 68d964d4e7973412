// SymmetricHeap: the one interface algorithms see of the transport. Every rank of the group
// owns one window of identical layout; base(r) is where rank r's window is mapped in this
// process. Whether that came from POSIX shm, CUDA IPC or a remote engine is not visible here.
#pragma once

#include <string>

#include "window_layout.hpp"

namespace cam {

class SymmetricHeap {
 public:
  virtual ~SymmetricHeap() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual const WindowLayout& layout() const = 0;
  virtual char* base(int rank) const = 0;
  // Empty when the peer is alive; otherwise a sentence saying why it is considered dead.
  virtual std::string peer_failure(int rank) const = 0;
  virtual int64_t peer_pid(int rank) const = 0;
};

}  // namespace cam
