#include "heap_allocator.hpp"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <unistd.h>

#include <atomic>
#include <mutex>
#include <unordered_map>

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
        blocks_[off] = len;
        void* p = heap_->arena().block(off);
        return {p, p, &HeapAllocator::free_ptr, c10::Device(c10::DeviceType::CPU)};
      }
    }
    c10::Allocator* fallback = fallback_.load(std::memory_order_relaxed);
    c10::DataPtr d = fallback->allocate(n);
    // Rewrapped with this allocator's deleter, so that every allocation has the one deleter
    // raw_deleter() promises; free_ptr hands it back to the fallback's.
    if (d.get() == d.get_context() && d.get_deleter() == fallback_raw_ && fallback_raw_) {
      void* p = d.release_context();
      return {p, p, &HeapAllocator::free_ptr, d.device()};
    }
    return d;
  }

  // ATen's scratch buffers go through raw_allocate/raw_deallocate, which need every allocation
  // to carry one deleter whose context is its data pointer: heap blocks are found by address.
  // Null (raw allocation refused, as torch does) only under a fallback without a raw deleter.
  c10::DeleterFnPtr raw_deleter() const override {
    c10::Allocator* fallback = fallback_.load(std::memory_order_relaxed);
    return fallback_raw_ && fallback->raw_deleter() == fallback_raw_ ? &HeapAllocator::free_ptr : nullptr;
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
    arena_ = &heap_->arena();
    fallback_ = c10::GetCPUAllocator();
    // The first fallback's raw deleter frees what it allocated for this allocator, forever.
    if (!fallback_raw_) fallback_raw_ = fallback_.load()->raw_deleter();
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

  static void free_ptr(void* p) {
    HeapAllocator& a = instance();
    TensorArena* arena = a.arena_.load(std::memory_order_acquire);
    const int64_t off = arena && p ? arena->offset_of(p, 1) : -1;
    if (off >= 0) {
      a.release(off);
    } else {
      a.fallback_raw_(p);
    }
  }

  void release(int64_t off) {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = blocks_.find(off);
    TORCH_INTERNAL_ASSERT(it != blocks_.end(), "torch_cam heap allocator: freeing an unknown block at ", off);
    const Block b{off, it->second};
    blocks_.erase(it);
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
  struct Block {
    int64_t off, len;
  };

  std::atomic<c10::Allocator*> fallback_{nullptr};
  c10::DeleterFnPtr fallback_raw_ = nullptr;  // set once, before this allocator is first installed
  std::shared_ptr<ProcessHeap> heap_;
  std::atomic<TensorArena*> arena_{nullptr};  // heap_'s arena, for free_ptr without the lock
  std::unordered_map<int64_t, int64_t> blocks_;  // live block offset -> page-rounded length
  std::multimap<int64_t, int64_t> cached_;  // page-rounded length -> block offset, pages kept
  int64_t cached_bytes_ = 0;
  int64_t live_ = 0, live_bytes_ = 0, fallbacks_ = 0;
};

}  // namespace

void set_heap_allocator(int64_t min_bytes) { HeapAllocator::instance().set(min_bytes); }

void heap_allocator_group_ready() noexcept { HeapAllocator::instance().group_ready(); }

std::map<std::string, int64_t> heap_allocator_stats() { return HeapAllocator::instance().stats(); }

}  // namespace cam
