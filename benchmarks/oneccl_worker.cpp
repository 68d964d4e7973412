// One rank of bench_oneccl.py: times Intel oneCCL's CPU collectives with the method of
// _common.py (see there), so its rows sit beside cam's, gloo's and Open MPI's.
//
//   oneccl_worker RANK WORLD KVS_FILE PLAN CELLS OUT_JSON
//
// KVS_FILE: rank 0 writes its key-value store address there, the others read it (no launcher).
// PLAN: "target_batch_s,cell_budget_s,min_samples,max_samples,max_batch,barrier_overhead_s"
// (a _common.Plan). CELLS: "op:bytes:warmup,..." in the order to run them. Rank 0 writes one
// JSON object {"rows": [{"op", "size", "batch", "samples", "times_s", "ok"}]} to OUT_JSON; the
// launcher turns times into medians with _common.summarize. Ops and buffers as bench_mpi.py:
// roundtrip (8 B send/recv rank 0 <-> 1), broadcast (root 0), all_to_all_single (size = send
// buffer), all_reduce (in place, SUM; fp32, and bf16 as all_reduce_bf16), all_gather_into_tensor
// (size = send buffer), reduce_scatter_tensor (size = send buffer = world x receive buffer).
#include <oneapi/ccl.hpp>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

struct Plan {
  double target_batch_s, cell_budget_s, barrier_overhead_s;
  int64_t min_samples, max_samples, max_batch;
  // _common.Plan.choose: a batch lasting about target_batch_s, samples filling the cell budget.
  std::pair<int64_t, int64_t> choose(double per_op_s) const {
    per_op_s = std::max(per_op_s, 1e-7);
    const int64_t batch = int64_t(std::min<double>(max_batch, std::max(1.0, std::floor(target_batch_s / per_op_s))));
    const double per_sample = double(batch) * per_op_s + barrier_overhead_s;
    const int64_t samples =
        int64_t(std::min<double>(max_samples, std::max<double>(min_samples, std::floor(cell_budget_s / per_sample))));
    return {batch, samples};
  }
};

