// OneSidedTransport: the operations an algorithm between hosts is written against, so that it
// never sees how bytes travel (UcxTransport over UCX; LoopbackTransport, ranks as threads of one
// process, for tests with injected faults).
//
// Contract:
//   - Each rank owns a control window that peers write: posted[q] and done[q] (64-bit counters
//     peer q adds to) and kSlotsPerPeer slots of kSlotBytes that peer q's post()s fill in turn
//     (post n goes to slot n % kSlotsPerPeer: a peer may post its next descriptor before this
//     rank has read the last, never two ahead).
//   - register_memory() makes local memory writable by peers; its packed key travels inside a
//     descriptor and unpack_key() turns it into the key put() needs.
//   - put() and post() are non-blocking; complete() waits for every one issued so far (a put's
//     source must stay valid until then). post() puts bytes into this rank's slot at the peer
//     (the transport keeps them until complete()) and then adds one to the peer's posted[rank],
//     ordered so that a peer that sees the count sees the bytes. signal_done() adds one to the
//     peer's done[rank], ordered after every put to that peer issued before it.
//   - wait_until() is the one wait of every transport: it drives progress() until the predicate
//     holds and raises FatalError at the deadline (naming what it waited for), when lost_peer()
//     reports a peer gone, or when the interrupt hook (called every liveness interval, and
//     before a peer's loss is reported, so that a cause published first wins) throws. Between
//     passes that made no progress it calls idle(): each transport's way not to burn a core.
//   - Between ops the owner serves the transport: drain_and_arm() progresses until nothing moves
//     and arms event_fd(), which becomes readable when there is more to do (-1: a transport
//     with nothing to serve). Over a stream (UCX over TCP) the tail of a put, and the done
//     behind it, move only while the sender progresses, and its peer may still wait for them.
//   - Every error reads "<what> on rank r of group G: <why>" (raise()).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace cam {

class MemoryRegion {
 public:
  virtual ~MemoryRegion() = default;
  virtual const std::vector<uint8_t>& packed_key() const = 0;
};

class RemoteKey {
 public:
  virtual ~RemoteKey() = default;
};

class OneSidedTransport {
 public:
  static constexpr size_t kSlotBytes = 18 << 10;
  static constexpr int kSlotsPerPeer = 2;

  virtual ~OneSidedTransport() = default;
  virtual std::string name() const = 0;  // "ucx", "loopback": for messages
  virtual int rank() const = 0;
  virtual int size() const = 0;
  void set_interrupt(std::function<void()> hook) { interrupt_ = std::move(hook); }

  virtual std::unique_ptr<MemoryRegion> register_memory(void* base, size_t bytes) = 0;
  virtual std::unique_ptr<RemoteKey> unpack_key(int peer, const void* packed) = 0;
  virtual void put(int peer, const void* src, size_t bytes, uint64_t remote_addr, const RemoteKey& key) = 0;
  virtual void post(int peer, std::vector<uint8_t> bytes) = 0;
  virtual void signal_done(int peer) = 0;
  virtual void complete(const std::string& what) = 0;

  virtual uint64_t posted(int from) const = 0;
  virtual uint64_t done(int from) const = 0;
  // The bytes of from's post number n (counted from 0), until post n + kSlotsPerPeer arrives.
  virtual const uint8_t* slot(int from, uint64_t n) const = 0;

  virtual int event_fd() const { return -1; }
  virtual bool drain_and_arm() { return true; }  // false: events were queued (call again)

  // `waiting_for` (may be empty) says, for the timeout's message, what has not arrived.
  void wait_until(const std::function<bool()>& ready, const std::string& what,
                  const std::function<std::string()>& waiting_for = {});
  [[noreturn]] virtual void raise(const std::string& what, const std::string& why) const = 0;

 protected:
  virtual std::chrono::milliseconds timeout() const = 0;
  virtual std::chrono::milliseconds liveness_interval() const = 0;
  virtual bool progress() = 0;                 // true: something moved
  virtual std::string lost_peer() const = 0;   // why a peer is gone; empty while all are there
  virtual void idle(std::chrono::nanoseconds waited) = 0;

 private:
  std::function<void()> interrupt_;
};

}  // namespace cam
