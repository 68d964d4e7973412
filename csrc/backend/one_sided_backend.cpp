#include "one_sided_backend.hpp"

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Utils.hpp>

#include <cstring>

#include "../../kernels/reduce.hpp"
#include "../core/errors.hpp"
#include "../runtime/done_work.hpp"
#include "cam_backend.hpp"

namespace cam {
namespace {

// The descriptor every rank posts each partner of an exchange, followed by the block it sends
// (inline) and then the packed key of the memory the partner's block goes to (put).
struct Descriptor {
  uint64_t seq;
  uint64_t send_bytes;  // what this rank sends the partner (kAbsent: nothing)
  uint64_t recv_bytes;  // what this rank expects from the partner (kAbsent: nothing)
  uint64_t recv_addr;   // where the partner puts it, when it exceeds kEagerBytes
  uint32_t inline_data; // 1: the sent block's bytes follow
  uint32_t key_bytes;   // the packed key's length (after the inline bytes)
  uint32_t partners;    // how many partners this rank has in the exchange
  uint32_t uniform;     // 1: every rank is this rank's partner, with blocks of one size both ways
  uint32_t kind;        // what the blocks hold (block_kind; 0: not compared)
  uint32_t reserved;
};
constexpr uint64_t kAbsent = ~uint64_t(0);
static_assert(sizeof(Descriptor) + OneSidedBackend::kEagerBytes + 1024 <= OneSidedTransport::kSlotBytes,
              "a slot holds an inline block and a packed key of up to 1 KiB");

std::string bytes_text(uint64_t bytes) { return bytes == kAbsent ? std::string("nothing") : str(bytes, " bytes"); }

// What an op's blocks hold: their dtype and, for a reduction, its operator. Partners compare it
// as they compare sizes, so ranks whose tensors hold the same bytes as another dtype (or reduce
// with another operator) fail instead of reading each other's bytes as their own.
uint32_t block_kind(c10::ScalarType dtype, int red = -1) { return 1 + uint32_t(dtype) + (uint32_t(red + 1) << 8); }

std::string kind_text(uint32_t kind) {
  if (kind == 0) return "blocks of no stated kind";
  const auto dtype = c10::ScalarType((kind - 1) & 0xff);
  const int red = int(kind >> 8) - 1;
  std::string out = str(c10::toString(dtype), " tensors");
  if (red >= 0) out += str(" reduced with ", kernels::red_op_name(kernels::RedOp(red)));
  return out;
}

void check_dense(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.is_contiguous() && t.device().is_cpu(), what, ": the inter-host engine takes contiguous CPU tensors");
}

std::string ranks_where(const std::vector<bool>& which) {
  std::string out;
  for (size_t p = 0; p < which.size(); ++p)
    if (which[p]) out += str(out.empty() ? "" : ", ", p);
  return out;
}

std::vector<int64_t> row_offsets(const std::vector<int64_t>& splits, int64_t rows, int size, std::vector<int64_t>& out) {
  out = splits;
  if (out.empty()) out.assign(size, rows / size);
  std::vector<int64_t> off(size + 1, 0);
  for (int p = 0; p < size; ++p) off[p + 1] = off[p] + out[p];
  return off;
}

}  // namespace

OneSidedBackend::OneSidedBackend(std::unique_ptr<OneSidedTransport> transport)
    : c10d::Backend(transport->rank(), transport->size()),
      t_(std::move(transport)),
      consumed_(size_, 0),
      dones_due_(size_, 0) {}

int OneSidedBackend::root_of(int64_t root, const char* op) const {
  TORCH_CHECK(root >= 0 && root < size_, op_name(op), ": root ", root, " is not a rank of the group (size ", size_, ")");
  return int(root);
}

std::string OneSidedBackend::op_name(const char* op) const { return str("cam ", t_->name(), " ", op, " (seq ", seq_, ")"); }

