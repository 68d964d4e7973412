#include "window_layout.hpp"

namespace cam {
namespace {
size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }
}  // namespace

WindowLayout::WindowLayout(int world_size, int64_t p2p_ring_bytes, int64_t coll_bytes,
                           int64_t arena_bytes, int64_t eager_bytes)
    : n_(world_size), p2p_ring_(p2p_ring_bytes), coll_bytes_(coll_bytes),
      arena_bytes_(int64_t(align_up(size_t(arena_bytes), 4096))),
      eager_bytes_(int64_t(align_up(size_t(eager_bytes), 64))) {
  const size_t lines = size_t(n_) * sizeof(SignalLine);
  desc_slot_ = align_up(sizeof(CollDesc) + 3 * sizeof(int64_t) * n_, 64) + kRefusalTextBytes;
  size_t off = align_up(sizeof(WindowHeader), 64);
  off_error_ = off;      off += align_up(sizeof(ErrorReport), 64);
  off_desc_seq_ = off;   off += sizeof(SignalLine);
  off_desc_ = off;       off += 2 * desc_slot_;
  off_produced_ = off;   off += lines;
  off_consumed_ = off;   off += lines;
  off_reduced_ = off;    off += sizeof(SignalLine);
  off_p2p_head_ = off;   off += lines;
  off_p2p_tail_ = off;   off += lines;
  off_ack_ = off;        off += size_t(n_) * kAckSlots * sizeof(AckSlot);
  off_eager_ = align_up(off, 64); off = off_eager_ + 2 * size_t(eager_bytes_);
  control_bytes_ = align_up(off, 4096);
  off_p2p_ = control_bytes_;
  off_coll_ = align_up(off_p2p_ + size_t(n_) * p2p_ring_, 4096);
  off_arena_ = align_up(off_coll_ + coll_bytes_, 4096);
  total_bytes_ = off_arena_ + size_t(arena_bytes_);
}

}  // namespace cam
