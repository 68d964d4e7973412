// CamConfig: every tunable of a cam group, validated in one place.
// Python (torch_cam/config.py) reads the TORCH_CAM_* environment and pg_options and hands the
// result here as key/value pairs; nothing else in csrc/ reads the environment.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <string>

#include "log.hpp"

namespace cam {

// all_reduce algorithm: by size (kAuto), or forced (tests cover both paths this way).
enum class AllReduceAlgo : int32_t { kAuto = 0, kOneShot, kTwoShot };
const char* allreduce_algo_name(AllReduceAlgo a);

struct CamConfig {
  // Data bytes of each rank's window (control page not included). Messages larger than the
  // window are chunked and pipelined through it.
  int64_t window_bytes = 32ll << 20;
  // Share of the window given to point-to-point outboxes (split evenly over peers); the rest
  // is the collective staging region.
  double p2p_fraction = 0.25;
  // Pipeline granularity of collectives: one slot of a staging ring.
  int64_t chunk_bytes = 256ll << 10;
  // All-to-all blocks of at least this many bytes are read straight out of the sender's
  // tensor (process_vm_readv: one copy instead of two through the window) when every rank's
  // probe at init allowed it. 0 (the default) disables it: on the 2-core development machine
  // the kernel copy runs at ~11 GB/s while two pipelined memcpys through the window finish
  // sooner (benchmarks/bench_single_copy.py measures both).
  int64_t single_copy_bytes = 0;
  // Address space of each rank's tensor arena (torch_cam.empty). Pages are reserved only as
  // tensors are allocated, so a large value costs nothing until used.
  int64_t tensor_heap_bytes = 1ll << 30;
  // all_reduce: one-shot (every rank reduces everything; one synchronisation per chunk) up to
  // this many bytes, reduce-scatter + all-gather (each rank reduces 1/N; two) above.
  int64_t one_shot_max_bytes = 256ll << 10;
  AllReduceAlgo allreduce_algo = AllReduceAlgo::kAuto;
  // Freed MoE outputs kept for reuse (per group), so calls do not page-fault fresh memory.
  int64_t moe_output_cache_bytes = 2ll << 30;
  // One-shot all_reduce up to this size goes eager: the input is copied into the window before
  // the descriptor is published, so the descriptor exchange is the only synchronisation.
  int64_t eager_max_bytes = 64ll << 10;
  // Wait policy tiers, measured from the start of one wait: pause-spin, then sched_yield, then
  // sleeps growing up to sleep_max_us.
  int64_t spin_us = 5;
  int64_t yield_us = 2000;
  int64_t sleep_max_us = 500;
  // How often a waiter checks that the peers it waits on are alive and have not failed.
  int64_t liveness_interval_ms = 50;
  // Background progress thread: poll interval while work is pending but nobody waits on it;
  // stretched up to PollSchedule::kMaxStretch (wait_policy.hpp) times while every op is waited by its issuer.
  int64_t progress_interval_us = 500;
  // What the group logs to stderr (see log.hpp).
  LogLevel log_level = LogLevel::kWarn;
  // Ops the flight recorder keeps (0: none), and where the engine dumps them when the group
  // fails: `<flight_recorder_path><global rank>.json` ("" : no automatic dump).
  int64_t flight_recorder_entries = 2000;
  std::string flight_recorder_path = "/tmp/torch_cam_trace_rank_";
  // Between the hosts of a group that spans hosts: "ucx" (one-sided operations over UCX),
  // "gloo" (torch's gloo), or "auto" (UCX where this build has it, else gloo).
  std::string inter_host_engine = "auto";
  // all_to_all in a group across hosts of equal size (more than one rank each): "direct" (every
  // block straight to its receiver) or "two_hops" (through the rank of the receiver's local
  // index on the sender's host: one message per rail and host; see hierarchical_backend.hpp).
  std::string all_to_all_hops = "direct";
  // Group timeout applied to every wait unless an op carries its own.
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};

  static CamConfig from_map(const std::map<std::string, std::string>& kv,
                            std::chrono::milliseconds timeout);
  // Throws c10::Error naming the offending field.
  void validate(int world_size) const;

  // Layout derived from the fields above and the group size.
  int64_t p2p_ring_bytes(int world_size) const;   // per destination
  int64_t coll_region_bytes(int world_size) const;
  std::string to_string() const;
};

}  // namespace cam
