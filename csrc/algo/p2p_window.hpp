// The point-to-point part of every rank's window (p2p.hpp's protocol):
//
//   control  head[N]            bytes written into the outbox for each destination (sender's window)
//            tail[N]            bytes consumed of each source's outbox (receiver's window)
//            ack[N][kAckSlots]  acknowledgements of each source's messages (receiver's window)
//   data     outbox[N]          one byte ring per destination, written only by the owner
#pragma once

#include <cstddef>
#include <cstdint>

#include "../transport/signal.hpp"
#include "../transport/window_layout.hpp"

namespace cam {

constexpr int kAckSlots = 64;  // unacknowledged p2p messages per (src, dst)
constexpr size_t kAckReasonBytes = 224;

struct alignas(64) AckSlot {
  uint64_t seq;            // 1 + message index, release-stored last
  int64_t expected_nbytes; // what the matching recv holds (for the sender's error message)
  int32_t status;          // AckStatus
  int32_t expected_dtype;
  char reason[kAckReasonBytes];  // kAckRefused: why the recv refused its own arguments
};
static_assert(sizeof(AckSlot) == 256);

enum AckStatus : int32_t { kAckOk = 0, kAckSizeMismatch = 1, kAckRefused = 2 };

class P2PWindow {
 public:
  // Reserves the regions in `layout`; bind() once it is sealed.
  P2PWindow(WindowLayout& layout, int64_t ring_bytes);
  void bind(const WindowLayout& layout);

  int64_t ring_bytes() const { return ring_bytes_; }
  uint64_t& head(char* w, int dst) const { return line(w, off_head_, dst); }
  uint64_t& tail(char* w, int src) const { return line(w, off_tail_, src); }
  AckSlot& ack(char* w, int src, uint64_t msg) const {
    return reinterpret_cast<AckSlot*>(w + off_ack_)[src * kAckSlots + (msg % kAckSlots)];
  }
  char* ring(char* w, int dst) const { return w + off_ring_ + size_t(dst) * ring_bytes_; }

 private:
  uint64_t& line(char* w, size_t off, int i) const {
    return reinterpret_cast<SignalLine*>(w + off)[i].value;
  }
  int64_t ring_bytes_;
  WindowLayout::Region r_head_, r_tail_, r_ack_, r_ring_;
  size_t off_head_ = 0, off_tail_ = 0, off_ack_ = 0, off_ring_ = 0;
};

}  // namespace cam
