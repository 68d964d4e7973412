#include "heap_allocator.hpp"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <unistd.h>

#include <atomic>
#include <mutex>

#include "process_heap.hpp"

namespace cam {
namespace {

constexpr int64_t kPage = 4096;
constexpr int64_t kCacheBytes = int64_t(1) << 30;
// A cached block serves a request up to 1/8 smaller: varied sizes share blocks instead of each
// keeping its own, at most 12.5% of a block unused.
constexpr int64_t kCacheSlackDiv = 8;
// Above torch's default CPU allocator (0) and below nothing we know of; installing checks it took.
constexpr uint8_t kPriority = 1;

class HeapAllocator final : public c10::Allocator {
 public:
  static HeapAllocator& instance() {
    static auto* a = new HeapAllocator();  // never destroyed: its tensors may outlive exit
    return *a;
  }

  void set(int64_t min_bytes) {
    std::lock_guard<std::mutex> lk(mu_);
    explicit_ = true;  // the caller decided: groups formed later leave the mode as it is
    if (min_bytes <= 0) {
      uninstall_locked();
      return;
    }
    install_locked(min_bytes);
    auto_ = false;
  }

  void group_ready() noexcept {
    std::lock_guard<std::mutex> lk(mu_);
    if (explicit_ || installed_ || auto_declined_) return;
    try {
      install_locked(kAutoHeapAllocatorMinBytes);
      auto_ = true;
    } catch (...) {
      auto_declined_ = true;  // no process heap, or a higher-priority allocator: stay ordinary
    }
  }

  std::map<std::string, int64_t> stats() {
    std::lock_guard<std::mutex> lk(mu_);
    return {{"installed", installed_ ? 1 : 0}, {"auto", installed_ && auto_ ? 1 : 0},
            {"min_bytes", installed_ ? min_bytes_.load() : 0}, {"heap_tensors", live_},
            {"heap_bytes", live_bytes_}, {"cached_bytes", cached_bytes_}, {"fallbacks", fallbacks_}};
  }

  // The small path (almost every allocation) is two plain loads: no lock, no syscall. The
  // acquire pairs with set(): a threshold below INT64_MAX is stored after heap_ is.
  c10::DataPtr allocate(size_t n) override {
    if (int64_t(n) >= min_bytes_.load(std::memory_order_acquire) && getpid() == owner_) {
      int64_t len = (int64_t(n) + kPage - 1) / kPage * kPage;
      int64_t off = -1;
      {
        std::lock_guard<std::mutex> lk(mu_);
        if (auto it = cached_.lower_bound(len); it != cached_.end() && it->first - len <= len / kCacheSlackDiv) {
          len = it->first;
          off = it->second;
          cached_.erase(it);
          cached_bytes_ -= len;
        }
      }
      if (off < 0) {
        try {
          off = heap_->arena().reserve_block(len);  // reserves (zeroes) pages: outside the lock
        } catch (const c10::Error&) {
          std::lock_guard<std::mutex> lk(mu_);
          ++fallbacks_;  // the heap is full: the tensor is ordinary, its ops are staged
        }
      }
      if (off >= 0) {
        std::lock_guard<std::mutex> lk(mu_);
        ++live_;
        live_bytes_ += len;
        return {heap_->arena().block(off), new Block{off, len}, &HeapAllocator::free_block,
                c10::Device(c10::DeviceType::CPU)};
      }
    }
    return fallback_.load(std::memory_order_relaxed)->allocate(n);
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

 private:
  void install_locked(int64_t min_bytes) {
    if (!heap_) {
      std::string why;
      heap_ = ProcessHeap::own(&why);
      TORCH_CHECK(heap_, "torch_cam.use_heap_allocator: this process has no process heap: ", why);
    }
    if (installed_) {
      min_bytes_ = min_bytes;
      return;
    }
    // Allocations may reach this allocator the moment it is set: its fallback must be ready.
    owner_ = getpid();
    fallback_ = c10::GetCPUAllocator();
    c10::SetCPUAllocator(this, kPriority);
    TORCH_CHECK(c10::GetCPUAllocator() == this, "torch_cam.use_heap_allocator: another CPU allocator was ",
                "installed with a higher priority; cam cannot replace it");
    min_bytes_ = min_bytes;
    installed_ = true;
  }

  void uninstall_locked() {
    if (!installed_) return;
    min_bytes_ = INT64_MAX;  // a storage that kept this allocator falls back from now on
    c10::SetCPUAllocator(fallback_, kPriority);
    installed_ = false;
    auto_ = false;
    drop_cache_locked();
  }

  struct Block {
    int64_t off, len;
  };

  static void free_block(void* ctx) {
    auto* b = static_cast<Block*>(ctx);
    instance().release(*b);
    delete b;
  }

  void release(const Block& b) {
    std::lock_guard<std::mutex> lk(mu_);
    --live_;
    live_bytes_ -= b.len;
    if (getpid() != owner_) return;  // a forked child's copy of a parent's tensor
    if (installed_ && b.len <= kCacheBytes) {
      while (cached_bytes_ + b.len > kCacheBytes) {
        // Evict the largest: the fewest evictions make room.
        auto big = std::prev(cached_.end());
        heap_->arena().release_block(big->second);
        cached_bytes_ -= big->first;
        cached_.erase(big);
      }
      cached_.emplace(b.len, b.off);
      cached_bytes_ += b.len;
      return;
    }
    heap_->arena().release_block(b.off);
  }

  void drop_cache_locked() {
    for (const auto& [len, off] : cached_) heap_->arena().release_block(off);
    cached_.clear();
    cached_bytes_ = 0;
  }

  std::mutex mu_;
  bool installed_ = false;
  bool explicit_ = false;       // set() was called: the auto mode stays out of the way
  bool auto_ = false;           // installed by group_ready()
  bool auto_declined_ = false;  // group_ready() could not install; it does not retry
  std::atomic<int64_t> min_bytes_{INT64_MAX};
  std::atomic<pid_t> owner_{0};
  std::atomic<c10::Allocator*> fallback_{nullptr};
  std::shared_ptr<ProcessHeap> heap_;
  std::multimap<int64_t, int64_t> cached_;  // page-rounded length -> block offset, pages kept
  int64_t cached_bytes_ = 0;
  int64_t live_ = 0, live_bytes_ = 0, fallbacks_ = 0;
};

}  // namespace

void set_heap_allocator(int64_t min_bytes) { HeapAllocator::instance().set(min_bytes); }

void heap_allocator_group_ready() noexcept { HeapAllocator::instance().group_ready(); }

std::map<std::string, int64_t> heap_allocator_stats() { return HeapAllocator::instance().stats(); }

}  // namespace cam
