// ProcessHeap: one shared-memory arena per process for ordinary CPU tensors (the heap allocator
// mode, heap_allocator.hpp), and the process-wide cache of the peers' arenas mapped here.
//
// The arena is a memfd: nothing is named in /dev/shm, so no crash can leak it. It is reserved
// sparse at its full size (TORCH_CAM_PROCESS_HEAP_BYTES, default the machine's memory capped at
// 256 GiB: address space only) and TensorArena reserves pages per block. Its first page holds a
// magic and the owner's pid, so a peer can tell it mapped the right file. Peers map it through
// /proc/<pid>/fd/<fd>, once per process however many groups they share, so a tensor born here
// is read in place by every cam group of the host, as a torch_cam.empty tensor is by its group.
// A forked child remaps its view of the heap privately (copy-on-write, as ordinary memory is
// across fork), and never allocates from it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "tensor_arena.hpp"

namespace cam {

constexpr uint64_t kProcessHeapMagic = 0x43414d5048454150ull;  // "CAMPHEAP"

class ProcessHeap {
 public:
  // This process's heap, created on the first call; nullptr when it cannot be (no memfd), and
  // then `why` says why.
  static std::shared_ptr<ProcessHeap> own(std::string* why = nullptr);
  ~ProcessHeap();

  TensorArena& arena() { return *arena_; }
  int fd() const { return fd_; }
  // Bytes peers map: the header page and the arena behind it.
  int64_t mapped_bytes() const { return bytes_; }

 private:
  ProcessHeap() = default;
  int fd_ = -1;
  int64_t bytes_ = 0;
  std::shared_ptr<TensorArena> arena_;
};

// A peer process's heap mapped in this process: [base, base + arena_bytes) is its arena.
struct MappedProcessHeap {
  std::shared_ptr<void> mapping;
  const char* arena_base = nullptr;
  int64_t arena_bytes = 0;
};

// Maps the heap of process `pid` (descriptor `fd` in its table, `mapped_bytes` long), or
// returns the mapping another group of this process already made. nullptr when it cannot
// (the peer is gone, /proc is not readable across these processes): `why` says why.
std::shared_ptr<const MappedProcessHeap> map_process_heap(int64_t pid, uint64_t start_time, int fd,
                                                          int64_t mapped_bytes, std::string* why);

}  // namespace cam
