#include "cam_backend.hpp"

#include <ATen/MemoryOverlap.h>
#include <sched.h>

#include <set>

#include "../algo/collective.hpp"
#include "../algo/p2p.hpp"
#include "../transport/shm_heap.hpp"

namespace cam {

CamBackend::CamBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       CamConfig cfg, std::string group_id, const std::string& group_desc)
    : c10d::Backend(rank, size), group_id_(std::move(group_id)) {
  cfg.validate(size);
  // More ranks than usable CPUs: a rank that pause-spins may be holding the very core the
  // peer it waits for needs, so go straight to yielding.
  cpu_set_t cpus;
  const int ncpus = sched_getaffinity(0, sizeof(cpus), &cpus) == 0 ? CPU_COUNT(&cpus) : 0;
  if (ncpus > 0 && size > ncpus) cfg.spin_us = 0;
  WindowLayout layout(size);
  OpWindows windows = OpWindows::reserve(layout, cfg);
  layout.seal(cfg.tensor_heap_bytes);
  windows.bind(layout);
  auto heap = std::make_unique<ShmHeap>(store, rank, size, layout, cfg.timeout, group_desc);
  const int64_t moe_cache = cfg.moe_output_cache_bytes;
  engine_ = std::make_shared<Engine>(std::move(heap), windows, std::move(cfg),
                                     FlightRecorder::Group{group_id_, group_desc, rank, size});
  issuer_ = std::make_shared<OpIssuer>(engine_, rank);
  moe_ = std::make_unique<MoeGroup>(issuer_, rank, size, moe_cache);
  if (engine_->config().log_level >= LogLevel::kInfo) log_init(ncpus);
}

void CamBackend::log_init(int ncpus) const {
  const CamConfig& c = engine_->config();
  const WindowLayout& L = engine_->heap().layout();
  log_line(LogLevel::kInfo, engine_->who(),
           str("rank ", rank_, " of ", size_, "; transport: shared memory to all ", size_ - 1,
               " peers (one host), windows mapped; direct read (process_vm_readv) ",
               direct_read_available() ? "available" : "unavailable",
               c.single_copy_bytes > 0 ? str(", used from ", c.single_copy_bytes, " B") : std::string(", off"),
               "; process heaps ", process_heap_problem().empty() ? std::string("mapped (heap allocator tensors read in place)")
                                                                 : "not mapped: " + process_heap_problem()));
  log_line(LogLevel::kInfo, engine_->who(),
           str("window ", L.total_bytes(), " B per rank (", window_bytes_mapped(), " B mapped): p2p outbox ",
               c.p2p_ring_bytes(size_), " B per peer, collective region ", c.coll_region_bytes(size_),
               " B; tensor heap ", c.tensor_heap_bytes, " B of address space; MoE output cache ",
               c.moe_output_cache_bytes, " B"));
  log_line(LogLevel::kInfo, engine_->who(),
           str("thresholds: chunk_bytes ", c.chunk_bytes, ", eager_max_bytes ", c.eager_max_bytes,
               ", one_shot_max_bytes ", c.one_shot_max_bytes, ", allreduce_algo ", allreduce_algo_name(c.allreduce_algo)));
  log_line(LogLevel::kInfo, engine_->who(),
           str("wait policy: spin ", c.spin_us, " us", c.spin_us == 0 && ncpus > 0 && size_ > ncpus
                                                          ? str(" (", size_, " ranks > ", ncpus, " usable CPUs)")
                                                          : std::string(),
               ", yield until ", c.yield_us, " us, sleeps up to ", c.sleep_max_us, " us; liveness every ",
               c.liveness_interval_ms, " ms; progress thread polls every ", c.progress_interval_us,
               " us (up to ", PollSchedule::kMaxStretch, "x while every op is waited); usable CPUs ", ncpus, "; timeout ", c.timeout.count(), " ms"));
  log_line(LogLevel::kInfo, engine_->who(),
           str("flight recorder: ", c.flight_recorder_entries, " entries",
               c.flight_recorder_path.empty() ? std::string(", no automatic dump")
                                              : ", dumped on failure to " + c.flight_recorder_path + "<rank>.json"));
}

