// TensorArena: allocator of heap-resident tensors in this rank's window (torch_cam.empty).
//
// Peers map the whole window, arena included, so a collective on a tensor that lives here can
// let peers read it in place instead of staging it. The arena is sparse: allocate() reserves
// pages (posix_fallocate, so a full /dev/shm is an error at allocation, never a SIGBUS later)
// and freeing a tensor returns its pages (hole punch). Blocks are page aligned; first fit.
// The arena owns the window's mapping and descriptor, so tensors stay valid after their group
// is destroyed. Its pages are shared with the peers, and with a child forked from the owner:
// only the owning process allocates or frees (a forked child's frees are ignored and its
// allocations refused), so a DataLoader worker can never hand out or zero the parent's blocks.
#pragma once

#include <ATen/ATen.h>

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

namespace cam {

class TensorArena : public std::enable_shared_from_this<TensorArena> {
 public:
  TensorArena(std::shared_ptr<void> mapping, char* base, int64_t bytes, int fd, off_t fd_offset,
              int rank);
  ~TensorArena();
  TensorArena(const TensorArena&) = delete;
  TensorArena& operator=(const TensorArena&) = delete;

  // A contiguous CPU tensor whose storage lives in the arena.
  at::Tensor empty(at::IntArrayRef sizes, at::ScalarType dtype);
  // Offset of [p, p + n) in the arena, or -1 when that range is not inside it.
  int64_t offset_of(const void* p, int64_t n) const;
  int64_t capacity() const { return bytes_; }
  // Raw blocks for the owner's own staging (MoE stages): offset of n reserved bytes, and
  // their release. A block that peers may still read must simply not be released: its pages
  // go with the arena's mapping, and survive in the peers' mappings until they unmap.
  int64_t reserve_block(int64_t n) { return allocate(n); }
  void release_block(int64_t off) { release(off); }
  char* block(int64_t off) const { return base_ + off; }
  int64_t bytes_in_use() const;

 private:
  int64_t allocate(int64_t n);
  void release(int64_t off);

  std::shared_ptr<void> mapping_;
  char* base_;
  int64_t bytes_;
  int fd_;
  off_t fd_offset_;
  int rank_;
  pid_t owner_;
  mutable std::mutex mu_;
  std::map<int64_t, int64_t> free_;  // offset -> length, coalesced
  std::map<int64_t, int64_t> used_;  // offset -> length
};

}  // namespace cam
