// UcxTransport: one-sided operations between the ranks of a group over UCX's UCP API (TCP
// everywhere, RDMA where the machine has it). The inter-host counterpart of ShmHeap: where a
// shm peer's memory is mapped and written with stores, a UCX peer's memory is registered and
// written with put / get / 64-bit atomic add, and waits read counters in this rank's own window.
//
// Contract:
//   - Each instance owns one UCP context and worker (used by one thread at a time), an endpoint
//     per peer in peer-error mode, and a registered control window:
//       posted[q]  counter peer q increments after putting a descriptor into slot[q]
//       done[q]    counter peer q increments when its puts into this rank's memory have landed
//       slot[q]    kSlotBytes that peer q writes with put (a descriptor: address, length and
//                  rkey, or a small message itself)
//     Worker addresses and the window's rkey are exchanged through the group's store at
//     construction; every endpoint is wired up (flushed) before the constructor returns.
//   - put / get / add are non-blocking; complete() waits for every one issued so far. fence()
//     orders the ones issued before it ahead of the ones issued after (a descriptor put, then the
//     counter add that announces it).
//   - Over TCP UCX emulates RMA and atomics with messages that the target handles in its own
//     progress: a rank whose memory is being written or read must be waiting in this transport
//     (every wait progresses the worker) until its peers signal done.
//   - Every wait has the group's deadline, raises FatalError naming the op, the rank and the peer
//     when a peer's endpoint fails (a dead or unreachable process is an endpoint error, never a
//     pid check), and calls the interrupt hook every liveness interval, which may throw (a failure
//     published elsewhere).
//   - Waiting spins on the worker for spin_us, then sleeps on the worker's event descriptor
//     (woken by arriving traffic, at most 1 ms so that an RDMA atomic, which raises no event, is
//     seen too): no core is burned while a peer on another host is slow.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "one_sided.hpp"

#include <chrono>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

// UCX's handles, declared so that users of this header need not include ucp.h.
typedef struct ucp_context* ucp_context_h;
typedef struct ucp_worker* ucp_worker_h;
typedef struct ucp_ep* ucp_ep_h;
typedef struct ucp_mem* ucp_mem_h;
typedef struct ucp_rkey* ucp_rkey_h;

namespace cam {

struct UcxOptions {
  int rank = 0;
  int size = 1;
  std::chrono::milliseconds timeout{300000};
  int64_t liveness_interval_ms = 50;
  int64_t spin_us = 5;
  std::string group_desc;           // for messages
  std::vector<std::string> names;   // peer -> where it runs (hostname), for messages
  // Whether any peer's lost endpoint fails every wait (collectives: the group is broken). When
  // false, only the operations addressed to that peer fail (KV transfers are per peer).
  bool lost_peer_fails_waits = true;
  bool tagged = false;  // also tagged messages (send_tagged / recv_tagged)
};

// A tagged send or receive: its UCX request (null: completed when issued) and what UCX's
// completion callback recorded (written under the transport's progress).
struct UcxTagged {
  struct Completion {
    bool done = false;
    int status = 0;     // a ucs_status_t
    size_t length = 0;  // a receive: the bytes that arrived
  };
  void* request = nullptr;
  std::shared_ptr<Completion> completion;
};

// Registered local memory: what a peer needs to read or write it (its packed rkey).
class UcxRegion : public MemoryRegion {
 public:
  UcxRegion(ucp_context_h ctx, void* base, size_t bytes);
  ~UcxRegion() override;
  UcxRegion(const UcxRegion&) = delete;
  UcxRegion& operator=(const UcxRegion&) = delete;
  uint64_t address() const { return uint64_t(base_); }
  const std::vector<uint8_t>& packed_key() const override { return rkey_; }

 private:
  ucp_context_h ctx_;
  void* base_;
  ucp_mem_h memh_ = nullptr;
  std::vector<uint8_t> rkey_;
};

// A peer's rkey, unpacked on the endpoint to that peer.
class UcxRemoteKey : public RemoteKey {
 public:
  UcxRemoteKey(ucp_ep_h ep, const void* packed);
  ~UcxRemoteKey() override;
  UcxRemoteKey(const UcxRemoteKey&) = delete;
  UcxRemoteKey& operator=(const UcxRemoteKey&) = delete;
  ucp_rkey_h get() const { return rkey_; }

 private:
  ucp_rkey_h rkey_ = nullptr;
};

class UcxTransport : public OneSidedTransport {
 public:
  UcxTransport(c10::intrusive_ptr<c10d::Store> store, UcxOptions opts);
  ~UcxTransport() override;
  UcxTransport(const UcxTransport&) = delete;
  UcxTransport& operator=(const UcxTransport&) = delete;

  std::string name() const override { return "ucx"; }
  int rank() const override { return opts_.rank; }
  int size() const override { return opts_.size; }
  const UcxOptions& options() const { return opts_; }

  std::unique_ptr<MemoryRegion> register_memory(void* base, size_t bytes) override;
  std::unique_ptr<RemoteKey> unpack_key(int peer, const void* packed) override;
  void put(int peer, const void* src, size_t bytes, uint64_t remote_addr, const RemoteKey& key) override;
  void post(int peer, std::vector<uint8_t> bytes) override;
  void signal_done(int peer) override;
  void complete(const std::string& what) override;
  uint64_t posted(int from) const override;
  uint64_t done(int from) const override;
  const uint8_t* slot(int from, uint64_t n) const override;
  [[noreturn]] void raise(const std::string& what, const std::string& why) const override;