CamBackend::~CamBackend() { engine_->shutdown(); }

void CamBackend::shutdown() { engine_->shutdown(); }

uint64_t CamBackend::getSequenceNumberForGroup() { return issuer_->sequence_number(); }

void CamBackend::startCoalescing() { issuer_->start_coalescing(); }

c10::intrusive_ptr<c10d::Work> CamBackend::endCoalescing() { return issuer_->end_coalescing(); }

int64_t CamBackend::window_bytes_mapped() const {
  return int64_t(engine_->heap().layout().total_bytes()) * size_;
}

std::map<std::string, int64_t> CamBackend::stats() const {
  const Stats& s = engine_->stats();
  return {{"heap_bytes", window_bytes_mapped()},
          {"window_bytes", int64_t(engine_->heap().layout().total_bytes())},
          {"staged_bytes", int64_t(s.staged_bytes.load())},
          {"direct_read_bytes", int64_t(s.direct_read_bytes.load())},
          {"heap_read_bytes", int64_t(s.heap_read_bytes.load())},
          {"tensor_heap_bytes", engine_->heap().arena()->capacity()},
          {"tensor_heap_in_use", engine_->heap().arena()->bytes_in_use()},
          {"moe_stage_bytes", moe_->stage_bytes()},
          {"moe_output_cache_bytes", moe_->output_cache_bytes()}};
}

at::Tensor CamBackend::empty(at::IntArrayRef sizes, at::ScalarType dtype) {
  return engine_->heap().arena()->empty(sizes, dtype);
}

at::Tensor CamBackend::peer_arena_view(int r, int64_t offset, int64_t nbytes) {
  TORCH_CHECK(r >= 0 && r < size_, "cam peer_arena_view on rank ", rank_, ": rank ", r,
              " is outside the group of ", size_);
  const int64_t cap = engine_->config().tensor_heap_bytes;
  TORCH_CHECK(offset >= 0 && nbytes >= 0 && offset + nbytes <= cap, "cam peer_arena_view on rank ", rank_,
              ": bytes [", offset, ", ", offset + nbytes, ") of rank ", r, "'s tensor heap are outside its ",
              cap, " bytes");
  char* p = engine_->heap().layout().arena(engine_->heap().base(r)) + offset;
  auto keep = engine_;  // the peer's mapping lives as long as the engine's heap
  return at::from_blob(p, {nbytes}, [keep](void*) {}, at::TensorOptions().dtype(at::kByte));
}

std::string CamBackend::wait_signal(int peer, const at::Tensor& counters, int64_t index, int64_t target,
                                    double timeout_s) const {
  TORCH_CHECK(peer >= 0 && peer < size_, "cam wait_signal on rank ", rank_, ": rank ", peer,
              " is outside the group of ", size_);
  TORCH_CHECK(counters.scalar_type() == at::kLong && counters.is_contiguous() && index >= 0 &&
                  index < counters.numel(),
              "cam wait_signal: expected a contiguous int64 tensor and an index inside it");
  const auto& counter = reinterpret_cast<const uint64_t*>(counters.data_ptr<int64_t>())[index];
  const CamConfig& cfg = engine_->config();
  Backoff backoff(cfg.spin_us, cfg.yield_us, cfg.sleep_max_us, [&](int64_t us) {
    engine_->heap().park(us, [&] { return Idleness{int64_t(signal_acquire(counter)) < target, peer_bit(peer)}; });
  });
  return wait_for_signal(counter, target, timeout_s, backoff, cfg.liveness_interval_ms,
                         [&] { return peer == rank_ ? std::string() : engine_->peer_problem(peer); });
}

at::Tensor CamBackend::allocateTensor(long size, at::TensorOptions options) {
  TORCH_CHECK(!options.has_device() || options.device().is_cpu(), "cam allocateTensor on rank ",
              rank_, ": the tensor heap holds CPU tensors, got device ", options.device());
  return empty({int64_t(size)}, c10::typeMetaToScalarType(options.dtype()));
}

