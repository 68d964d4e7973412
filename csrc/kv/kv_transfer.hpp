// KV-cache transfer between ranks of a cam group (docs/kv.md): each rank registers its paged
// pools (in its host's tensor heap); push writes this rank's share of a request into a peer's
// pools, pull reads a peer's share into this rank's; after the last byte a notification goes
// into the peer's ring (kv_control.hpp). One-sided: the peer takes no part. How a peer's memory
// is reached (mapped on this host, UCX to another) is its KVPeer's business (kv_peer.hpp).
//
// A transfer is checked and planned on the caller's thread (bad input raises there, and the
// peer still hears that the request failed), then runs either right there (synchronous) or as
// an op on the group's engine (asynchronous: the progress thread, or whoever waits, copies one
// layer per step, so per-layer progress is visible and other ops interleave).
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "../runtime/engine.hpp"
#include "kv_control.hpp"
#include "kv_copy_plan.hpp"
#include "kv_peer.hpp"

namespace cam::kv {

// No notification in time (Python: a TimeoutError).
class KVTimeout : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct KVNotification {
  int peer;
  std::string request_id;
  int64_t kind;
  int64_t status;
  int64_t nbytes;
  std::string message;
};

// One request in flight. Read from any thread; advanced by one thread at a time.
class KVTransferJob {
 public:
  enum class State { kCopying, kNotifying, kDone };
  KVTransferJob(std::string what, int64_t kind, int peer, std::string request_id, uint64_t version,
                KVCopyPlan plan, std::vector<char*> local_pools, std::vector<int64_t> peer_pools,
                Clock::time_point deadline);

  const std::string& what() const { return what_; }
  int peer() const { return peer_; }
  bool done() const { return state_.load(std::memory_order_acquire) == State::kDone; }
  bool layer_done(int64_t layer) const;
  int64_t nbytes() const { return nbytes_.load(std::memory_order_relaxed); }
  // Empty on success (valid once done()); "timeout" or "error" plus the message otherwise.
  const std::string& error() const { return error_; }
  bool timed_out() const { return timed_out_; }
  // Destination blocks not known to be written: none after success, all of the request's
  // otherwise (failed, in flight, or stopped by the group's failure).
  std::vector<int64_t> failed_blocks() const;

 private:
  friend class KVTransfer;
  std::string what_;
  int64_t kind_;
  int peer_;
  std::string request_id_;
  uint64_t version_;
  KVCopyPlan plan_;
  std::vector<char*> local_pools_;     // per entry of plan_.layers(): this rank's pool
  std::vector<int64_t> peer_pools_;    // and the peer's, as an offset in its tensor arena
  std::shared_ptr<const std::vector<at::Tensor>> own_pools_;  // kept alive while in flight
  Clock::time_point deadline_;
  std::atomic<State> state_{State::kCopying};
  std::atomic<int64_t> layers_copied_{0};
  std::atomic<int64_t> nbytes_{0};
  int64_t status_ = kOk;
  std::string error_;
  bool timed_out_ = false;
};

class KVTransfer : public std::enable_shared_from_this<KVTransfer> {
 public:
  // rank, world: in the transfer's group (a group across hosts keeps its control block and
  // pools in its host's heap, whose engine this is); -1: the engine's own.
  KVTransfer(std::shared_ptr<Engine> engine, std::chrono::milliseconds timeout, int rank = -1, int world = -1);
  int rank() const { return rank_; }
  int world() const { return world_; }
  // The arena offset of this rank's control block, and every rank's (from the rendezvous):
  // make(r, offset) builds how rank r is reached.
  int64_t control_offset() const;
  using PeerMaker = std::function<std::unique_ptr<KVPeer>(int rank, int64_t control_offset)>;
  void connect(const std::vector<int64_t>& offsets, const PeerMaker& make);
  // A group on one host: every peer through the engine's heap.
  void connect(const std::vector<int64_t>& offsets);

