#include "config.hpp"

#include <c10/util/Exception.h>

#include <algorithm>
#include <sstream>

namespace cam {

const char* allreduce_algo_name(AllReduceAlgo a) {
  return a == AllReduceAlgo::kAuto ? "auto" : a == AllReduceAlgo::kOneShot ? "one_shot" : "two_shot";
}

CamConfig CamConfig::from_map(const std::map<std::string, std::string>& kv,
                              std::chrono::milliseconds timeout) {
  CamConfig c;
  c.timeout = timeout;
  for (const auto& [key, value] : kv) {
    auto as_int = [&]() {
      try {
        size_t used = 0;
        int64_t v = std::stoll(value, &used);
        TORCH_CHECK(used == value.size(), "");
        return v;
      } catch (...) {
        TORCH_CHECK(false, "cam option ", key, ": expected an integer, got '", value, "'");
      }
    };
    if (key == "window_bytes") c.window_bytes = as_int();
    else if (key == "chunk_bytes") c.chunk_bytes = as_int();
    else if (key == "single_copy_bytes") c.single_copy_bytes = as_int();
    else if (key == "spin_us") c.spin_us = as_int();
    else if (key == "yield_us") c.yield_us = as_int();
    else if (key == "sleep_max_us") c.sleep_max_us = as_int();
    else if (key == "liveness_interval_ms") c.liveness_interval_ms = as_int();
    else if (key == "progress_interval_us") c.progress_interval_us = as_int();
    else if (key == "one_shot_max_bytes") c.one_shot_max_bytes = as_int();
    else if (key == "tensor_heap_bytes") c.tensor_heap_bytes = as_int();
    else if (key == "eager_max_bytes") c.eager_max_bytes = as_int();
    else if (key == "moe_output_cache_bytes") c.moe_output_cache_bytes = as_int();
    else if (key == "allreduce_algo") {
      if (value == "auto") c.allreduce_algo = AllReduceAlgo::kAuto;
      else if (value == "one_shot") c.allreduce_algo = AllReduceAlgo::kOneShot;
      else if (value == "two_shot") c.allreduce_algo = AllReduceAlgo::kTwoShot;
      else TORCH_CHECK(false, "cam option allreduce_algo: expected auto, one_shot or two_shot, got '", value, "'");
    }
    else if (key == "p2p_fraction") c.p2p_fraction = std::stod(value);
    else if (key == "log_level") c.log_level = parse_log_level(value);
    else if (key == "flight_recorder_entries") c.flight_recorder_entries = as_int();
    else if (key == "flight_recorder_path") c.flight_recorder_path = value;
    else if (key == "inter_host_engine") {
      TORCH_CHECK(value == "auto" || value == "ucx" || value == "gloo",
                  "cam option inter_host_engine: expected auto, ucx or gloo, got '", value, "'");
      c.inter_host_engine = value;
    }
    else if (key == "all_to_all_hops") {
      TORCH_CHECK(value == "direct" || value == "two_hops",
                  "cam option all_to_all_hops: expected direct or two_hops, got '", value, "'");
      c.all_to_all_hops = value;
    }
    else TORCH_CHECK(false, "cam: unknown option '", key, "'");
  }
  return c;
}

int64_t CamConfig::p2p_ring_bytes(int world_size) const {
  // Rings are whole multiples of 4 KiB so that message headers (64 B) never wrap.
  int64_t share = int64_t(double(window_bytes) * p2p_fraction) / std::max(world_size, 1);
  return share / 4096 * 4096;
}

int64_t CamConfig::coll_region_bytes(int world_size) const {
  return (window_bytes - p2p_ring_bytes(world_size) * world_size) / 4096 * 4096;
}

void CamConfig::validate(int world_size) const {
  TORCH_CHECK(world_size >= 1 && world_size <= 4096, "cam: group size ", world_size,
              " is outside 1..4096");
  TORCH_CHECK(chunk_bytes >= 4096 && chunk_bytes % 64 == 0,
              "cam option chunk_bytes: expected a multiple of 64 that is >= 4096, got ",
              chunk_bytes);
  TORCH_CHECK(single_copy_bytes >= 0, "cam option single_copy_bytes: expected >= 0 (0 disables), got ",
              single_copy_bytes);
  TORCH_CHECK(p2p_fraction > 0.0 && p2p_fraction < 1.0,
              "cam option p2p_fraction: expected a value in (0, 1), got ", p2p_fraction);
  TORCH_CHECK(p2p_ring_bytes(world_size) >= 8192,
              "cam option window_bytes: ", window_bytes, " bytes leave each of the ", world_size,
              " point-to-point outboxes under 8 KiB; use at least ",
              int64_t(8192 * world_size / p2p_fraction) + 4096, " bytes");
  // Every all-to-all channel needs at least two 4 KiB slots to pipeline.
  TORCH_CHECK(coll_region_bytes(world_size) >= int64_t(world_size) * 2 * 4096,
              "cam option window_bytes: ", window_bytes, " bytes leave the collective region "
              "too small for ", world_size, " ranks; use at least ",
              int64_t(world_size) * 8192 * 2 + 65536, " bytes");
  TORCH_CHECK(tensor_heap_bytes >= 0 && tensor_heap_bytes <= (1ll << 44),
              "cam option tensor_heap_bytes: expected 0..16 TiB, got ", tensor_heap_bytes);
  TORCH_CHECK(eager_max_bytes >= 0 && eager_max_bytes <= (16ll << 20),
              "cam option eager_max_bytes: expected 0..16 MiB, got ", eager_max_bytes);
  TORCH_CHECK(moe_output_cache_bytes >= 0, "cam option moe_output_cache_bytes: expected >= 0, got ",
              moe_output_cache_bytes);
  TORCH_CHECK(one_shot_max_bytes >= 0, "cam option one_shot_max_bytes: expected >= 0, got ",
              one_shot_max_bytes);
  TORCH_CHECK(spin_us >= 0 && yield_us >= spin_us && sleep_max_us >= 1,
              "cam options: expected 0 <= spin_us <= yield_us and sleep_max_us >= 1, got spin_us=",
              spin_us, " yield_us=", yield_us, " sleep_max_us=", sleep_max_us);
  TORCH_CHECK(liveness_interval_ms >= 1 && progress_interval_us >= 10,
              "cam options: liveness_interval_ms must be >= 1 and progress_interval_us >= 10");
  TORCH_CHECK(flight_recorder_entries >= 0 && flight_recorder_entries <= (1 << 24),
              "cam option flight_recorder_entries: expected 0..16777216 (0 disables), got ",
              flight_recorder_entries);
  TORCH_CHECK(timeout.count() > 0, "cam: the group timeout must be positive");
}

std::string CamConfig::to_string() const {
  std::ostringstream os;
  os << "window_bytes=" << window_bytes << " p2p_fraction=" << p2p_fraction
     << " chunk_bytes=" << chunk_bytes << " single_copy_bytes=" << single_copy_bytes
     << " tensor_heap_bytes=" << tensor_heap_bytes << " eager_max_bytes=" << eager_max_bytes << " one_shot_max_bytes=" << one_shot_max_bytes
     << " moe_output_cache_bytes=" << moe_output_cache_bytes << " allreduce_algo="
     << allreduce_algo_name(allreduce_algo)
     << " spin_us=" << spin_us << " yield_us=" << yield_us
     << " sleep_max_us=" << sleep_max_us << " liveness_interval_ms=" << liveness_interval_ms
     << " progress_interval_us=" << progress_interval_us << " log_level=" << log_level_name(log_level)
     << " flight_recorder_entries=" << flight_recorder_entries
     << " flight_recorder_path=" << flight_recorder_path << " inter_host_engine=" << inter_host_engine << " all_to_all_hops=" << all_to_all_hops << " timeout_ms=" << timeout.count();
  return os.str();
}

}  // namespace cam