void CamBackend::check_tensor(const at::Tensor& t, const char* what) const {
  CAM_CHECK_ARG(t.defined(), "the ", what, " is undefined");
  CAM_CHECK_ARG(t.device().is_cpu(), "expected a CPU ", what,
              ", got one on ", t.device(),
              " (this build of cam moves CPU tensors through host shared memory)");
  CAM_CHECK_ARG(t.layout() == at::kStrided, "expected a dense ",
              what, ", got layout ", t.layout());
}

const at::Tensor& CamBackend::single_tensor(std::vector<at::Tensor>& tensors) const {
  CAM_CHECK_ARG(tensors.size() == 1, "expected exactly one tensor, got ", tensors.size());
  check_tensor(tensors[0]);
  return tensors[0];
}

void check_writable(const at::Tensor& t, const char* what) {
  CAM_CHECK_ARG(at::has_internal_overlap(t) != at::MemOverlap::Yes, "the ", what,
                " is written but has elements that share memory (an expanded or overlapping view, strides ",
                t.strides(), ")");
}

void CamBackend::check_peer(int peer, const char* role) const {
  CAM_CHECK_ARG(peer >= 0 && peer < size_, role, " rank ",
              peer, " is out of range for a group of ", size_, " ranks (expected 0..", size_ - 1, ")");
}

c10::intrusive_ptr<c10d::Work> CamBackend::barrier(const c10d::BarrierOptions& opts) {
  auto dl = issuer_->deadline(opts.timeout);
  return issuer_->issue_collective([&](uint64_t seq) { return std::make_shared<BarrierOp>(seq, dl); },
                                   c10d::OpType::BARRIER, "cam:barrier", {});
}

c10::intrusive_ptr<c10d::Work> CamBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                     const c10d::BroadcastOptions& opts) {
  return issuer_->collective("broadcast", CollKind::kBroadcast, [&] {
    const at::Tensor& t = single_tensor(tensors);
    check_writable(t, "tensor");
    check_peer(int(opts.rootRank), "root");
    CAM_CHECK_ARG(opts.rootTensor == 0, "expected rootTensor 0 (one tensor per rank), got ", opts.rootTensor);
    auto dl = issuer_->deadline(opts.timeout);
    const int root = int(opts.rootRank);
    return issuer_->issue_collective(
        [&](uint64_t seq) { return std::make_shared<BroadcastOp>(seq, dl, root, root == rank_, t); },
        c10d::OpType::BROADCAST, "cam:broadcast", tensors);
  });
}

namespace {
// Rows of each peer's block along dim 0, from split sizes (empty: equal splits).
std::vector<int64_t> resolve_splits(int world, const at::Tensor& t, const std::vector<int64_t>& splits,
                                    const char* which) {
  const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
  if (splits.empty()) {
    CAM_CHECK_ARG(rows % world == 0, "the ", which, " tensor has ", rows,
                  " rows along dim 0, which does not split evenly over ", world, " ranks; pass ", which,
                  "_split_sizes");
    return std::vector<int64_t>(world, rows / world);
  }
  CAM_CHECK_ARG(int(splits.size()) == world, which, "_split_sizes has ", splits.size(),
                " entries, expected one per rank (", world, ")");
  int64_t sum = 0;
  for (int j = 0; j < world; ++j) {
    CAM_CHECK_ARG(splits[j] >= 0, which, "_split_sizes[", j, "] is negative (", splits[j], ")");
    CAM_CHECK_ARG(!__builtin_add_overflow(sum, splits[j], &sum), which,
                  "_split_sizes overflow int64 when added up (entry ", j, " is ", splits[j], ")");
  }
  CAM_CHECK_ARG(sum == rows, which, "_split_sizes add up to ", sum, " but the ", which, " tensor has ", rows,
                " rows along dim 0");
  return splits;
}

// Bytes of one row along dim 0 (a 0-d tensor is one row).
int64_t row_bytes(const at::Tensor& t) {
  const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
  return rows == 0 ? 0 : int64_t(t.nbytes()) / rows;
}
}  // namespace

