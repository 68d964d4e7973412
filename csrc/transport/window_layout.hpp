// Window layout: the memory map of every rank's window of the symmetric heap, independent of
// how the window was mapped (POSIX shm today; CUDA IPC or a remote engine later).
//
//   [header]        magic, rank, world size, pid: what a peer checks when it maps the window
//   [wait bell]     the futex its owner parks on when idle, rung by peers (wait_bell.hpp)
//   [error report]  the failure this rank published for its peers (transport-owned)
//   [control area]  regions reserved by the op families (their signal lines and descriptors):
//                   cache-line aligned, zeroed when the window is created
//   [data area]     regions reserved by the op families (rings, staging): page aligned
//   [tensor arena]  heap-resident tensors of the owner (torch_cam.empty), which peers read in
//                   place; its pages are reserved per allocation, not up front
//
// The transport knows only the header, the wait bell, the error report and the arena. What a region holds is
// stated by the family that reserved it (algo/collective_window.hpp, algo/p2p_window.hpp), and
// every rank reserves the same regions in the same order, so offsets agree across the group.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "wait_bell.hpp"

namespace cam {

constexpr uint64_t kWindowMagic = 0x43414d57494e0006ull;  // "CAMWIN" v6
constexpr size_t kErrorTextBytes = 1024;

// `v` rounded up to a multiple of `a`: how regions and the structures inside them are aligned.
constexpr size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

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

class WindowLayout {
 public:
  using Region = int;

  explicit WindowLayout(int world_size);

  // Reserve `bytes` in every window; the region's offset is known once the layout is sealed.
  Region reserve_control(size_t bytes);
  Region reserve_data(size_t bytes);
  // Places every region, then the tensor arena of `arena_bytes` (rounded up to pages). Nothing
  // can be reserved afterwards.
  void seal(int64_t arena_bytes);

  int world_size() const { return n_; }
  bool sealed() const { return sealed_; }
  size_t offset(Region r) const;
  size_t control_bytes() const { return control_bytes_; }
  size_t total_bytes() const { return total_bytes_; }
  // The part reserved at creation (everything before the tensor arena).
  size_t reserved_bytes() const { return off_arena_; }
  int64_t arena_bytes() const { return arena_bytes_; }

  WindowHeader* header(char* w) const { return reinterpret_cast<WindowHeader*>(w); }
  WaitBell* bell(char* w) const { return reinterpret_cast<WaitBell*>(w + off_bell_); }
  ErrorReport* error(char* w) const { return reinterpret_cast<ErrorReport*>(w + off_error_); }
  char* arena(char* w) const { return w + off_arena_; }

 private:
  struct Reservation {
    bool control;
    size_t bytes;
    size_t offset = 0;
  };
  Region reserve(bool control, size_t bytes);
  int n_;
  bool sealed_ = false;
  std::vector<Reservation> regions_;
  int64_t arena_bytes_ = 0;
  size_t off_bell_ = 0, off_error_ = 0, off_arena_ = 0, control_bytes_ = 0, total_bytes_ = 0;
};

}  // namespace cam
