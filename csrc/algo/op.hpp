// Op: one communication operation as a non-blocking state machine. The engine calls step()
// until the op reports done; step() never blocks, so one thread can progress many ops (a ring
// of isends, a collective while p2p traffic is pending) and nothing deadlocks at issue time.
#pragma once

#include <ATen/core/ivalue.h>
#include <ATen/core/ivalue_inl.h>
#include <ATen/ATen.h>
#include <c10/util/SmallVector.h>

#include <atomic>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <exception>
#include <string>
#include <vector>

#include "../core/config.hpp"
#include "../core/errors.hpp"
#include "../transport/heap.hpp"
#include "../transport/tensor_arena.hpp"
#include "collective_window.hpp"
#include "p2p_window.hpp"

namespace cam {

// Bytes moved per path, for stats() and for tests that check which path an op took.
struct Stats {
  std::atomic<uint64_t> staged_bytes{0};       // copied into this rank's window for peers
  std::atomic<uint64_t> direct_read_bytes{0};  // read straight from peers' memory (syscall)
  std::atomic<uint64_t> heap_read_bytes{0};    // read in place from peers' heap tensors
  void add(std::atomic<uint64_t>& counter, int64_t n) { counter.fetch_add(uint64_t(n), std::memory_order_relaxed); }
};

// The op families' parts of every window. Built by reserve() on a fresh layout, which the
// caller then seals and hands to bind().
struct OpWindows {
  CollectiveWindow coll;
  P2PWindow p2p;
  static OpWindows reserve(WindowLayout& layout, const CamConfig& cfg) {
    const int n = layout.world_size();
    return {CollectiveWindow(layout, cfg.coll_region_bytes(n), cfg.eager_max_bytes),
            P2PWindow(layout, cfg.p2p_ring_bytes(n))};
  }
  void bind(const WindowLayout& layout) {
    coll.bind(layout);
    p2p.bind(layout);
  }
};

// What algorithms see of the world: the heap (windows of every rank), where their structures
// lie in each window, and the configuration.
struct Context {
  SymmetricHeap& heap;
  const CamConfig& cfg;
  const CollectiveWindow& coll;
  const P2PWindow& p2p;
  int rank;
  int world;
  char* me;  // own window
  Stats& stats;
  char* peer(int r) const { return heap.base(r); }
  // Heap offset of [p, p + n) when peers can read it in place (a heap-resident tensor), or -1.
  int64_t heap_offset(const void* p, int64_t n) const { return n <= 0 ? -1 : heap.heap_offset(p, n); }
  // Where rank r's heap offset `off` is mapped in this process.
  char* peer_heap(int r, int64_t off) const { return heap.peer_heap(r, off); }
};

using Clock = std::chrono::steady_clock;

class Op {
 public:
  Op(const char* name, uint64_t seq, Clock::time_point deadline)
      : name_(name), seq_(seq), deadline_(deadline),
        future_(c10::make_intrusive<c10::ivalue::Future>(tensor_list_type())) {}
  virtual ~Op() = default;
  // The type of every op's Future value, built once instead of on every op.
  static const c10::TypePtr& tensor_list_type() {
    static const c10::TypePtr type = c10::ListType::create(c10::TensorType::get());
    return type;
  }

  // Which part of the engine progresses the op: collectives one at a time in issue order,
  // sends and recvs by the p2p engine, the rest (one-sided transfers) side by side.
  enum class Family : uint8_t { kCollective, kSend, kRecv, kOneSided };
  virtual Family family() const { return Family::kOneSided; }
  bool is_collective() const { return family() == Family::kCollective; }
  // Makes all progress possible now without blocking; returns whether anything moved.
  // Throws ValidationError (op refused, group fine) or anything else (group broken).
  virtual bool step(Context& ctx) = 0;
  // Runs once on success, before the future completes (copy-back from temporaries).
  virtual void finalize() {}

  bool done() const { return done_; }
  std::exception_ptr error() const { return error_; }
  void fail(std::exception_ptr e) {
    error_ = std::move(e);
    done_ = true;
  }
  const char* name() const { return name_; }
  uint64_t seq() const { return seq_; }
  Clock::time_point deadline() const { return deadline_; }
  // The op's own timeout (its deadline was set at issue).
  int64_t timeout_ms() const {
    return std::llround(std::chrono::duration<double, std::milli>(deadline_ - issued_).count());
  }
  const c10::intrusive_ptr<c10::ivalue::Future>& future() const { return future_; }
  int source_rank() const { return source_rank_; }
  std::vector<at::Tensor>& outputs() { return outputs_; }

  // "cam broadcast (seq 4) on rank 1" — prefix of every message about this op.
  std::string where(int rank) const { return str("cam ", name_, " (seq ", seq_, ") on rank ", rank); }
  // The one peer the op involves (p2p, a rooted collective's root); -1: every rank.
  virtual int trace_peer() const { return -1; }
  // The op's flight-recorder entry (0: none) and how far the record has followed it (the
  // engine's, under its drive lock or once the op is done).
  uint64_t trace_id = 0;
  bool trace_started = false, trace_finished = false;

  // The peer whose signal stopped the op's latest pass (-1: unknown, or not a peer's signal):
  // a parked waiter asks to be rung by that peer only.
  int blocked_on() const { return blocked_on_; }
  void begin_pass() { blocked_on_ = -1; }

  // Why the op is not done yet, for timeout messages.
  virtual std::string waiting_for() const {
    return wait_peer_ < 0 ? std::string("its turn in the group's op queue")
                          : str(wait_what_, " from rank ", wait_peer_);
  }

 protected:
  void mark_done() { done_ = true; }
  void waiting(int peer, const char* what) {
    wait_peer_ = blocked_on_ = peer;
    wait_what_ = what;
  }
  void set_seq(uint64_t seq) { seq_ = seq; }
  std::vector<at::Tensor> outputs_;
  int source_rank_ = -1;

 private:
  const char* name_;
  uint64_t seq_;
  Clock::time_point deadline_;
  Clock::time_point issued_ = Clock::now();
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  bool done_ = false;
  std::exception_ptr error_;
  int wait_peer_ = -1, blocked_on_ = -1;
  const char* wait_what_ = "";
};

// The ops a progress pass finished, completed after the pass outside the engine's lock. A pass
// rarely finishes more than a few, so they stay inline (no allocation per op).
using FinishedOps = c10::SmallVector<std::shared_ptr<Op>, 4>;

}  // namespace cam