void OneSidedBackend::exchange(const std::string& what, const std::vector<Block>& sends, const std::vector<Block>& recvs,
                               uint32_t kind) {
  const int me = rank_;
  const uint64_t seq = seq_;
  const auto eager = [](const Block& b) { return b.bytes <= kEagerBytes; };
  std::vector<bool> partner(size_, false);
  std::vector<std::unique_ptr<MemoryRegion>> regions(size_);
  std::vector<uint8_t> desc;
  int partners = 0;
  bool uniform = true;  // every other rank a partner, every block (either way) of one size
  const size_t some_block = size_ > 1 ? sends[me == 0 ? 1 : 0].bytes : 0;
  for (int p = 0; p < size_; ++p) {
    partner[p] = p != me && (sends[p].present || recvs[p].present);
    partners += partner[p];
    if (p != me)
      uniform = uniform && sends[p].present && recvs[p].present && sends[p].bytes == some_block &&
                recvs[p].bytes == some_block;
  }
  for (int p = 0; p < size_; ++p) {
    if (!partner[p]) continue;
    const bool inline_data = sends[p].present && eager(sends[p]);
    const bool put_here = recvs[p].present && !eager(recvs[p]);
    if (put_here) regions[p] = t_->register_memory(recvs[p].ptr, recvs[p].bytes);
    const size_t data = inline_data ? sends[p].bytes : 0;
    const size_t key = put_here ? regions[p]->packed_key().size() : 0;
    desc.assign(sizeof(Descriptor) + data + key, 0);
    const Descriptor d{seq,
                       sends[p].present ? sends[p].bytes : kAbsent,
                       recvs[p].present ? recvs[p].bytes : kAbsent,
                       put_here ? uint64_t(recvs[p].ptr) : 0,
                       inline_data,
                       uint32_t(key),
                       uint32_t(partners),
                       uniform,
                       kind,
                       0};
    std::memcpy(desc.data(), &d, sizeof d);
    if (data) std::memcpy(desc.data() + sizeof d, sends[p].ptr, data);
    if (key) std::memcpy(desc.data() + sizeof d + data, regions[p]->packed_key().data(), key);
    t_->post(p, std::move(desc));
  }
  // As each partner's descriptor arrives: check it against this rank's view (both sides check,
  // so both name a mismatch), take an inline block and put this rank's block into the partner's
  // memory. Once every descriptor has passed, done goes to each partner (ordered after the
  // puts): a mismatch anywhere leaves every partner of this rank waiting, to fail with it.
  // Done is skipped where no block is put and every mismatch is seen by every rank anyway: two
  // ranks that are each other's only partner (every step between two hosts), or an exchange in
  // which every rank is uniform (everyone's partner, one block size): a rank whose checks all
  // passed has then seen that every rank's blocks have its size and its seq, so no pair can
  // disagree. Either way an exchange of small blocks is one message each way.
  std::vector<uint32_t> peer_partners(size_, 0);
  bool all_uniform = uniform;
  std::vector<std::unique_ptr<RemoteKey>> keys;
  std::vector<bool> waiting = partner;
  int left = partners;
  t_->wait_until(
      [&] {
        for (int p = 0; p < size_ && left > 0; ++p) {
          if (!waiting[p] || t_->posted(p) == consumed_[p]) continue;
          waiting[p] = false;
          --left;
          const uint8_t* slot = t_->slot(p, consumed_[p]++);
          Descriptor d;
          std::memcpy(&d, slot, sizeof d);
          const uint8_t* tail = slot + sizeof d;
          // What the slot says it holds must fit the slot: a descriptor of another build or a
          // torn write raises here instead of reading past it.
          const uint64_t inline_bytes = d.inline_data ? d.send_bytes : 0;
          if ((d.inline_data && d.send_bytes > kEagerBytes) ||
              sizeof d + inline_bytes + d.key_bytes > OneSidedTransport::kSlotBytes)
            t_->raise(what, str("rank ", p, "'s descriptor does not fit its slot (", inline_bytes, " inline bytes, a ",
                               d.key_bytes, "-byte key, slot of ", OneSidedTransport::kSlotBytes, ")"));
          if (d.seq != seq)
            t_->raise(what, str("rank ", p, " is in inter-host op seq ", d.seq, ", this rank in seq ", seq,
                               " (the ranks issued different collectives)"));
          const uint64_t expect = recvs[p].present ? recvs[p].bytes : kAbsent;
          const uint64_t mine = sends[p].present ? sends[p].bytes : kAbsent;
          if (d.kind != kind)
            t_->raise(what, str("rank ", p, " passes ", kind_text(d.kind), ", this rank ", kind_text(kind)));
          if (d.send_bytes != expect)
            t_->raise(what, str("rank ", p, " sends ", bytes_text(d.send_bytes), ", this rank expects ",
                               bytes_text(expect)));
          if (d.recv_bytes != mine)
            t_->raise(what, str("rank ", p, " expects ", bytes_text(d.recv_bytes), ", this rank sends ",
                               bytes_text(mine)));
          if (inline_bytes) std::memcpy(recvs[p].ptr, tail, inline_bytes);
          peer_partners[p] = d.partners;
          all_uniform = all_uniform && d.uniform;
          if (sends[p].present && !eager(sends[p])) {
            if (d.key_bytes == 0)
              t_->raise(what, str("rank ", p, " expects ", d.recv_bytes, " bytes but sent no key to put them with"));
            keys.push_back(t_->unpack_key(p, tail + inline_bytes));
            t_->put(p, sends[p].ptr, sends[p].bytes, d.recv_addr, *keys.back());
          }
        }
        return left == 0;
      },
      what, [&] { return "the descriptors of ranks " + ranks_where(waiting); });
  for (int p = 0; p < size_; ++p) {
    if (!partner[p]) continue;
    const bool checked_by_both = all_uniform || (partners == 1 && peer_partners[p] == 1);
    if (!checked_by_both || (sends[p].present && !eager(sends[p]))) t_->signal_done(p);
    if (!checked_by_both || (recvs[p].present && !eager(recvs[p]))) ++dones_due_[p];
  }
  // Every partner's done: its block has landed here, and it has checked this rank's descriptor.
  t_->wait_until(
      [&] {
        for (int p = 0; p < size_; ++p)
          if (partner[p] && t_->done(p) < dones_due_[p]) return false;
        return true;
      },
      what, [&] {
        std::vector<bool> missing(size_, false);
        for (int p = 0; p < size_; ++p) missing[p] = partner[p] && t_->done(p) < dones_due_[p];
        return "ranks " + ranks_where(missing) + " to be done (their blocks put here, this rank's descriptor checked)";
      });
  t_->complete(what);
}

