#include "p2p_window.hpp"

namespace cam {

P2PWindow::P2PWindow(WindowLayout& layout, int64_t ring_bytes) : ring_bytes_(ring_bytes) {
  const int n = layout.world_size();
  const size_t lines = size_t(n) * sizeof(SignalLine);
  r_head_ = layout.reserve_control(lines);
  r_tail_ = layout.reserve_control(lines);
  r_ack_ = layout.reserve_control(size_t(n) * kAckSlots * sizeof(AckSlot));
  r_ring_ = layout.reserve_data(size_t(n) * size_t(ring_bytes_));
}

void P2PWindow::bind(const WindowLayout& layout) {
  off_head_ = layout.offset(r_head_);
  off_tail_ = layout.offset(r_tail_);
  off_ack_ = layout.offset(r_ack_);
  off_ring_ = layout.offset(r_ring_);
}

}  // namespace cam
