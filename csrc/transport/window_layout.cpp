#include "window_layout.hpp"

#include <c10/util/Exception.h>

namespace cam {
WindowLayout::WindowLayout(int world_size) : n_(world_size) {
  off_bell_ = align_up(sizeof(WindowHeader), 64);
  off_error_ = off_bell_ + sizeof(WaitBell);
}

WindowLayout::Region WindowLayout::reserve(bool control, size_t bytes) {
  TORCH_CHECK(!sealed_, "cam: a window region was reserved after the layout was sealed");
  regions_.push_back({control, bytes});
  return Region(regions_.size() - 1);
}

WindowLayout::Region WindowLayout::reserve_control(size_t bytes) { return reserve(true, bytes); }
WindowLayout::Region WindowLayout::reserve_data(size_t bytes) { return reserve(false, bytes); }

void WindowLayout::seal(int64_t arena_bytes) {
  TORCH_CHECK(!sealed_, "cam: a window layout was sealed twice");
  size_t off = off_error_ + align_up(sizeof(ErrorReport), 64);
  for (auto& r : regions_) {
    if (!r.control) continue;
    r.offset = off;
    off = align_up(off + r.bytes, 64);
  }
  control_bytes_ = align_up(off, 4096);
  off = control_bytes_;
  for (auto& r : regions_) {
    if (r.control) continue;
    r.offset = off;
    off = align_up(off + r.bytes, 4096);
  }
  off_arena_ = off;
  arena_bytes_ = int64_t(align_up(size_t(arena_bytes), 4096));
  total_bytes_ = off_arena_ + size_t(arena_bytes_);
  sealed_ = true;
}

size_t WindowLayout::offset(Region r) const {
  TORCH_CHECK(sealed_ && r >= 0 && size_t(r) < regions_.size(), "cam: window region ", r,
              " looked up before the layout was sealed or never reserved");
  return regions_[r].offset;
}

}  // namespace cam
