// Window layout: what every rank's window of the symmetric heap holds, independent of how the
// window was mapped (POSIX shm today; CUDA IPC or a remote engine later).
//
//   [control area]  header, error report, collective descriptors, stream counters,
//                   p2p head/tail counters, p2p acknowledgement slots
//   [eager area]    two halves (by collective parity) for small all_reduce inputs
//   [p2p outboxes]  one byte ring per destination rank, written only by the owner
//   [coll region]   staging area of collectives, written only by the owner
//   [tensor arena]  heap-resident tensors of the owner (torch_cam.empty), which peers read in
//                   place; its pages are reserved per allocation, not up front
//
// Everything a peer reads lives in the writer's own window except tails and acks, which live
// in the consumer's window: every location has a single writer.
#pragma once

#include <cstddef>
#include <cstdint>

#include "signal.hpp"

namespace cam {

constexpr uint64_t kWindowMagic = 0x43414d57494e0004ull;  // "CAMWIN" v4
constexpr int kAckSlots = 64;           // unacknowledged p2p messages per (src, dst)
constexpr size_t kErrorTextBytes = 1024;
// Why a rank refused its own arguments (collective descriptors, p2p acknowledgements).
constexpr size_t kRefusalTextBytes = 512;
constexpr size_t kAckReasonBytes = 224;

struct alignas(64) WindowHeader {
  uint64_t magic;
  int64_t rank;
  int64_t world_size;
  int64_t pid;
  int64_t data_bytes;
};

// A rank that hits an unrecoverable error (timeout, dead peer) publishes it here so that peers
// waiting on it fail at once with the cause instead of timing out.
struct alignas(64) ErrorReport {
  uint64_t seq;  // 0: healthy; otherwise 1 + the op sequence that failed (signal_release'd last)
  char text[kErrorTextBytes];
};

// What a rank is about to do in collective number `seq`. Every rank publishes one and reads
// everyone's before any byte moves, so mismatches are found by all ranks alike.
struct alignas(64) CollDesc {
  uint64_t seq;
  int32_t op;        // CollKind
  int32_t root;
  int32_t dtype;     // c10::ScalarType
  int32_t elem_size;
  int64_t nbytes;    // broadcast: payload bytes
  // > 0: this rank reads blocks of at least this many bytes straight from the sender's memory
  // (single-copy path); 0: everything sent to it is staged through the window.
  int64_t direct_min_bytes;
  // >= 0: this rank's input lives in its tensor arena at this offset (peers may read it in
  // place; all-to-all: send_addr[] then holds arena offsets of the blocks); -1: it does not.
  int64_t heap_off;
  int32_t red_op;    // kernels::RedOp of reductions
  int32_t algo;      // algorithm the rank chose (all ranks must agree)
  // 1: this rank's own checks refused its arguments; the slot's refusal text says why and
  // nothing else in the descriptor is meaningful.
  int32_t refused;
  // followed in the slot by int64 send_bytes[N], recv_bytes[N], send_addr[N] (all-to-all),
  // then the refusal text (kRefusalTextBytes, NUL-terminated; written only when refused)
};

struct alignas(64) AckSlot {
  uint64_t seq;            // 1 + message index, release-stored last
  int64_t expected_nbytes; // what the matching recv holds (for the sender's error message)
  int32_t status;          // AckStatus
  int32_t expected_dtype;
  char reason[kAckReasonBytes];  // kAckRefused: why the recv refused its own arguments
};
static_assert(sizeof(AckSlot) == 256);

enum AckStatus : int32_t { kAckOk = 0, kAckSizeMismatch = 1, kAckRefused = 2 };

class WindowLayout {
 public:
  WindowLayout(int world_size, int64_t p2p_ring_bytes, int64_t coll_bytes, int64_t arena_bytes,
               int64_t eager_bytes);

  int world_size() const { return n_; }
  size_t control_bytes() const { return control_bytes_; }
  size_t total_bytes() const { return total_bytes_; }
  // The part reserved at creation (everything before the tensor arena).
  size_t reserved_bytes() const { return off_arena_; }
  int64_t arena_bytes() const { return arena_bytes_; }
  int64_t p2p_ring_bytes() const { return p2p_ring_; }
  int64_t coll_bytes() const { return coll_bytes_; }
  size_t desc_slot_bytes() const { return desc_slot_; }
  // What publishing clears of a slot: everything but the refusal text.
  size_t desc_fixed_bytes() const { return desc_slot_ - kRefusalTextBytes; }