namespace {
kernels::RedOp checked_red_op(const std::string& what, const c10d::ReduceOp& op, c10::ScalarType dtype) {
  const kernels::RedOp red = red_op_of(op);
  const char* why = kernels::reduce_unsupported(dtype, red);
  TORCH_CHECK(*why == 0, what, ": cannot reduce ", dtype, " with ", kernels::red_op_name(red), ": ", why);
  return red;
}
}  // namespace

void OneSidedBackend::reduce_blocks(const std::string& what, const at::Tensor& in, const std::vector<int64_t>& off,
                                    const c10d::ReduceOp& op, void* out) {
  const kernels::RedOp red = checked_red_op(what, op, in.scalar_type());
  const size_t es = in.element_size();
  char* base = static_cast<char*>(in.data_ptr());
  const int64_t mine = off[rank_ + 1] - off[rank_];
  at::Tensor parts = scratch_->empty({int64_t(size_), std::max<int64_t>(mine, 1)}, in.scalar_type());
  std::vector<Block> sends(size_), recvs(size_);
  std::vector<const void*> srcs(size_);
  for (int p = 0; p < size_; ++p) {
    sends[p] = Block{true, base + off[p] * es, size_t(off[p + 1] - off[p]) * es};
    recvs[p] = Block{true, parts[p].data_ptr(), size_t(mine) * es};
    srcs[p] = p == rank_ ? static_cast<const void*>(base + off[rank_] * es) : parts[p].data_ptr();
  }
  exchange(what, sends, recvs, block_kind(in.scalar_type(), int(red)));
  if (mine > 0) kernels::reduce(in.scalar_type(), red, out, srcs.data(), size_, mine, size_);
}

