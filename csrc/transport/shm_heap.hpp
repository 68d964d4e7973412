// ShmHeap: the symmetric heap over POSIX shared memory, for ranks of one host.
//
// Lifecycle: each rank creates its own window (so its pages are first touched on its own NUMA
// node), reserves every page up front with posix_fallocate (a full /dev/shm fails here, not
// with SIGBUS later), publishes {name, pid, host identity} through the group's store, maps all
// peers' windows, and once every rank reports "mapped" unlinks its name. From then on nothing
// of the group is visible in /dev/shm: even SIGKILL leaks nothing. A rank killed during the
// short rendezvous leaves a name behind; the next ShmHeap on the host removes names whose owner
// process is gone, and surviving ranks remove a dead peer's name when rendezvous fails.
//
// Init failures are shared: a rank that cannot create its window publishes why under its
// window key, and one that fails later (a peer's window cannot be opened or mapped) under its
// "mapped" key, so every peer raises at once with that reason instead of at the timeout.
// Records carry the restart attempt (TORCHELASTIC_RESTART_COUNT): torchrun may hand a
// restarted job the same store, and a record of an earlier attempt, or of a process that is
// gone, is waited past until the current one arrives.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "heap.hpp"
#include "process_heap.hpp"
#include "tensor_arena.hpp"

namespace cam {

// A host is "same kernel and same /dev/shm" (boot id + device and inode of /dev/shm): ranks
// with equal keys can map each other's windows. TORCH_CAM_HOST_ID, when set, is the key instead
// (as NCCL_HOSTID is NCCL's), for machines whose ranks share memory some other way or to split
// one machine into simulated hosts. The hostname only names a host in messages.
std::string host_key();
std::string host_name();

struct PeerInfo {
  std::string segment;
  int64_t pid = 0;
  uint64_t start_time = 0;  // /proc/<pid>/stat field 22, guards against pid reuse
  std::string host;         // host_key()
  std::string shm_dev;      // device and inode of /dev/shm
  uint64_t window_addr = 0; // where the owner mapped its window (target of the probe)
  int process_heap_fd = -1; // the owner's process heap: descriptor and size (-1: none)
  int64_t process_heap_bytes = 0;
  std::string attempt;      // restart attempt of the owner's job
  std::string failure;      // non-empty: the owner could not set up its window, and why
};

class ShmHeap final : public SymmetricHeap {
 public:
  // `group` names the group in messages (its name and global ranks).
  ShmHeap(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world_size,
          WindowLayout layout, std::chrono::milliseconds timeout, std::string group);
  ~ShmHeap() override;

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  const WindowLayout& layout() const override { return layout_; }
  char* base(int r) const override { return bases_[r]; }
  std::string peer_failure(int r) const override;
  std::string reported_failure(int r) const override;
  void report_failure(const std::string& why) override;
  int64_t peer_pid(int r) const override { return peers_[r].pid; }
  void park(int64_t timeout_us, const std::function<Idleness()>& still_idle) override;
  void ring_parked_peers() override;
  bool direct_read_available() const override { return direct_read_; }
  // Cross-memory attach (process_vm_readv): one kernel copy, no staging through the window.
  void read_peer(int rank, void* local, uint64_t remote_addr, size_t n) const override;

  TensorArena* arena() const override { return arena_.get(); }
  int64_t heap_offset(const void* p, int64_t n) const override;
  char* peer_heap(int r, int64_t off) const override;
  std::string process_heap_problem() const override { return process_heaps_mapped_ ? "" : process_heap_note_; }

  // Removes /dev/shm names left by cam processes of this user that no longer exist.
  static int sweep_stale_segments();

 private:
  void create_own_window();
  void rendezvous(const c10::intrusive_ptr<c10d::Store>& store, std::chrono::milliseconds timeout);
  // Rank r's "mapped" record: why it could not map the heap ("" when it did), and whether it
  // mapped every peer's process heap.
  struct Mapped {
    std::string failure;
    bool process_heaps = false;
  };
  Mapped mapped_record_of(const c10::intrusive_ptr<c10d::Store>& store, int r,
                          std::chrono::steady_clock::time_point deadline);
  // Maps every peer's process heap; "" when all are, else why not.
  std::string map_process_heaps();
  // The value under `key` written by this attempt's owner of rank r: waits for the key, and
  // past records of an earlier attempt or a dead process, until the deadline.
  std::string current_record(const c10::intrusive_ptr<c10d::Store>& store, const std::string& key, int r,
                             std::chrono::steady_clock::time_point deadline, const char* what,
                             const std::function<std::string(const std::string&)>& stale);
  bool probe_direct_read() const;
  void unmap_all();
  int rank_, world_;
  std::string where_;  // "cam init of group '1' (global ranks [0, 1]) on rank 0"
  WindowLayout layout_;
  std::vector<char*> bases_;
  std::vector<PeerInfo> peers_;
  std::string own_name_;
  bool own_unlinked_ = false;
  bool direct_read_ = false;
  std::shared_ptr<TensorArena> arena_;
  std::shared_ptr<ProcessHeap> own_process_heap_;
  std::vector<std::shared_ptr<const MappedProcessHeap>> process_heaps_;  // by rank, own included
  bool process_heaps_mapped_ = false;
  std::string process_heap_note_;
};

}  // namespace cam