struct Cell {
  std::string op;
  int64_t bytes, warmup;
};

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string part; std::getline(in, part, sep);) out.push_back(part);
  return out;
}

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// bfloat16 of a float that bf16 holds exactly (the checks use small integers).
uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return uint16_t(u >> 16);
}
float from_bf16(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

class Runner {
 public:
  Runner(int rank, int world, ccl::communicator& comm) : rank_(rank), world_(world), comm_(comm) {}

  // Times one cell; returns its row as JSON.
  std::string run(const Cell& c, const Plan& plan) {
    prepare(c);
    std::function<void()> fn = op_fn(c.op);
    const bool pingpong = c.op == "roundtrip";
    // Ranks outside the ping-pong wait in sleeping barriers (as bench_mpi.py's), so that they
    // take no core from ranks 0 and 1; every other op syncs with a plain barrier.
    auto sync = [&] { pingpong ? idle_barrier() : barrier(); };
    fn();  // untimed first op
    for (int64_t i = 0; i < c.warmup; ++i) fn();
    sync();
    auto t0 = Clock::now();
    for (int64_t i = 0; i < c.warmup; ++i) fn();
    double est = seconds_since(t0) / double(std::max<int64_t>(c.warmup, 1));
    if (pingpong) sync();
    est = max_over_ranks(std::vector<double>{est})[0];
    auto [batch, samples] = plan.choose(est);
    std::vector<double> times;
    for (int64_t s = 0; s < samples; ++s) {
      if (!pingpong) barrier();  // a ping-pong synchronizes itself
      t0 = Clock::now();
      for (int64_t b = 0; b < batch; ++b) fn();
      times.push_back(seconds_since(t0) / double(batch));
    }
    if (pingpong) {
      sync();
      // rank 0's times are the round trips; the others' are not comparable
      if (rank_ != 0) std::fill(times.begin(), times.end(), 0.0);
    }
    times = max_over_ranks(times);
    const bool ok = all_ranks(check(c, fn));
    std::ostringstream row;
    row << "{\"op\": \"" << c.op << "\", \"size\": " << c.bytes << ", \"batch\": " << batch
        << ", \"samples\": " << samples << ", \"ok\": " << (ok ? "true" : "false") << ", \"times_s\": [";
    for (size_t i = 0; i < times.size(); ++i) row << (i ? ", " : "") << times[i];
    row << "]}";
    return row.str();
  }

 private:
  void barrier() { ccl::barrier(comm_).wait(); }
  void idle_barrier() {
    auto ev = ccl::barrier(comm_);
    while (!ev.test()) usleep(1000);
  }

  std::vector<double> max_over_ranks(std::vector<double> v) {
    std::vector<double> out(v.size());
    ccl::allreduce(v.data(), out.data(), v.size(), ccl::reduction::max, comm_).wait();
    return out;
  }
  bool all_ranks(bool ok) {
    int v = ok ? 1 : 0, out = 0;
    ccl::allreduce(&v, &out, 1, ccl::reduction::min, comm_).wait();
    return out == 1;
  }

  void prepare(const Cell& c) {
    n_ = c.bytes / (c.op == "all_reduce_bf16" ? 2 : 4);
    if (c.op == "roundtrip") n_ = 2;
    if (c.op == "reduce_scatter_tensor" || c.op == "all_to_all_single") n_ -= n_ % world_;
    const int64_t recv_n = c.op == "all_gather_into_tensor" ? n_ * world_
                           : c.op == "reduce_scatter_tensor" ? n_ / world_
                                                              : n_;
    send_.assign(size_t(n_), 0.0f);  // zeros: a timed in-place SUM loop stays finite
    recv_.assign(size_t(recv_n), 0.0f);  // touched: pages faulted in before timing
    send16_.assign(c.op == "all_reduce_bf16" ? size_t(n_) : 0, 0);
  }

  std::function<void()> op_fn(const std::string& op) {
    float* s = send_.data();
    float* r = recv_.data();
    const size_t n = size_t(n_);
    auto& comm = comm_;
    if (op == "roundtrip") {
      const int rank = rank_;
      return [s, &comm, rank] {
        if (rank == 0) {
          ccl::send(s, 2, ccl::datatype::float32, 1, comm).wait();
          ccl::recv(s, 2, ccl::datatype::float32, 1, comm).wait();
        } else if (rank == 1) {
          ccl::recv(s, 2, ccl::datatype::float32, 0, comm).wait();
          ccl::send(s, 2, ccl::datatype::float32, 0, comm).wait();
        }
      };
    }
    if (op == "broadcast") return [s, n, &comm] { ccl::broadcast(s, n, ccl::datatype::float32, 0, comm).wait(); };
    if (op == "all_to_all_single") {
      const size_t per = n / size_t(world_);
      return [s, r, per, &comm] { ccl::alltoall(s, r, per, ccl::datatype::float32, comm).wait(); };
    }
    if (op == "all_reduce") {
      return [s, n, &comm] { ccl::allreduce(s, s, n, ccl::datatype::float32, ccl::reduction::sum, comm).wait(); };
    }
    if (op == "all_reduce_bf16") {
      uint16_t* h = send16_.data();
      return [h, n, &comm] { ccl::allreduce(h, h, n, ccl::datatype::bfloat16, ccl::reduction::sum, comm).wait(); };
    }
    if (op == "all_gather_into_tensor") {
      return [s, r, n, &comm] { ccl::allgather(s, r, n, ccl::datatype::float32, comm).wait(); };
    }
    if (op == "reduce_scatter_tensor") {
      const size_t per = n / size_t(world_);
      return [s, r, per, &comm] {
        ccl::reduce_scatter(s, r, per, ccl::datatype::float32, ccl::reduction::sum, comm).wait();
      };
    }
    throw std::runtime_error("oneccl_worker: unknown op " + op);
  }

  // Once per cell, after timing, with the values bench_mpi.py checks.
  bool check(const Cell& c, const std::function<void()>& fn) {
    const int64_t n = n_, W = world_, R = rank_;
    auto& s = send_;
    auto& r = recv_;
    if (c.op == "roundtrip") {
      if (R == 0) s = {1234.5f, -6.25f};
      fn();
      return R != 0 || (s[0] == 1234.5f && s[1] == -6.25f);
    }
    if (c.op == "broadcast") {
      for (int64_t i = 0; i < n; ++i) s[i] = R == 0 ? float((i % 97) * 100 + 7) : -1.0f;
      fn();
      for (int64_t i = 0; i < n; ++i)
        if (s[i] != float((i % 97) * 100 + 7)) return false;
      return true;
    }
    if (c.op == "all_to_all_single") {
      const int64_t chunk = n / W;
      for (int64_t i = 0; i < n; ++i) s[i] = float((R * W + i / chunk + 1) + (i % chunk % 97) * 100);
      std::fill(r.begin(), r.end(), -1.0f);
      fn();
      for (int64_t i = 0; i < n; ++i)
        if (r[i] != float(((i / chunk) * W + R + 1) + (i % chunk % 97) * 100)) return false;
      return true;
    }
    if (c.op == "all_reduce") {
      for (int64_t i = 0; i < n; ++i) s[i] = float((i % 97) * 4 + R + 1);
      fn();
      for (int64_t i = 0; i < n; ++i)
        if (s[i] != float((i % 97) * 4 * W + W * (W + 1) / 2)) return false;
      return true;
    }
    if (c.op == "all_reduce_bf16") {  // small integers: exact in bf16 at these world sizes
      for (int64_t i = 0; i < n; ++i) send16_[i] = to_bf16(float(i % 7 + R + 1));
      fn();
      for (int64_t i = 0; i < n; ++i)
        if (from_bf16(send16_[i]) != float((i % 7) * W + W * (W + 1) / 2)) return false;
      return true;
    }
    if (c.op == "all_gather_into_tensor") {
      for (int64_t i = 0; i < n; ++i) s[i] = float((i % 97) * 4 + 1 + 1000 * R);
      std::fill(r.begin(), r.end(), -1.0f);
      fn();
      for (int64_t q = 0; q < W; ++q)
        for (int64_t i = 0; i < n; ++i)
          if (r[q * n + i] != float((i % 97) * 4 + 1 + 1000 * q)) return false;
      return true;
    }
    if (c.op == "reduce_scatter_tensor") {
      const int64_t chunk = n / W;
      for (int64_t i = 0; i < n; ++i) s[i] = float((i % chunk % 97) * 4 + R + 1000 * (i / chunk) + 1);
      std::fill(r.begin(), r.end(), -1.0f);
      fn();
      for (int64_t k = 0; k < chunk; ++k)
        if (r[k] != float(W * ((k % 97) * 4 + 1000 * R + 1) + W * (W - 1) / 2)) return false;
      return true;
    }
    return false;
  }

  int rank_, world_;
  ccl::communicator& comm_;
  int64_t n_ = 0;
  std::vector<float> send_, recv_;
  std::vector<uint16_t> send16_;
};

ccl::shared_ptr_class<ccl::kvs> rendezvous(int rank, const std::string& path) {
  ccl::kvs::address_type addr;
  if (rank == 0) {
    auto kvs = ccl::create_main_kvs();
    addr = kvs->get_address();
    const std::string tmp = path + ".tmp";
    std::ofstream(tmp, std::ios::binary).write(addr.data(), std::streamsize(addr.size()));
    std::rename(tmp.c_str(), path.c_str());
    return kvs;
  }
  const auto until = Clock::now() + std::chrono::seconds(60);
  while (access(path.c_str(), F_OK) != 0) {
    if (Clock::now() > until) throw std::runtime_error("oneccl_worker: no key-value store address in " + path);
    usleep(1000);
  }
  std::ifstream(path, std::ios::binary).read(addr.data(), std::streamsize(addr.size()));
  return ccl::create_kvs(addr);
}

// Every cell in order; rank 0 writes the rows.
int run(int rank, int world, const std::string& kvs_file, const Plan& plan, const std::vector<Cell>& cells,
        const std::string& out_json) {
  ccl::init();
  auto kvs = rendezvous(rank, kvs_file);
  auto comm = ccl::create_communicator(world, rank, kvs);
  Runner runner(rank, world, comm);
  std::vector<std::string> rows;
  for (const auto& c : cells) {
    rows.push_back(runner.run(c, plan));
    if (rank == 0) {  // rewritten after every cell: a run past its deadline keeps what it measured
      std::ofstream out(out_json);
      out << "{\"rows\": [";
      for (size_t i = 0; i < rows.size(); ++i) out << (i ? ",\n" : "\n") << rows[i];
      out << "], \"complete\": " << (rows.size() == cells.size() ? "true" : "false") << "}\n";
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 7) {
    std::fprintf(stderr, "usage: %s RANK WORLD KVS_FILE PLAN CELLS OUT_JSON\n", argv[0]);
    return 2;
  }
  const int rank = std::atoi(argv[1]), world = std::atoi(argv[2]);
  const auto p = split(argv[4], ',');
  if (p.size() != 6) {
    std::fprintf(stderr, "oneccl_worker: PLAN needs 6 fields, got %zu\n", p.size());
    return 2;
  }
  const Plan plan{std::stod(p[0]), std::stod(p[1]), std::stod(p[5]), std::stoll(p[2]), std::stoll(p[3]),
                  std::stoll(p[4])};
  std::vector<Cell> cells;
  for (const auto& c : split(argv[5], ',')) {
    const auto f = split(c, ':');
    if (f.size() != 3) {
      std::fprintf(stderr, "oneccl_worker: bad cell '%s' (op:bytes:warmup)\n", c.c_str());
      return 2;
    }
    cells.push_back({f[0], std::stoll(f[1]), std::stoll(f[2])});
  }
  try {
    return run(rank, world, argv[3], plan, cells, argv[6]);
  } catch (const std::exception& e) {  // one line the launcher reports, not a backtrace
    std::fprintf(stderr, "oneccl_worker rank %d: %s\n", rank, e.what());
    return 1;
  }
}
