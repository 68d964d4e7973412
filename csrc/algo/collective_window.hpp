// The collectives' part of every rank's window: what collective.hpp's descriptor exchange and
// the data phases of broadcast, all-to-all, the staged rounds and MoE read and write.
//
//   control  desc_seq          sequence of the newest descriptor this rank published
//            desc[2]           descriptor slots by collective parity (CollDesc + arrays + refusal)
//            produced[N]       stream counters in the producer's window, one per consumer
//            consumed[N]       stream counters in the consumer's window, one per producer
//            reduced           two-shot all_reduce: rounds whose reduced piece the owner published
//   data     eager[2]          small inputs by collective parity (eager collectives)
//            staging           the owner's staging region (rings of slots, written only by it)
//
// Everything a peer reads lives in the writer's own window except `consumed`, which lives in
// the consumer's: every location has a single writer.
#pragma once

#include <cstddef>
#include <cstdint>

#include "../transport/signal.hpp"
#include "../transport/window_layout.hpp"

namespace cam {

// Why a rank refused its own arguments, carried by its descriptor.
constexpr size_t kRefusalTextBytes = 512;

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

class CollectiveWindow {
 public:
  // Reserves the regions in `layout`; bind() once it is sealed.
  CollectiveWindow(WindowLayout& layout, int64_t staging_bytes, int64_t eager_bytes);
  void bind(const WindowLayout& layout);

  size_t desc_slot_bytes() const { return desc_slot_; }
  // What publishing clears of a slot: everything but the refusal text.
  size_t desc_fixed_bytes() const { return desc_slot_ - kRefusalTextBytes; }
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

  uint64_t& produced(char* w, int dst) const { return line(w, off_produced_, dst); }
  uint64_t& consumed(char* w, int src) const { return line(w, off_consumed_, src); }
  uint64_t& reduced(char* w) const { return line(w, off_reduced_, 0); }

  // Eager collectives: a rank's input of collective seq, copied in before its descriptor is
  // published, so that the descriptor exchange is the op's only synchronisation (readers copy
  // straight out and nobody signals back). Two halves by seq parity: a rank that completed
  // seq - 1 saw every descriptor of seq - 1, so every peer has finished seq - 2, the last
  // reader of this half. An op goes eager when its input fits (eager_fits), decided from sizes
  // the descriptors carry, so writer and readers agree.
  int64_t eager_bytes() const { return eager_bytes_; }
  bool eager_fits(int64_t nbytes) const { return nbytes > 0 && nbytes <= eager_bytes_; }
  char* eager(char* w, uint64_t seq) const { return w + off_eager_ + (seq & 1) * eager_bytes_; }

  int64_t staging_bytes() const { return staging_bytes_; }
  char* staging(char* w) const { return w + off_staging_; }

 private:
  uint64_t& line(char* w, size_t off, int i) const {
    return reinterpret_cast<SignalLine*>(w + off)[i].value;
  }
  int n_;
  int64_t staging_bytes_, eager_bytes_;
  size_t desc_slot_;
  WindowLayout::Region r_desc_seq_, r_desc_, r_produced_, r_consumed_, r_reduced_, r_eager_, r_staging_;
  size_t off_desc_seq_ = 0, off_desc_ = 0, off_produced_ = 0, off_consumed_ = 0, off_reduced_ = 0,
         off_eager_ = 0, off_staging_ = 0;
};

}  // namespace cam