  WindowHeader* header(char* w) const { return reinterpret_cast<WindowHeader*>(w); }
  ErrorReport* error(char* w) const { return reinterpret_cast<ErrorReport*>(w + off_error_); }
  uint64_t& desc_seq(char* w) const { return line(w, off_desc_seq_, 0); }
  CollDesc* desc(char* w, uint64_t seq) const {
    return reinterpret_cast<CollDesc*>(w + off_desc_ + (seq & 1) * desc_slot_);
  }
  int64_t* desc_send_bytes(CollDesc* d) const { return reinterpret_cast<int64_t*>(d + 1); }
  int64_t* desc_recv_bytes(CollDesc* d) const { return desc_send_bytes(d) + n_; }
  const int64_t* desc_send_bytes(const CollDesc* d) const { return reinterpret_cast<const int64_t*>(d + 1); }
  const int64_t* desc_recv_bytes(const CollDesc* d) const { return desc_send_bytes(d) + n_; }
  // Address, in the owner's address space, of its block for each destination.
  uint64_t* desc_send_addr(CollDesc* d) const { return reinterpret_cast<uint64_t*>(desc_recv_bytes(d) + n_); }
  const uint64_t* desc_send_addr(const CollDesc* d) const {
    return reinterpret_cast<const uint64_t*>(desc_recv_bytes(d) + n_);
  }
  char* desc_refusal(CollDesc* d) const { return reinterpret_cast<char*>(d) + desc_fixed_bytes(); }
  const char* desc_refusal(const CollDesc* d) const {
    return reinterpret_cast<const char*>(d) + desc_fixed_bytes();
  }
  // Collective streams: produced[dst] in the producer's window, consumed[src] in the consumer's.
  uint64_t& produced(char* w, int dst) const { return line(w, off_produced_, dst); }
  uint64_t& consumed(char* w, int src) const { return line(w, off_consumed_, src); }
  // Reduce-scatter + all-gather: rounds whose reduced piece the owner has published.
  uint64_t& reduced(char* w) const { return line(w, off_reduced_, 0); }
  // P2P byte streams: head[dst] (bytes written) in the sender's window, tail[src] (bytes
  // consumed) in the receiver's window.
  uint64_t& p2p_head(char* w, int dst) const { return line(w, off_p2p_head_, dst); }
  uint64_t& p2p_tail(char* w, int src) const { return line(w, off_p2p_tail_, src); }
  AckSlot& ack(char* w, int src, uint64_t msg) const {
    return reinterpret_cast<AckSlot*>(w + off_ack_)[src * kAckSlots + (msg % kAckSlots)];
  }
  char* p2p_ring(char* w, int dst) const { return w + off_p2p_ + size_t(dst) * p2p_ring_; }
  char* coll_region(char* w) const { return w + off_coll_; }
  char* arena(char* w) const { return w + off_arena_; }
  // Eager all_reduce: collective seq's input, written before its descriptor is published. Two
  // halves by seq parity: a rank that completed seq - 1 saw every descriptor of seq - 1, so
  // every peer has finished seq - 2, the last reader of this half.
  int64_t eager_bytes() const { return eager_bytes_; }
  char* eager(char* w, uint64_t seq) const { return w + off_eager_ + (seq & 1) * eager_bytes_; }

 private:
  uint64_t& line(char* w, size_t off, int i) const {
    return reinterpret_cast<SignalLine*>(w + off)[i].value;
  }
  int n_;
  int64_t p2p_ring_, coll_bytes_, arena_bytes_, eager_bytes_;
  size_t desc_slot_;
  size_t off_error_, off_desc_seq_, off_desc_, off_produced_, off_consumed_, off_reduced_, off_p2p_head_,
      off_p2p_tail_, off_ack_, off_eager_, off_p2p_, off_coll_, off_arena_;
  size_t control_bytes_, total_bytes_;
};

}  // namespace cam
