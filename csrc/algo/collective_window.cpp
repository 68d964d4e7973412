#include "collective_window.hpp"

namespace cam {

CollectiveWindow::CollectiveWindow(WindowLayout& layout, int64_t staging_bytes, int64_t eager_bytes)
    : n_(layout.world_size()),
      staging_bytes_(staging_bytes),
      eager_bytes_(int64_t(align_up(size_t(eager_bytes), 64))) {
  const size_t lines = size_t(n_) * sizeof(SignalLine);
  desc_slot_ = align_up(sizeof(CollDesc) + 3 * sizeof(int64_t) * size_t(n_), 64) + kRefusalTextBytes;
  r_desc_seq_ = layout.reserve_control(sizeof(SignalLine));
  r_desc_ = layout.reserve_control(2 * desc_slot_);
  r_produced_ = layout.reserve_control(lines);
  r_consumed_ = layout.reserve_control(lines);
  r_reduced_ = layout.reserve_control(sizeof(SignalLine));
  r_eager_ = layout.reserve_data(2 * size_t(eager_bytes_));
  r_staging_ = layout.reserve_data(size_t(staging_bytes_));
}

void CollectiveWindow::bind(const WindowLayout& layout) {
  off_desc_seq_ = layout.offset(r_desc_seq_);
  off_desc_ = layout.offset(r_desc_);
  off_produced_ = layout.offset(r_produced_);
  off_consumed_ = layout.offset(r_consumed_);
  off_reduced_ = layout.offset(r_reduced_);
  off_eager_ = layout.offset(r_eager_);
  off_staging_ = layout.offset(r_staging_);
}

}  // namespace cam