  // Publishes this rank's pools (one heap tensor per layer). Returns the new version.
  uint64_t register_pools(const std::vector<at::Tensor>& pools, const KVLayoutDesc& layout);
  // The peer's current registration (version 0: none), read under its seqlock.
  std::pair<uint64_t, KVLayoutDesc> peer_registration(int peer);
  // Arena offsets of the peer's layer pools (for views of them).
  std::vector<int64_t> peer_offsets(int peer);

  // Checks and plans a transfer; on bad input notifies the peer (FAILED) and throws.
  std::shared_ptr<KVTransferJob> prepare(int64_t kind, int peer, BlockIds src_ids, BlockIds dst_ids,
                                         int64_t num_tokens, std::vector<int64_t> layers, bool all_layers,
                                         const std::string& request_id, int64_t expect_version);
  // A transfer refused before prepare could read its arguments (block ids that are not ints):
  // tells the peer that request_id failed, when the peer and the id are valid (it may be
  // waiting for it). Returns the message, noting a peer that could not be told.
  std::string refuse(int64_t kind, int peer, const std::string& request_id, const std::string& reason);
  // Runs the job on this thread until done (waits back off; deadline from prepare).
  void run(KVTransferJob& job);
  // Hands the job to the group's engine; the Work completes (or fails) with it.
  c10::intrusive_ptr<c10d::Work> submit(std::shared_ptr<KVTransferJob> job);
  // One non-blocking attempt to move the job forward (one layer, or the notification).
  bool advance(KVTransferJob& job);

  // Notifications posted to this rank, oldest first per peer.
  std::vector<KVNotification> poll();
  // The first notification for request_id (from peer, if >= 0); others stay queued for poll().
  KVNotification wait_notification(const std::string& request_id, int peer, std::chrono::milliseconds timeout);

 private:
  struct PeerRegistration {
    uint64_t version = 0;
    KVLayoutDesc layout;
    std::vector<int64_t> offsets;
  };
  PeerRegistration read_registration(int peer);
  KVPeer& peer(int r) const { return *peers_[size_t(r)]; }
  bool advance_once(KVTransferJob& job);
  bool try_notify(int peer, int64_t kind, int64_t status, int64_t nbytes, const std::string& request_id,
                  const std::string& message);
  // Blocks (backing off) until posted; throws on the peer's death or at the deadline.
  void notify(int peer, int64_t kind, int64_t status, int64_t nbytes, const std::string& request_id,
              const std::string& message, Clock::time_point deadline, const std::string& what);
  void drain();
  // Why the peer is dead ("" while alive), checked at most once per liveness interval.
  std::string peer_dead(int peer);
  void finish(KVTransferJob& job, std::string error, bool timed_out);

  std::shared_ptr<Engine> engine_;
  std::chrono::milliseconds timeout_;
  int rank_, world_;
  KVControlLayout layout_;
  char* control_;  // this rank's control block, in its tensor arena
  int64_t control_offset_;
  std::vector<std::unique_ptr<KVPeer>> peers_;  // every rank's, this one's included (mapped)

  std::mutex register_mu_;
  std::shared_ptr<const std::vector<at::Tensor>> pools_;  // this rank's registered pools
  KVLayoutDesc layout_desc_;
  uint64_t version_ = 0;

  std::mutex peers_mu_;
  std::vector<PeerRegistration> peer_cache_;

  std::unique_ptr<std::mutex[]> ring_mu_;  // per peer: one notifier at a time
  std::vector<uint64_t> sent_;             // per peer, under ring_mu_[peer]

  struct PeerLiveness {
    std::mutex mu;
    Clock::time_point next_check{};
    std::string dead;
  };
  std::unique_ptr<PeerLiveness[]> liveness_;

  std::mutex queue_mu_;
  std::vector<KVNotification> queue_;
};

// Throws msg with the type of e (IndexError / ValueError / RuntimeError in Python).
[[noreturn]] void throw_like(const c10::Error& e, const std::string& msg);

}  // namespace cam::kv
