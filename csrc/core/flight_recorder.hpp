// FlightRecorder: the last N ops of one group on this rank (N: the group's
// flight_recorder_entries option), each with what it was (sequence number, op, sizes, dtype,
// peer), how far it got (issued, started, completed, failed) and when. Every live recorder is
// listed process-wide, so one dump holds every group of the process: the engine writes it when
// a group fails (timeout, dead or failed peer), torch_cam.dump_flight_recorder() on demand, and
// `python -m torch_cam.trace` reads the dumps of all ranks and names the op and the rank the
// others wait on. Recording costs one uncontended lock and a few stores per op.
//
// Dump format (JSON, version 1): {"version", "rank" (global), "pid", "host", "reason",
// "dumped_us", "groups": [{"group", "desc", "rank", "size", "entries": [{"id", "seq", "op",
// "kind" (collective | p2p | one-sided), "peer" (-1: every rank), "dtype", "sizes" (first
// tensor), "tensors", "numel" (all tensors), "state", "issued_us", "started_us", "ended_us",
// "error"}]}]}. Times are microseconds since the Unix epoch (0: not yet).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace cam {

class FlightRecorder {
 public:
  enum class State : int8_t { kIssued = 0, kStarted, kCompleted, kFailed };
  struct Group {
    std::string id, desc;
    int rank = 0, size = 0;
  };

  // A recorder keeping `capacity` entries (0: records nothing), listed for dumps while alive.
  static std::shared_ptr<FlightRecorder> create(Group group, int64_t capacity);
  ~FlightRecorder();

  bool enabled() const { return !ring_.empty(); }
  // Records an op; returns its id (0 when disabled). `tensors` describe its data (may be null);
  // `started`: the op also starts now (one that does not wait for its turn in a queue).
  uint64_t issued(const char* op, const char* kind, uint64_t seq, int peer,
                  const std::vector<at::Tensor>* tensors, bool started = false);
  void started(uint64_t id);
  // error: null on success. Ignored for an id already finished or overwritten.
  void finished(uint64_t id, const char* error);

  // The process's global rank, for dumps and their file names (set by the Python front end).
  static void set_process_rank(int rank);
  static int process_rank();
  // Every live recorder of the process as one JSON document.
  static std::string dump_json(const std::string& reason);
  // Writes dump_json(reason) to `path` (atomically: a temporary file renamed); returns an
  // error message, empty on success.
  static std::string dump_to(const std::string& path, const std::string& reason);

 private:
  struct Entry {
    uint64_t id = 0, seq = 0;
    const char* op = "";
    const char* kind = "";
    int32_t peer = -1;
    int16_t dtype = -1;  // c10::ScalarType, -1: no tensor
    int8_t ndim = 0;
    State state = State::kIssued;
    int32_t tensors = 0;
    int64_t sizes[6] = {};
    int64_t numel = 0;
    int64_t issued_us = 0, started_us = 0, ended_us = 0;
    std::string error;
  };
  FlightRecorder(Group group, int64_t capacity);
  Entry* find(uint64_t id);
  void append_json(std::string& out) const;

  Group group_;
  mutable std::mutex mu_;
  std::vector<Entry> ring_;
  uint64_t next_id_ = 1;
};

}  // namespace cam
