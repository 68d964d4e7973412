#include "tensor_arena.hpp"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cstring>

namespace cam {
namespace {
constexpr int64_t kPage = 4096;
}

TensorArena::TensorArena(std::shared_ptr<void> mapping, char* base, int64_t bytes, int fd,
                         off_t fd_offset, int rank)
    : mapping_(std::move(mapping)), base_(base), bytes_(bytes), fd_(fd), fd_offset_(fd_offset),
      rank_(rank), owner_(getpid()) {
  if (bytes_ > 0) free_[0] = bytes_;
}

TensorArena::~TensorArena() {
  if (fd_ >= 0) ::close(fd_);
}

int64_t TensorArena::bytes_in_use() const {
  std::lock_guard<std::mutex> lk(mu_);
  int64_t n = 0;
  for (const auto& [off, len] : used_) n += len;
  return n;
}

int64_t TensorArena::offset_of(const void* p, int64_t n) const {
  const char* c = static_cast<const char*>(p);
  if (c < base_ || c + n > base_ + bytes_) return -1;
  return c - base_;
}

int64_t TensorArena::allocate(int64_t n) {
  const int64_t len = std::max<int64_t>(kPage, (n + kPage - 1) / kPage * kPage);
  TORCH_CHECK(getpid() == owner_, "torch_cam.empty: this process was forked from the one that owns ",
              "the tensor heap (pid ", owner_, "); a forked child cannot allocate in it");
  std::lock_guard<std::mutex> lk(mu_);
  auto it = free_.begin();
  while (it != free_.end() && it->second < len) ++it;
  TORCH_CHECK(it != free_.end(), "torch_cam.empty on rank ", rank_, ": the tensor heap has no free ",
              "block of ", len, " bytes (capacity ", bytes_, " bytes, ", bytes_ - [&] {
                int64_t f = 0;
                for (const auto& [o, l] : free_) f += l;
                return f;
              }(), " in use); raise Options.tensor_heap_bytes / TORCH_CAM_TENSOR_HEAP_BYTES");
  const int64_t off = it->first;
  const int rc = posix_fallocate(fd_, fd_offset_ + off, len);
  if (rc != 0) {
    struct statvfs vfs {};
    const double avail = statvfs("/dev/shm", &vfs) == 0 ? double(vfs.f_bavail) * vfs.f_frsize : -1;
    TORCH_CHECK(false, "torch_cam.empty on rank ", rank_, ": cannot reserve ", len,
                " bytes of shared memory for a heap tensor: ", std::strerror(rc), " (/dev/shm has ",
                int64_t(avail), " bytes free)");
  }
  const int64_t rest = it->second - len;
  free_.erase(it);
  if (rest > 0) free_[off + len] = rest;
  used_[off] = len;
  return off;
}

void TensorArena::release(int64_t off) {
  if (getpid() != owner_) return;  // a forked child's copy: the pages are the owner's
  std::lock_guard<std::mutex> lk(mu_);
  auto u = used_.find(off);
  if (u == used_.end()) return;
  int64_t len = u->second;
  used_.erase(u);
  // Give the pages back to the system; the range reads as zeros until reserved again.
  fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, fd_offset_ + off, len);
  int64_t start = off;
  auto next = free_.lower_bound(off);
  if (next != free_.end() && next->first == off + len) {
    len += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == start) {
      start = prev->first;
      len += prev->second;
      free_.erase(prev);
    }
  }
  free_[start] = len;
}

at::Tensor TensorArena::empty(at::IntArrayRef sizes, at::ScalarType dtype) {
  int64_t numel = 1;
  for (int64_t s : sizes) {
    TORCH_CHECK(s >= 0, "torch_cam.empty on rank ", rank_, ": negative dimension ", s);
    numel *= s;
  }
  const int64_t nbytes = numel * int64_t(c10::elementSize(dtype));
  const int64_t off = allocate(nbytes);
  auto self = shared_from_this();
  return at::from_blob(
      base_ + off, sizes, [self, off](void*) { self->release(off); },
      at::TensorOptions().dtype(dtype).device(at::kCPU));
}

}  // namespace cam