void OneSidedBackend::allreduce_one(const at::Tensor& t, const c10d::ReduceOp& op) {
  const std::string what = op_name("all_reduce");
  const kernels::RedOp red = checked_red_op(what, op, t.scalar_type());
  const int64_t n = t.numel();
  const size_t es = t.element_size();
  char* base = static_cast<char*>(t.data_ptr());
  std::vector<Block> sends(size_), recvs(size_);
  if (int64_t(t.nbytes()) <= kOneShotMaxBytes || n < size_) {
    // Every rank reads every input and reduces them in rank order.
    at::Tensor all = scratch_->empty({int64_t(size_), n}, t.scalar_type());
    std::vector<const void*> srcs(size_);
    for (int p = 0; p < size_; ++p) {
      sends[p] = Block{true, base, t.nbytes()};
      recvs[p] = Block{true, all[p].data_ptr(), t.nbytes()};
      srcs[p] = p == rank_ ? static_cast<const void*>(base) : all[p].data_ptr();
    }
    exchange(what, sends, recvs, block_kind(t.scalar_type(), int(red)));
    kernels::reduce(t.scalar_type(), red, base, srcs.data(), size_, n, size_);
    return;
  }
  // Reduce-scatter: rank p reduces shard p in place; then every rank reads every reduced shard.
  const int64_t shard = (n + size_ - 1) / size_;
  std::vector<int64_t> off(size_ + 1);
  for (int p = 0; p <= size_; ++p) off[p] = std::min(n, int64_t(p) * shard);
  reduce_blocks(what + " reduce-scatter", t, off, op, base + off[rank_] * es);
  ++seq_;
  const size_t mine = size_t(off[rank_ + 1] - off[rank_]) * es;
  for (int p = 0; p < size_; ++p) {
    sends[p] = Block{true, base + off[rank_] * es, mine};
    recvs[p] = Block{true, base + off[p] * es, size_t(off[p + 1] - off[p]) * es};
  }
  exchange(what + " all-gather", sends, recvs, block_kind(t.scalar_type(), int(red)));
}

c10::intrusive_ptr<c10d::Work> OneSidedBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceOptions& opts) {
  for (const auto& t : tensors) {
    check_dense(t, "cam inter-host all_reduce");
    ++seq_;
    allreduce_one(t, opts.reduceOp);
  }
  return done_work(rank_, c10d::OpType::ALLREDUCE, tensors);
}

c10::intrusive_ptr<c10d::Work> OneSidedBackend::reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) {
  TORCH_CHECK(tensors.size() == 1, "cam inter-host reduce takes one tensor");
  const at::Tensor& t = tensors[0];
  check_dense(t, "cam inter-host reduce");
  ++seq_;
  const std::string what = op_name("reduce");
  const kernels::RedOp red = checked_red_op(what, opts.reduceOp, t.scalar_type());
  const int root = root_of(opts.rootRank, "reduce");
  std::vector<Block> sends(size_), recvs(size_);
  at::Tensor all;
  std::vector<const void*> srcs(size_);
  if (rank_ == root) {
    all = scratch_->empty({int64_t(size_), t.numel()}, t.scalar_type());
    for (int p = 0; p < size_; ++p) {
      recvs[p] = Block{true, all[p].data_ptr(), t.nbytes()};
      srcs[p] = p == rank_ ? t.data_ptr() : all[p].data_ptr();
    }
  } else {
    sends[root] = Block{true, t.data_ptr(), t.nbytes()};
  }
  exchange(what, sends, recvs, block_kind(t.scalar_type(), int(red)));
  if (rank_ == root) kernels::reduce(t.scalar_type(), red, t.data_ptr(), srcs.data(), size_, t.numel(), size_);
  return done_work(rank_, c10d::OpType::REDUCE, tensors);
}

c10::intrusive_ptr<c10d::Work> OneSidedBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                     const c10d::BroadcastOptions& opts) {
  const int root = root_of(opts.rootRank, "broadcast");
  for (const auto& t : tensors) {
    check_dense(t, "cam inter-host broadcast");
    ++seq_;
    std::vector<Block> sends(size_), recvs(size_);
    for (int p = 0; p < size_; ++p) {
      if (rank_ == root) sends[p] = Block{true, t.data_ptr(), t.nbytes()};
    }
    if (rank_ != root) recvs[root] = Block{true, t.data_ptr(), t.nbytes()};
    exchange(op_name("broadcast"), sends, recvs, block_kind(t.scalar_type()));
  }
  return done_work(rank_, c10d::OpType::BROADCAST, tensors);
}