  // UCX's own operations on a peer's registered memory, non-blocking (complete() waits).
  // post() is one eager active message, which the peer's progress copies into its slot before
  // counting it in posted.
  void put(int peer, const void* src, size_t bytes, uint64_t remote_addr, ucp_rkey_h rkey);
  void get(int peer, void* dst, size_t bytes, uint64_t remote_addr, ucp_rkey_h rkey);
  void add(int peer, uint64_t remote_addr, ucp_rkey_h rkey, uint64_t value);
  void fence();

  // Tagged messages (UcxOptions::tagged), matched by the receiver on (tag & mask), in order per
  // sender and tag; non-blocking. The buffer must stay valid until the request is done.
  UcxTagged send_tagged(int peer, const void* buf, size_t bytes, uint64_t tag);
  UcxTagged recv_tagged(void* buf, size_t bytes, uint64_t tag, uint64_t mask);
  // A message that arrived and that no receive has matched yet, the earliest with
  // (tag & mask) == (its tag & mask): null when there is none. `take` takes it out of UCX's
  // matching (then recv_taken must receive it); otherwise a later receive may still match it.
  // `*sender_tag`: the tag it was sent with; `*length`: its bytes.
  void* probe_tagged(uint64_t tag, uint64_t mask, bool take, uint64_t* sender_tag, size_t* length);
  // Receives a message that probe_tagged took (`length` bytes long): one already here in full
  // is copied now, without waiting for a progress of the worker.
  UcxTagged recv_taken(void* message, size_t length, void* buf, size_t bytes);
  // Whether it is done; then `error` says why it failed ("" on success) and, for a receive,
  // `received` how many bytes arrived.
  bool tagged_done(const UcxTagged& t, std::string* error, size_t* received);
  // Asks UCX to stop a request still in flight (a receive then completes as cancelled).
  void cancel(const UcxTagged& t);
  // Releases it (one still in flight completes in the background: its buffer must outlive it).
  void release(UcxTagged& t);

  // Why the peer's endpoint failed ("" while it has not).
  std::string peer_failure(int peer) const;
  // For a thread that serves peers' operations on this rank's memory while its owner computes
  // (over TCP the target's progress carries them out), and this rank's own sends that did not
  // fit the socket: progresses until nothing moves and arms the event descriptor. False when
  // events were already queued (call again before sleeping).
  bool drain_and_arm() override { return drain_and_arm(nullptr); }
  // The same; *moved (when given) says whether anything was progressed.
  bool drain_and_arm(bool* moved);
  int event_fd() const override { return efd_; }
  // Ends a sleep on event_fd() from any thread (ucp_worker_signal).
  void wake();

 protected:
  std::chrono::milliseconds timeout() const override { return opts_.timeout; }
  std::chrono::milliseconds liveness_interval() const override {
    return std::chrono::milliseconds(opts_.liveness_interval_ms);
  }
  // Progresses the worker (over TCP this also serves peers' reads of this rank's memory).
  bool progress() override;
  std::string lost_peer() const override;
  // Spins for spin_us, then sleeps on the worker's event descriptor (woken by arriving traffic;
  // at most 1 ms, for RDMA atomics that raise no event).
  void idle(std::chrono::nanoseconds waited) override;

 private:
  struct Peer;
  struct Request;
  // A post's message arriving (on the thread that progresses): into from's slot, then counted.
  void place_post(uint32_t from, const void* data, size_t bytes, bool whole);
  void track(void* status_ptr, int peer, const char* kind);
  std::string peer_name(int peer) const;

  UcxOptions opts_;
  ucp_context_h ctx_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int efd_ = -1;
  std::vector<std::unique_ptr<Peer>> peers_;
  // The control window: posted[size] and slots[size][kSlotsPerPeer][kSlotBytes] (written by
  // place_post), done[size] (peers' atomic adds).
  void* window_ = nullptr;
  size_t window_bytes_ = 0;
  std::unique_ptr<UcxRegion> window_region_;
  std::vector<Request> pending_;
  std::vector<std::vector<uint8_t>> outbox_;  // per peer: the bytes of its post() being put
  std::deque<uint64_t> operands_;            // the operands of the adds not yet complete
  bool unfenced_puts_ = false;               // a put issued since the last fence()
  uint32_t am_header_ = uint32_t(opts_.rank);  // a post's header: the sender (alive while its messages are)
  std::string bad_post_;                     // a message on_post could not place: lost_peer() reports it
};

// The records ranks exchange through the store (addresses, lengths, then packed keys).
inline void append_u64(std::vector<uint8_t>& record, uint64_t v) {
  const auto* p = reinterpret_cast<const uint8_t*>(&v);
  record.insert(record.end(), p, p + 8);
}
inline uint64_t read_u64(const std::vector<uint8_t>& record, size_t at) {
  uint64_t v;
  std::memcpy(&v, record.data() + at, 8);
  return v;
}

// Whether this build has UCX (it always does when this header is compiled in; the Python side
// asks the module).
std::string ucx_version();

}  // namespace cam