c10::intrusive_ptr<c10d::Work> CamBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                         std::vector<int64_t>& output_splits,
                                                         std::vector<int64_t>& input_splits,
                                                         const c10d::AllToAllOptions& opts) {
  const char* op = "all_to_all_single";
  return issuer_->collective(op, CollKind::kAllToAll, [&] {
    check_tensor(input, "input tensor");
    check_tensor(output, "output tensor");
    check_writable(output, "output tensor");
    CAM_CHECK_ARG(input.scalar_type() == output.scalar_type(), "input is ", input.scalar_type(),
                  " but output is ", output.scalar_type());
    auto in_rows = resolve_splits(size_, input, input_splits, "input");
    auto out_rows = resolve_splits(size_, output, output_splits, "output");
    // Rows of input and output may differ in width: what must agree is the bytes of each
    // (sender, receiver) block, which every rank checks against its peers' descriptors.
    const int64_t in_row_bytes = row_bytes(input);
    const int64_t out_row_bytes = row_bytes(output);
    at::Tensor in = input.contiguous();
    at::Tensor out = output.is_contiguous() ? output : at::empty_like(output, at::MemoryFormat::Contiguous);
    std::vector<std::pair<at::Tensor, at::Tensor>> copy_back;
    if (!out.is_same(output)) copy_back.emplace_back(output, out);
    std::vector<AllToAllBlock> send(size_), recv(size_);
    char* in_ptr = static_cast<char*>(in.data_ptr());
    char* out_ptr = static_cast<char*>(out.data_ptr());
    int64_t in_off = 0, out_off = 0;
    for (int j = 0; j < size_; ++j) {
      send[j] = {in_ptr + in_off, in_rows[j] * in_row_bytes};
      recv[j] = {out_ptr + out_off, out_rows[j] * out_row_bytes};
      in_off += send[j].nbytes;
      out_off += recv[j].nbytes;
    }
    auto dl = issuer_->deadline(opts.timeout);
    const int dtype = int(input.scalar_type());
    return issuer_->issue_collective(
        [&](uint64_t seq) {
          return std::make_shared<AllToAllOp>(op, CollKind::kAllToAll, seq, dl, dtype, std::move(send),
                                              std::move(recv), std::vector<at::Tensor>{in, out},
                                              std::move(copy_back), std::vector<at::Tensor>{output});
        },
        c10d::OpType::ALLTOALL_BASE, "cam:all_to_all_single", {input});
  });
}

c10::intrusive_ptr<c10d::Work> CamBackend::alltoall(std::vector<at::Tensor>& outputs,
                                                    std::vector<at::Tensor>& inputs,
                                                    const c10d::AllToAllOptions& opts) {
  const char* op = "all_to_all";
  return issuer_->collective(op, CollKind::kAllToAll, [&] {
    CAM_CHECK_ARG(int(inputs.size()) == size_ && int(outputs.size()) == size_, "expected ", size_, " input and ",
                  size_, " output tensors, got ", inputs.size(), " and ", outputs.size());
    check_tensor(inputs[0], "input tensor");
    const auto dtype = inputs[0].scalar_type();
    std::vector<AllToAllBlock> send(size_), recv(size_);
    std::vector<at::Tensor> keep;
    std::vector<std::pair<at::Tensor, at::Tensor>> copy_back;
    for (int j = 0; j < size_; ++j) {
      check_tensor(inputs[j], "input tensor");
      check_tensor(outputs[j], "output tensor");
      check_writable(outputs[j], "output tensor");
      CAM_CHECK_ARG(inputs[j].scalar_type() == dtype && outputs[j].scalar_type() == dtype, "every tensor must be ",
                    dtype, "; input ", j, " is ", inputs[j].scalar_type(), " and output ", j, " is ",
                    outputs[j].scalar_type());
    }
    for (int j = 0; j < size_; ++j) {
      at::Tensor in = inputs[j].contiguous();
      at::Tensor out = outputs[j].is_contiguous() ? outputs[j]
                                                  : at::empty_like(outputs[j], at::MemoryFormat::Contiguous);
      if (!out.is_same(outputs[j])) copy_back.emplace_back(outputs[j], out);
      send[j] = {static_cast<char*>(in.data_ptr()), int64_t(in.nbytes())};
      recv[j] = {static_cast<char*>(out.data_ptr()), int64_t(out.nbytes())};
      keep.push_back(in);
      keep.push_back(out);
    }
    auto dl = issuer_->deadline(opts.timeout);
    return issuer_->issue_collective(
        [&](uint64_t seq) {
          return std::make_shared<AllToAllOp>(op, CollKind::kAllToAll, seq, dl, int(dtype), std::move(send),
                                              std::move(recv), std::move(keep), std::move(copy_back), outputs);
        },
        c10d::OpType::ALLTOALL, "cam:all_to_all", inputs);
  });
}