c10::intrusive_ptr<c10d::Work> OneSidedBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                         std::vector<int64_t>& output_splits,
                                                         std::vector<int64_t>& input_splits,
                                                         const c10d::AllToAllOptions&) {
  check_dense(input, "cam inter-host all_to_all");
  check_dense(output, "cam inter-host all_to_all");
  ++seq_;
  const int64_t in_rows = input.dim() ? input.size(0) : 1;
  const int64_t out_rows = output.dim() ? output.size(0) : 1;
  const size_t in_row = in_rows ? input.nbytes() / in_rows : 0;
  const size_t out_row = out_rows ? output.nbytes() / out_rows : 0;
  // c10d's own check (count and sum of the splits), plus signs: a bad split would address
  // memory outside the tensors.
  c10d::checkSplitSizes(input_splits, input, size_);
  c10d::checkSplitSizes(output_splits, output, size_);
  for (const auto* splits : {&input_splits, &output_splits})
    for (int64_t v : *splits) TORCH_CHECK(v >= 0, op_name("all_to_all"), ": a split of ", v, " rows is negative");
  std::vector<int64_t> is, os;
  const auto in_off = row_offsets(input_splits, in_rows, size_, is);
  const auto out_off = row_offsets(output_splits, out_rows, size_, os);
  char* in = static_cast<char*>(input.data_ptr());
  char* out = static_cast<char*>(output.data_ptr());
  std::vector<Block> sends(size_), recvs(size_);
  for (int p = 0; p < size_; ++p) {
    sends[p] = Block{true, in + in_off[p] * in_row, size_t(is[p]) * in_row};
    recvs[p] = Block{true, out + out_off[p] * out_row, size_t(os[p]) * out_row};
  }
  const std::string what = op_name("all_to_all");
  TORCH_CHECK(sends[rank_].bytes == recvs[rank_].bytes, what, ": this rank sends itself ", sends[rank_].bytes,
              " bytes and expects ", recvs[rank_].bytes);
  exchange(what, sends, recvs, block_kind(input.scalar_type()));
  if (sends[rank_].bytes) std::memcpy(recvs[rank_].ptr, sends[rank_].ptr, sends[rank_].bytes);
  return done_work(rank_, c10d::OpType::ALLTOALL_BASE, {output});
}

c10::intrusive_ptr<c10d::Work> OneSidedBackend::alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                                    const c10d::AllToAllOptions& opts) {
  TORCH_CHECK(int(outputs.size()) == size_ && int(inputs.size()) == size_, "cam inter-host all_to_all takes ", size_,
              " tensors each way");
  std::vector<at::Tensor> flat_in;
  std::vector<int64_t> in_splits, out_splits;
  int64_t out_numel = 0;
  for (int p = 0; p < size_; ++p) {
    flat_in.push_back(inputs[p].reshape(-1));
    in_splits.push_back(inputs[p].numel());
    out_splits.push_back(outputs[p].numel());
    out_numel += outputs[p].numel();
  }
  at::Tensor in = at::cat(flat_in);
  at::Tensor out = scratch_->empty({out_numel}, outputs[0].scalar_type());
  alltoall_base(out, in, out_splits, in_splits, opts);
  int64_t off = 0;
  for (int p = 0; p < size_; ++p) {
    outputs[p].copy_(out.narrow(0, off, outputs[p].numel()).view_as(outputs[p]));
    off += outputs[p].numel();
  }
  return done_work(rank_, c10d::OpType::ALLTOALL, outputs);
}

c10::intrusive_ptr<c10d::Work> OneSidedBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                const c10d::AllgatherOptions&) {
  check_dense(input, "cam inter-host all_gather");
  check_dense(output, "cam inter-host all_gather");
  ++seq_;
  const std::string what = op_name("all_gather");
  TORCH_CHECK(output.nbytes() == size_t(size_) * input.nbytes() && output.scalar_type() == input.scalar_type(), what,
              ": the output holds ", output.numel(), " elements of ", output.scalar_type(), ", expected ",
              int64_t(size_) * input.numel(), " (", size_, " x ", input.numel(), ") of ", input.scalar_type());
  char* out = static_cast<char*>(output.data_ptr());
  std::vector<Block> sends(size_, Block{true, input.data_ptr(), input.nbytes()}), recvs(size_);
  for (int p = 0; p < size_; ++p) recvs[p] = Block{true, out + size_t(p) * input.nbytes(), input.nbytes()};
  exchange(what, sends, recvs, block_kind(input.scalar_type()));
  // An input that already is this rank's row of the output (an in-place all_gather) stays.
  if (input.nbytes() && recvs[rank_].ptr != input.data_ptr())
    std::memcpy(recvs[rank_].ptr, input.data_ptr(), input.nbytes());
  return done_work(rank_, c10d::OpType::_ALLGATHER_BASE, {output});
}

