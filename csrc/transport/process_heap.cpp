#include "process_heap.hpp"

#include "../core/errors.hpp"

#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

namespace cam {
namespace {

constexpr int64_t kHeaderBytes = 4096;

struct Header {
  uint64_t magic;
  int64_t pid;
};

int64_t reservation_bytes() {
  if (const char* v = std::getenv("TORCH_CAM_PROCESS_HEAP_BYTES"); v != nullptr && *v != '\0') {
    char* end = nullptr;
    const long long n = std::strtoll(v, &end, 10);
    TORCH_CHECK(end != v && *end == '\0' && n > 0, "TORCH_CAM_PROCESS_HEAP_BYTES: expected a positive ",
                "byte count, got '", v, "'");
    return (n + kHeaderBytes - 1) / kHeaderBytes * kHeaderBytes;
  }
  const int64_t ram = int64_t(sysconf(_SC_PHYS_PAGES)) * int64_t(sysconf(_SC_PAGESIZE));
  return std::min<int64_t>(ram > 0 ? ram : (int64_t(1) << 34), int64_t(256) << 30);
}

}  // namespace

std::shared_ptr<ProcessHeap> ProcessHeap::own(std::string* why) {
  static std::mutex mu;
  // Never destroyed: tensors born in the heap may outlive static destruction at exit.
  static auto* heap = new std::shared_ptr<ProcessHeap>();
  static std::string failure;
  static pid_t owner = 0;
  std::lock_guard<std::mutex> lk(mu);
  if (*heap && getpid() != owner) {
    // A forked child inherited the parent's heap: its blocks are the parent's to hand out.
    if (why) *why = str("this process was forked from the heap's owner (pid ", owner, ")");
    return nullptr;
  }
  if (*heap || !failure.empty()) {
    if (why) *why = failure;
    return *heap;
  }
  const int64_t arena_bytes = reservation_bytes();
  const int64_t bytes = kHeaderBytes + arena_bytes;
  const int fd = memfd_create("torch_cam_process_heap", MFD_CLOEXEC);
  void* p = MAP_FAILED;
  if (fd < 0) {
    failure = str("memfd_create failed: ", std::strerror(errno));
  } else if (ftruncate(fd, off_t(bytes)) != 0) {
    failure = str("cannot size a ", bytes, "-byte memfd: ", std::strerror(errno));
  } else if (const int rc = posix_fallocate(fd, 0, kHeaderBytes); rc != 0) {
    failure = str("cannot reserve the heap's header page: ", std::strerror(rc));  // rc, not errno
  } else {
    p = mmap(nullptr, size_t(bytes), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, 0);
    if (p == MAP_FAILED) failure = str("cannot map ", bytes, " bytes of address space: ", std::strerror(errno));
  }
  if (!failure.empty()) {
    if (fd >= 0) ::close(fd);
    if (why) *why = failure;
    return nullptr;
  }
  auto* h = static_cast<Header*>(p);
  h->pid = getpid();
  h->magic = kProcessHeapMagic;
  auto mapping = std::shared_ptr<void>(p, [bytes](void* q) { munmap(q, size_t(bytes)); });
  std::shared_ptr<ProcessHeap> made(new ProcessHeap());
  made->fd_ = fd;
  made->bytes_ = bytes;
  // The arena owns the descriptor (it closes it) and the mapping.
  made->arena_ = std::make_shared<TensorArena>(std::move(mapping), static_cast<char*>(p) + kHeaderBytes,
                                               arena_bytes, fd, off_t(kHeaderBytes), -1);
  *heap = made;
  owner = getpid();
  // A forked child (a DataLoader worker) would otherwise share the heap's pages with its parent,
  // not copy them as it does ordinary memory: remap its view privately, copy-on-write.
  static void* view = p;
  static int64_t view_bytes = bytes;
  static int view_fd = fd;
  pthread_atfork(nullptr, nullptr, [] {
    mmap(view, size_t(view_bytes), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED | MAP_NORESERVE, view_fd, 0);
  });
  return made;
}

ProcessHeap::~ProcessHeap() = default;

std::shared_ptr<const MappedProcessHeap> map_process_heap(int64_t pid, uint64_t start_time, int fd,
                                                          int64_t mapped_bytes, std::string* why) {
  static std::mutex mu;
  static auto* cache = new std::map<std::pair<int64_t, uint64_t>, std::weak_ptr<const MappedProcessHeap>>();
  std::lock_guard<std::mutex> lk(mu);
  const auto key = std::make_pair(pid, start_time);
  if (auto it = cache->find(key); it != cache->end()) {
    if (auto m = it->second.lock()) return m;
  }
  if (fd < 0 || mapped_bytes <= kHeaderBytes) {
    *why = "it has no process heap";
    return nullptr;
  }
  const std::string path = str("/proc/", pid, "/fd/", fd);
  const int local = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (local < 0) {
    *why = str("cannot open ", path, ": ", std::strerror(errno));
    return nullptr;
  }
  void* p = mmap(nullptr, size_t(mapped_bytes), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, local, 0);
  const int err = errno;
  ::close(local);
  if (p == MAP_FAILED) {
    *why = str("cannot map its ", mapped_bytes, " bytes: ", std::strerror(err));
    return nullptr;
  }
  const auto* h = static_cast<const Header*>(p);
  if (h->magic != kProcessHeapMagic || h->pid != pid) {
    munmap(p, size_t(mapped_bytes));
    *why = str(path, " is not that process's heap");
    return nullptr;
  }
  auto m = std::make_shared<MappedProcessHeap>();
  m->mapping = std::shared_ptr<void>(p, [mapped_bytes](void* q) { munmap(q, size_t(mapped_bytes)); });
  m->arena_base = static_cast<const char*>(p) + kHeaderBytes;
  m->arena_bytes = mapped_bytes - kHeaderBytes;
  (*cache)[key] = m;
  return m;
}

}  // namespace cam