// p2p: a send or recv whose own checks refuse it still goes to its partner when the partner is
// known (a rank of the group other than this one): a refused send carries the reason in place
// of the payload and fails the recv it matches; a refused recv matches the next message as
// usual and fails its send through the acknowledgement. Either way the call raises here.
template <typename Build>
c10::intrusive_ptr<c10d::Work> CamBackend::p2p(bool is_send, int peer, int tag, Build build) {
  std::string reason;
  try {
    return build();
  } catch (...) {
    reason = argument_error_reason();
  }
  const std::string msg = str("cam ", is_send ? "send" : "recv", " on rank ", rank_, ": ", reason);
  if (is_send) {
    issuer_->issue(std::make_shared<SendOp>(issuer_->deadline(c10d::kUnsetTimeout), peer, tag, msg),
                   c10d::OpType::SEND, "cam:send", {});
  } else {
    issuer_->issue(
        std::make_shared<RecvOp>(next_recv_seq(), issuer_->deadline(c10d::kUnsetTimeout), peer, tag, msg),
        c10d::OpType::RECV, "cam:recv", {});
  }
  throw ValidationError(msg);
}

uint64_t CamBackend::next_recv_seq() { return recv_seq_.fetch_add(1) + 1; }

c10::intrusive_ptr<c10d::Work> CamBackend::send(std::vector<at::Tensor>& tensors, int dst, int tag) {
  check_p2p_peer("send", dst, "destination");
  return p2p(true, dst, tag, [&] {
    const at::Tensor& t = single_tensor(tensors);
    return issuer_->issue(std::make_shared<SendOp>(issuer_->deadline(c10d::kUnsetTimeout), dst, tag, t),
                          c10d::OpType::SEND, "cam:send", tensors);
  });
}

c10::intrusive_ptr<c10d::Work> CamBackend::recv(std::vector<at::Tensor>& tensors, int src, int tag) {
  check_p2p_peer("recv", src, "source");
  return p2p(false, src, tag, [&] {
    const at::Tensor& t = single_tensor(tensors);
    check_writable(t, "tensor");
    return issuer_->issue(
        std::make_shared<RecvOp>(next_recv_seq(), issuer_->deadline(c10d::kUnsetTimeout), src, tag, t),
        c10d::OpType::RECV, "cam:recv", tensors);
  });
}

c10::intrusive_ptr<c10d::Work> CamBackend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  return p2p(false, -1, tag, [&] {
    const at::Tensor& t = single_tensor(tensors);
    check_writable(t, "tensor");
    return issuer_->issue(
        std::make_shared<RecvOp>(next_recv_seq(), issuer_->deadline(c10d::kUnsetTimeout), -1, tag, t),
        c10d::OpType::RECVANYSOURCE, "cam:recvAnySource", tensors);
  });
}

void CamBackend::check_p2p_peer(const char* op, int peer, const char* role) const {
  // Checked before anything else, and raised here only: the partner is unknown.
  if (peer < 0 || peer >= size_) {
    throw ValidationError(str("cam ", op, " on rank ", rank_, ": ", role, " rank ", peer,
                              " is out of range for a group of ", size_, " ranks (expected 0..", size_ - 1, ")"));
  }
  if (peer == rank_) {
    throw ValidationError(str("cam ", op, " on rank ", rank_, ": a rank cannot ",
                              std::string(op) == "send" ? "send to" : "receive from", " itself"));
  }
}

}  // namespace cam