c10::intrusive_ptr<c10d::Work> OneSidedBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                     const c10d::ReduceScatterOptions& opts) {
  check_dense(input, "cam inter-host reduce_scatter");
  check_dense(output, "cam inter-host reduce_scatter");
  ++seq_;
  const std::string what = op_name("reduce_scatter");
  const int64_t n = output.numel();
  TORCH_CHECK(input.numel() == int64_t(size_) * n && output.scalar_type() == input.scalar_type(), what,
              ": the input holds ", input.numel(), " elements of ", input.scalar_type(), ", expected ",
              int64_t(size_) * n, " (", size_, " x ", n, ") of ", output.scalar_type());
  std::vector<int64_t> off(size_ + 1);
  for (int p = 0; p <= size_; ++p) off[p] = int64_t(p) * n;
  reduce_blocks(what, input, off, opts.reduceOp, output.data_ptr());
  return done_work(rank_, c10d::OpType::_REDUCE_SCATTER_BASE, {output});
}

c10::intrusive_ptr<c10d::Work> OneSidedBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                  std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) {
  TORCH_CHECK(inputs.size() == 1, "cam inter-host gather takes one input tensor");
  const at::Tensor in = inputs[0].contiguous();
  const int root = root_of(opts.rootRank, "gather");
  ++seq_;
  std::vector<Block> sends(size_), recvs(size_);
  std::vector<at::Tensor> dense(size_);
  if (rank_ == root) {
    TORCH_CHECK(outputs.size() == 1 && int(outputs[0].size()) == size_, "cam inter-host gather: the root takes ", size_,
                " output tensors");
    for (int p = 0; p < size_; ++p) {
      dense[p] = outputs[0][p].is_contiguous() ? outputs[0][p] : at::empty_like(outputs[0][p], at::MemoryFormat::Contiguous);
      recvs[p] = Block{true, dense[p].data_ptr(), dense[p].nbytes()};
    }
  } else {
    sends[root] = Block{true, in.data_ptr(), in.nbytes()};
  }
  exchange(op_name("gather"), sends, recvs, block_kind(in.scalar_type()));
  if (rank_ == root) {
    dense[rank_].copy_(in.view_as(dense[rank_]));
    for (int p = 0; p < size_; ++p)
      if (!dense[p].is_same(outputs[0][p])) outputs[0][p].copy_(dense[p]);
  }
  return done_work(rank_, c10d::OpType::GATHER, rank_ == root ? outputs[0] : std::vector<at::Tensor>{});
}

c10::intrusive_ptr<c10d::Work> OneSidedBackend::scatter(std::vector<at::Tensor>& outputs,
                                                   std::vector<std::vector<at::Tensor>>& inputs,
                                                   const c10d::ScatterOptions& opts) {
  TORCH_CHECK(outputs.size() == 1, "cam inter-host scatter takes one output tensor");
  at::Tensor out = outputs[0].is_contiguous() ? outputs[0] : at::empty_like(outputs[0], at::MemoryFormat::Contiguous);
  const int root = root_of(opts.rootRank, "scatter");
  ++seq_;
  std::vector<Block> sends(size_), recvs(size_);
  at::Tensor flat;
  if (rank_ == root) {
    TORCH_CHECK(inputs.size() == 1 && int(inputs[0].size()) == size_, "cam inter-host scatter: the root takes ", size_,
                " input tensors");
    std::vector<at::Tensor> parts;
    for (const auto& x : inputs[0]) parts.push_back(x.reshape(-1));
    flat = at::cat(parts);
    char* base = static_cast<char*>(flat.data_ptr());
    size_t off = 0;
    for (int p = 0; p < size_; ++p) {
      sends[p] = Block{true, base + off, inputs[0][p].nbytes()};
      off += inputs[0][p].nbytes();
    }
  } else {
    recvs[root] = Block{true, out.data_ptr(), out.nbytes()};
  }
  exchange(op_name("scatter"), sends, recvs, block_kind(out.scalar_type()));
  if (rank_ == root) out.copy_(inputs[0][rank_].view_as(out));
  if (!out.is_same(outputs[0])) outputs[0].copy_(out);
  return done_work(rank_, c10d::OpType::SCATTER, outputs);
}

c10::intrusive_ptr<c10d::Work> OneSidedBackend::barrier(const c10d::BarrierOptions&) {
  ++seq_;
  std::vector<Block> all(size_, Block{true, nullptr, 0});
  exchange(op_name("barrier"), all, all);
  return done_work(rank_, c10d::OpType::BARRIER, {});
}

}  // namespace cam
