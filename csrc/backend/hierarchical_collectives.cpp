// The collectives of a group that spans hosts, as compositions of steps on the host's cam
// backend (local) and the inter-host backends (rail, leaders, all); hierarchical_backend.hpp
// says what each is. Every body runs on the worker thread, in issue order on every rank.
//
// Shapes of the compositions (H hosts, L ranks on this host, n elements):
//   all_reduce, small or hosts of unequal size: local reduce to index 0, leaders all_reduce,
//     local broadcast from index 0.
//   all_reduce, large on uniform hosts (rails): local reduce_scatter into L shards, rail r
//     all_reduces shard r across hosts (all rails at once), local all_gather.
//   broadcast: the root's host broadcasts locally; then leaders broadcast (small) or rail r
//     broadcasts shard r (large, uniform) and the other hosts broadcast (gather) locally.
//   all_gather: rail exchange (send/recv with every other host) then local all_gather
//     (uniform); else local all_gather, leaders exchange the host blocks, local broadcast.
//     Rows are then put in rank order; where hosts hold consecutive ranks a large one instead
//     gathers each host's block locally straight into its rows of the output.
//   Intermediate buffers come from the group's recycling pool (scratch()).
//   reduce_scatter: local reduce_scatter of rows ordered by (local index, host), then a rail
//     reduce_scatter of those H rows (uniform; over gloo an all_reduce of them); else local
//     reduce, leaders all_reduce the host blocks, local broadcast of the host's block.
//   reduce: local reduce, leaders reduce to the root's host, local broadcast there if the root
//     is not its leader. barrier: local, leaders, local.
//   gather, scatter, all_to_all: the inter-host backend over all ranks, directly. With the
//     option all_to_all_hops=two_hops (hosts of equal size, more than one rank each),
//     all_to_all instead takes two hops: sizes through the host and the rails first (every
//     receiver checks each source's block before data moves), then a local all_to_all gathers
//     each rank's blocks for rail l on local rank l, which sends them over rail l in one
//     message per host, landing straight in the output when its blocks lie in (host, local
//     index) order.
//   Coalesced all_reduce, all_gather_into_tensor, reduce_scatter_tensor (dist._coalescing_manager):
//     runs of consecutive tensors of one dtype, each up to kFuseMaxBytes (64 KiB), are packed
//     into one buffer (up to kFuseGroupBytes, 1 MiB) and move as one op; larger tensors go one
//     by one.
//   Uneven all_gather / reduce_scatter lists: every rank's list of sizes is gathered and
//     checked alike, then the even op runs on blocks padded to the largest.
//   monitored_barrier: arrivals and the release through the group's store.
#include <ATen/ATen.h>

#include <algorithm>
#include <numeric>

#include "../algo/collective.hpp"
#include "../core/errors.hpp"
#include "../transport/wait_policy.hpp"
#include "hierarchical_backend.hpp"
#include "one_sided_backend.hpp"

namespace cam {
namespace {

// From this size a uniform group all-reduces and broadcasts over rails: every rank's link
// carries 1/L of the bytes instead of the leader's carrying all of them.
// Over gloo, reduce_scatter between hosts runs as an all_reduce of the rows: gloo's
// reduce_scatter works only inside Work.wait() and never reports completion, so it cannot be
// waited on beside the store's failure key.
constexpr int64_t kRailMinBytes = 64 << 10;

// Coalesced ops pack small tensors into one op: each op between hosts costs a few hundred µs
// of latency. Past these sizes the copies and the lost per-op rail split cost more than that
// (bench_multihost --parts coalesced: 8 x 512 KiB packed ran 0.85x one by one at 1 Gbit/s).
constexpr int64_t kFuseMaxBytes = kRailMinBytes;
constexpr int64_t kFuseGroupBytes = 1 << 20;

// [begin, end) runs of `ts` that move as one op: consecutive tensors of one dtype, each up to
// kFuseMaxBytes, together up to kFuseGroupBytes; any other tensor is a run of its own.
std::vector<std::pair<size_t, size_t>> fused_runs(const std::vector<at::Tensor>& ts) {
  std::vector<std::pair<size_t, size_t>> runs;
  int64_t bytes = 0;   // in the last run
  bool open = false;   // the last run takes more tensors
  for (size_t i = 0; i < ts.size(); ++i) {
    const int64_t b = int64_t(ts[i].nbytes());
    const bool small = b <= kFuseMaxBytes;
    if (open && small && bytes + b <= kFuseGroupBytes && ts[runs.back().first].scalar_type() == ts[i].scalar_type()) {
      runs.back().second = i + 1;
      bytes += b;
    } else {
      runs.emplace_back(i, i + 1);
      bytes = b;
      open = small;
    }
  }
  return runs;
}

// The elements of ts[begin, end) back to back.
at::Tensor packed(const std::vector<at::Tensor>& ts, size_t begin, size_t end) {
  std::vector<at::Tensor> flat;
  for (size_t i = begin; i < end; ++i) flat.push_back(ts[i].reshape({-1}));
  return at::cat(flat);
}

c10d::AllreduceOptions allreduce_opts(const c10d::ReduceOp& op) {
  c10d::AllreduceOptions o;
  o.reduceOp = op;
  return o;
}
c10d::ReduceOptions reduce_opts(const c10d::ReduceOp& op, int root) {
  c10d::ReduceOptions o;
  o.reduceOp = op;
  o.rootRank = root;
  return o;
}
c10d::BroadcastOptions broadcast_opts(int root) {
  c10d::BroadcastOptions o;
  o.rootRank = root;
  return o;
}
c10d::ReduceScatterOptions reduce_scatter_opts(const c10d::ReduceOp& op) {
  c10d::ReduceScatterOptions o;
  o.reduceOp = op;
  return o;
}

at::Tensor index_tensor(const std::vector<int64_t>& v) {
  return at::tensor(v, at::TensorOptions().dtype(at::kLong));
}

bool is_avg(const c10d::ReduceOp& op) { return op.op_ == c10d::ReduceOp::AVG; }

// cam's one-sided engine has all_gather and reduce_scatter of its own; gloo's are avoided.
bool one_sided(c10d::Backend& b) { return dynamic_cast<OneSidedBackend*>(&b) != nullptr; }

}  // namespace

c10d::ReduceOp HierarchicalBackend::reduction(const c10d::ReduceOp& op, const at::Tensor& t, const char* name) const {
  TORCH_CHECK(op.op_ != c10d::ReduceOp::PREMUL_SUM, name,
              ": PREMUL_SUM is not supported in a group that spans hosts; use SUM, AVG, PRODUCT, MIN, MAX, BAND, "
              "BOR or BXOR");
  if (!is_avg(op)) return op;
  TORCH_CHECK(at::isFloatingType(t.scalar_type()) || at::isComplexType(t.scalar_type()), name,
              ": AVG of ", t.scalar_type(), " is not supported in a group that spans hosts; use SUM and divide");
  return c10d::ReduceOp(c10d::ReduceOp::SUM);
}

void HierarchicalBackend::allreduce_one(at::Tensor t, c10d::ReduceOp op) {
  const int ls = local_size();
  const int64_t n = t.numel();
  if (inter_.rail && ls > 1 && int64_t(t.nbytes()) >= kRailMinBytes) {
    const int64_t shard = (n + ls - 1) / ls;
    at::Tensor flat = t.view(-1);
    const bool padded = shard * ls != n;
    at::Tensor buf = padded ? scratch(shard * ls, t.options()).zero_() : flat;
    if (padded) buf.narrow(0, 0, n).copy_(flat);
    at::Tensor part = scratch(shard, t.options());
    local_step(local_->_reduce_scatter_base(part, buf, reduce_scatter_opts(op)));
    std::vector<at::Tensor> parts{part};
    inter_step(inter_.rail->allreduce(parts, allreduce_opts(op)));
    local_step(local_->_allgather_base(buf, part, c10d::AllgatherOptions()));
    if (padded) flat.copy_(buf.narrow(0, 0, n));
    return;
  }
  std::vector<at::Tensor> v{t};
  if (ls > 1) local_step(local_->reduce(v, reduce_opts(op, 0)));
  if (leader()) inter_step(inter_.leaders->allreduce(v, allreduce_opts(op)));
  if (ls > 1) local_step(local_->broadcast(v, broadcast_opts(0)));
}

void HierarchicalBackend::reduce_one(at::Tensor t, int root, c10d::ReduceOp op) {
  const int ls = local_size();
  std::vector<at::Tensor> v{t};
  if (ls > 1) local_step(local_->reduce(v, reduce_opts(op, 0)));
  if (leader()) inter_step(inter_.leaders->reduce(v, reduce_opts(op, map_.host_of[root])));
  if (my_host() == map_.host_of[root] && map_.local_of[root] != 0) local_step(local_->broadcast(v, broadcast_opts(0)));
}

void HierarchicalBackend::broadcast_one(at::Tensor t, int root) {
  const int ls = local_size();
  const int root_host = map_.host_of[root];
  const bool on_root_host = my_host() == root_host;
  std::vector<at::Tensor> v{t};
  if (on_root_host && ls > 1) local_step(local_->broadcast(v, broadcast_opts(map_.local_of[root])));
  if (inter_.rail && ls > 1 && int64_t(t.nbytes()) >= kRailMinBytes) {
    const int64_t n = t.numel();
    const int64_t shard = (n + ls - 1) / ls;
    at::Tensor flat = t.view(-1);
    const bool padded = shard * ls != n;
    at::Tensor buf = padded ? scratch(shard * ls, t.options()).zero_() : flat;
    if (padded && on_root_host) buf.narrow(0, 0, n).copy_(flat);
    at::Tensor part = on_root_host ? buf.narrow(0, map_.local_of[rank_] * shard, shard) : scratch(shard, t.options());
    std::vector<at::Tensor> parts{part};
    inter_step(inter_.rail->broadcast(parts, broadcast_opts(root_host)));
    if (!on_root_host) {
      local_step(local_->_allgather_base(buf, part, c10d::AllgatherOptions()));
      if (padded) flat.copy_(buf.narrow(0, 0, n));
    }
    return;
  }
  if (leader()) inter_step(inter_.leaders->broadcast(v, broadcast_opts(root_host)));
  if (!on_root_host && ls > 1) local_step(local_->broadcast(v, broadcast_opts(0)));
}

void HierarchicalBackend::exchange_blocks(c10d::Backend& hosts, const at::Tensor& mine, at::Tensor by_host) {
  if (one_sided(hosts)) {
    at::Tensor in = mine;  // c10d takes its arguments by non-const reference
    inter_step(hosts._allgather_base(by_host, in, c10d::AllgatherOptions()));
    return;
  }
  // Over gloo, an all_to_all that sends `mine` to every other host: gloo's all_gather moves the
  // same bytes 2-3x slower (16 MiB between two ranks here: 60 ms against 20-28 ms), and its
  // point-to-point Work has no Future to wait on beside the failure key.
  const int64_t k = mine.numel();
  const int hosts_n = map_.hosts();
  const int me = my_host();
  by_host.narrow(0, int64_t(me) * k, k).copy_(mine);
  std::vector<int64_t> in_splits(hosts_n, k);
  in_splits[me] = 0;
  std::vector<int64_t> out_splits = in_splits;  // two vectors: gloo may move from its arguments
  at::Tensor send = hosts_n == 2 ? mine : mine.repeat({hosts_n - 1});
  // Blocks from the other hosts, in host order without this one's: with two hosts, its slot.
  at::Tensor recv = hosts_n == 2 ? by_host.narrow(0, int64_t(1 - me) * k, k) : scratch(int64_t(hosts_n - 1) * k, mine.options());
  inter_step(hosts.alltoall_base(recv, send, out_splits, in_splits, c10d::AllToAllOptions()));
  if (hosts_n > 2) {
    by_host.narrow(0, 0, int64_t(me) * k).copy_(recv.narrow(0, 0, int64_t(me) * k));
    by_host.narrow(0, int64_t(me + 1) * k, int64_t(hosts_n - 1 - me) * k)
        .copy_(recv.narrow(0, int64_t(me) * k, int64_t(hosts_n - 1 - me) * k));
  }
}

void HierarchicalBackend::gather_rows(const at::Tensor& input, at::Tensor out_rows) {
  const int hosts = map_.hosts();
  const int ls = local_size();
  const int64_t n = input.numel();
  at::Tensor in = input.reshape({n});
  std::vector<int64_t> idx(size_);
  at::Tensor all;
  if (inter_.rail) {
    // by_host[h]: the input of host h's rank of this rank's local index.
    // (The engines take flat buffers: gloo compares the output's chunks with the input's shape.)
    at::Tensor by_host = scratch(int64_t(hosts) * n, input.options());
    exchange_blocks(*inter_.rail, in, by_host);
    if (ls > 1 && map_.in_rank_order() && int64_t(in.nbytes()) >= kRailMinBytes) {
      // Host h's ranks are out rows h*L..h*L+L-1: gather each host's block straight there.
      for (int h = 0; h < hosts; ++h) {
        at::Tensor rows = out_rows.narrow(0, int64_t(h) * ls, ls).view(-1);
        at::Tensor block = by_host.narrow(0, int64_t(h) * n, n);
        local_step(local_->_allgather_base(rows, block, c10d::AllgatherOptions()));
      }
      return;
    }
    all = by_host;
    if (ls > 1) {
      all = scratch(int64_t(ls) * hosts * n, input.options());
      local_step(local_->_allgather_base(all, by_host, c10d::AllgatherOptions()));
    }
    for (int g = 0; g < size_; ++g) idx[g] = int64_t(map_.local_of[g]) * hosts + map_.host_of[g];
    all = all.view({int64_t(ls) * hosts, n});
  } else {
    const int m = map_.max_local();
    at::Tensor host_rows = scratch(int64_t(m) * n, input.options()).zero_();
    at::Tensor mine = host_rows.narrow(0, 0, int64_t(ls) * n);
    if (ls > 1) {
      local_step(local_->_allgather_base(mine, in, c10d::AllgatherOptions()));
    } else {
      mine.copy_(in);
    }
    all = scratch(int64_t(hosts) * m * n, input.options());
    if (leader()) exchange_blocks(*inter_.leaders, host_rows, all);
    std::vector<at::Tensor> v{all};
    if (ls > 1) local_step(local_->broadcast(v, broadcast_opts(0)));
    for (int g = 0; g < size_; ++g) idx[g] = int64_t(map_.host_of[g]) * m + map_.local_of[g];
    all = all.view({int64_t(hosts) * m, n});
  }
  at::index_select_out(out_rows, all, 0, index_tensor(idx));
}

void HierarchicalBackend::reduce_scatter_rows(const at::Tensor& in_rows, at::Tensor out, c10d::ReduceOp op) {
  const int hosts = map_.hosts();
  const int ls = local_size();
  const int lr = map_.local_of[rank_];
  const int64_t n = out.numel();
  if (inter_.rail) {
    // x[l][h] = the row for host h's rank of local index l.
    std::vector<int64_t> idx(size_);
    for (int l = 0; l < ls; ++l)
      for (int h = 0; h < hosts; ++h) idx[l * hosts + h] = map_.ranks[h][l];
    at::Tensor x = scratch(int64_t(size_) * n, out.options());
    at::Tensor x_rows = x.view({size_, n});
    at::index_select_out(x_rows, in_rows, 0, index_tensor(idx));
    at::Tensor y = x;  // y[h]: this host's partial for host h's rank of this rank's local index
    if (ls > 1) {
      y = scratch(int64_t(hosts) * n, out.options());
      local_step(local_->_reduce_scatter_base(y, x, reduce_scatter_opts(op)));
    }
    if (one_sided(*inter_.rail)) {
      at::Tensor flat = out.view(-1);
      inter_step(inter_.rail->_reduce_scatter_base(flat, y, reduce_scatter_opts(op)));
      return;
    }
    std::vector<at::Tensor> ys{y};
    inter_step(inter_.rail->allreduce(ys, allreduce_opts(op)));
    out.view(-1).copy_(y.narrow(0, int64_t(my_host()) * n, n));
    return;
  }
  const int m = map_.max_local();
  at::Tensor x = scratch(int64_t(hosts) * m * n, out.options()).zero_().view({int64_t(hosts) * m, n});
  std::vector<int64_t> pos(size_);
  for (int g = 0; g < size_; ++g) pos[g] = int64_t(map_.host_of[g]) * m + map_.local_of[g];
  x.index_copy_(0, index_tensor(pos), in_rows);
  x = x.view(-1);
  std::vector<at::Tensor> v{x};
  if (ls > 1) local_step(local_->reduce(v, reduce_opts(op, 0)));
  at::Tensor block = scratch(int64_t(m) * n, out.options());
  if (leader()) {
    inter_step(inter_.leaders->allreduce(v, allreduce_opts(op)));
    block.copy_(x.narrow(0, int64_t(my_host()) * m * n, int64_t(m) * n));
  }
  std::vector<at::Tensor> b{block};
  if (ls > 1) local_step(local_->broadcast(b, broadcast_opts(0)));
  out.view(-1).copy_(block.narrow(0, int64_t(lr) * n, n));
}

int64_t HierarchicalBackend::list_blocks(const std::vector<at::Tensor>& list, const at::Tensor& mine, const char* role,
                                         const char* other, const char* what, std::vector<int64_t>& sizes) {
  TORCH_CHECK(list[size_t(rank_)].numel() == mine.numel(), role, " ", rank_, " (this rank's) holds ",
              list[size_t(rank_)].numel(), " elements, expected the ", other, "'s ", mine.numel());
  sizes.assign(size_t(size_), 0);
  for (int g = 0; g < size_; ++g) {
    TORCH_CHECK(list[size_t(g)].scalar_type() == mine.scalar_type(), role, " ", g, " is ",
                list[size_t(g)].scalar_type(), " but the ", other, " is ", mine.scalar_type());
    sizes[size_t(g)] = list[size_t(g)].numel();
  }
  const int64_t block = *std::max_element(sizes.begin(), sizes.end());
  if (std::any_of(sizes.begin(), sizes.end(), [&](int64_t n) { return n != block; })) check_same_sizes(sizes, what);
  return block;
}

void HierarchicalBackend::check_same_sizes(const std::vector<int64_t>& sizes, const char* what) {
  at::Tensor mine = index_tensor(sizes);
  at::Tensor table = scratch(int64_t(size_) * size_, mine.options());
  gather_rows(mine, table.view({size_, size_}));
  const int64_t* t = table.const_data_ptr<int64_t>();
  auto text = [](const int64_t* v, int n) {
    std::string s = "[";
    for (int i = 0; i < n; ++i) s += (i ? ", " : "") + std::to_string(v[i]);
    return s + "]";
  };
  for (int g = 0; g < size_; ++g) {
    TORCH_CHECK(std::equal(sizes.begin(), sizes.end(), t + int64_t(g) * size_), "rank ", g, " passes ", what, " ",
                text(t + int64_t(g) * size_, size_), " while this rank passes ", text(sizes.data(), size_),
                "; every rank must pass the same sizes");
  }
}

void HierarchicalBackend::barrier_all() {
  const int ls = local_size();
  if (ls > 1) local_step(local_->barrier(c10d::BarrierOptions()));
  if (leader()) inter_step(inter_.leaders->barrier(c10d::BarrierOptions()));
  if (ls > 1) local_step(local_->barrier(c10d::BarrierOptions()));
}

void HierarchicalBackend::monitored_barrier_all(std::chrono::milliseconds timeout, bool wait_all_ranks) {
  const std::string prefix = str("cam_monitored_barrier/", ++monitored_seq_, "/");
  const auto deadline = Clock::now() + timeout;
  // Each poll is a round trip to the store: sleep between polls, up to a liveness interval.
  Backoff backoff(0, 0, local_->engine()->config().liveness_interval_ms * 1000);
  auto forget = [this](const std::string& key) {
    try {
      store_->deleteKey(key);
    } catch (const std::exception&) {
      // Not every store deletes (FileStore): the key is left behind, never read again.
    }
  };
  if (rank_ == 0) {
    std::vector<int> missing;
    for (int r = 1; r < size_; ++r) missing.push_back(r);
    while (true) {
      missing.erase(std::remove_if(missing.begin(), missing.end(),
                                   [&](int r) { return store_->check({prefix + std::to_string(r)}); }),
                    missing.end());
      if (missing.empty()) break;
      TORCH_CHECK(Clock::now() < deadline, "timeout after ", timeout.count(), " ms waiting for ",
                  monitored_barrier_waiting_for(0, missing, wait_all_ranks, timeout.count()));
      raise_published();
      backoff.pause();
    }
    store_->set(prefix + "release", std::vector<uint8_t>{1});
    for (int r = 1; r < size_; ++r) forget(prefix + std::to_string(r));
    return;
  }
  store_->set(prefix + std::to_string(rank_), std::vector<uint8_t>{1});
  const std::string released = prefix + "release";
  const std::string waited = monitored_barrier_waiting_for(rank_, {}, wait_all_ranks, timeout.count());
  while (!store_->check({released})) {
    const std::string why = published_failure();
    TORCH_CHECK(why.empty(), "waited for ", waited, " (the group failed: ", why, ")");
    TORCH_CHECK(Clock::now() < deadline, "timeout after ", timeout.count(), " ms waiting for ", waited);
    backoff.pause();
  }
  // The last rank to leave removes the release.
  if (store_->add(prefix + "left", 1) == size_ - 1) {
    forget(released);
    forget(prefix + "left");
  }
}

// ---- the c10d entry points: one worker body each ----
//
// Arguments are checked inside the bodies, on the worker: a rank whose arguments are wrong then
// fails the group (every rank raises within a liveness interval) instead of raising alone and
// leaving its peers to wait out the timeout.

namespace {
at::Tensor contiguous_of(const at::Tensor& t) { return t.is_contiguous() ? t : t.contiguous(); }
void copy_back(const at::Tensor& work, const at::Tensor& user) {
  if (!work.is_same(user)) user.copy_(work);
}
const at::Tensor& the_one(const std::vector<at::Tensor>& tensors) {
  TORCH_CHECK(tensors.size() == 1, "takes one tensor per rank, got ", tensors.size());
  return tensors[0];
}
template <typename List>
const List& the_list(const std::vector<List>& lists, int size, const char* what) {
  TORCH_CHECK(lists.size() == 1 && int(lists[0].size()) == size, "needs one list of ", size, " ", what, " tensors");
  return lists[0];
}
int checked_root(int64_t root, int size) {
  TORCH_CHECK(root >= 0 && root < size, "root ", root, " is not a rank of the group (size ", size, ")");
  return int(root);
}
}  // namespace

void HierarchicalBackend::allreduce_tensor(const at::Tensor& t, const c10d::ReduceOp& op, const char* name) {
  const c10d::ReduceOp run = reduction(op, t, name);
  at::Tensor c = contiguous_of(t);
  allreduce_one(c, run);
  if (is_avg(op)) c.div_(size_);
  copy_back(c, t);
}

void HierarchicalBackend::allgather_tensor(const at::Tensor& out, const at::Tensor& in) {
  TORCH_CHECK(out.numel() == int64_t(size_) * in.numel() && out.scalar_type() == in.scalar_type(), "the output holds ",
              out.numel(), " elements of ", out.scalar_type(), ", expected ", int64_t(size_) * in.numel(), " (", size_,
              " x ", in.numel(), ") of ", in.scalar_type());
  at::Tensor c = contiguous_of(out);
  gather_rows(contiguous_of(in), c.view({size_, in.numel()}));
  copy_back(c, out);
}

void HierarchicalBackend::reduce_scatter_tensor(const at::Tensor& out, const at::Tensor& in, const c10d::ReduceOp& op,
                                                const char* name) {
  TORCH_CHECK(in.numel() == int64_t(size_) * out.numel() && in.scalar_type() == out.scalar_type(), "the input holds ",
              in.numel(), " elements of ", in.scalar_type(), ", expected ", int64_t(size_) * out.numel(), " (", size_,
              " x ", out.numel(), ") of ", out.scalar_type());
  const c10d::ReduceOp run = reduction(op, out, name);
  at::Tensor c = contiguous_of(out);
  reduce_scatter_rows(contiguous_of(in).view({size_, out.numel()}), c, run);
  if (is_avg(op)) c.div_(size_);
  copy_back(c, out);
}

c10::intrusive_ptr<c10d::Work> HierarchicalBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                              const c10d::AllreduceOptions& opts) {
  return enqueue(c10d::OpType::ALLREDUCE, "all_reduce", tensors, [this, ts = tensors, op = opts.reduceOp] {
    allreduce_tensor(the_one(ts), op, "all_reduce");
  });
}

c10::intrusive_ptr<c10d::Work> HierarchicalBackend::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                        const c10d::AllreduceCoalescedOptions& opts) {
  return enqueue(c10d::OpType::ALLREDUCE_COALESCED, "all_reduce_coalesced", tensors,
                 [this, ts = tensors, op = opts.reduceOp] {
                   for (const auto& [b, e] : fused_runs(ts)) {
                     if (e - b == 1) {
                       allreduce_tensor(ts[b], op, "all_reduce_coalesced");
                       continue;
                     }
                     at::Tensor all = packed(ts, b, e);
                     allreduce_tensor(all, op, "all_reduce_coalesced");
                     int64_t off = 0;
                     for (size_t i = b; i < e; off += ts[i].numel(), ++i)
                       ts[i].copy_(all.narrow(0, off, ts[i].numel()).view(ts[i].sizes()));
                   }
                 });
}

c10::intrusive_ptr<c10d::Work> HierarchicalBackend::reduce(std::vector<at::Tensor>& tensors,
                                                           const c10d::ReduceOptions& opts) {
  return enqueue(c10d::OpType::REDUCE, "reduce", tensors,
                 [this, ts = tensors, root = opts.rootRank, op = opts.reduceOp] {
                   const at::Tensor& t = the_one(ts);
                   const int r = checked_root(root, size_);
                   const c10d::ReduceOp run = reduction(op, t, "reduce");
                   at::Tensor c = contiguous_of(t);
                   reduce_one(c, r, run);
                   if (is_avg(op) && rank_ == r) c.div_(size_);
                   copy_back(c, t);
                 });
}

c10::intrusive_ptr<c10d::Work> HierarchicalBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                              const c10d::BroadcastOptions& opts) {
  return enqueue(c10d::OpType::BROADCAST, "broadcast", tensors, [this, ts = tensors, root = opts.rootRank] {
    const at::Tensor& t = the_one(ts);
    const int r = checked_root(root, size_);
    at::Tensor c = contiguous_of(t);
    broadcast_one(c, r);
    copy_back(c, t);
  });
}

c10::intrusive_ptr<c10d::Work> HierarchicalBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                              std::vector<at::Tensor>& inputs,
                                                              const c10d::AllgatherOptions&) {
  std::vector<at::Tensor> result = outputs.empty() ? std::vector<at::Tensor>{} : outputs[0];
  return enqueue(c10d::OpType::ALLGATHER, "all_gather", result, [this, outputs, inputs] {
    const at::Tensor& in = the_one(inputs);
    const auto& outs = the_list(outputs, size_, "output");
    // Uneven (each rank contributes its own size, as Megatron's expert-tensor-parallel
    // dispatcher does): blocks padded to the largest.
    std::vector<int64_t> sizes;
    const int64_t block = list_blocks(outs, in, "output", "input", "all_gather output sizes", sizes);
    const bool even = block == in.numel() && std::all_of(sizes.begin(), sizes.end(), [&](int64_t n) { return n == block; });
    at::Tensor mine = in.reshape({-1});
    if (!even) {
      mine = scratch(block, in.options());
      mine.narrow(0, 0, in.numel()).copy_(in.reshape({-1}));
      mine.narrow(0, in.numel(), block - in.numel()).zero_();
    }
    at::Tensor rows = scratch(int64_t(size_) * block, in.options());
    allgather_tensor(rows, mine);
    for (int g = 0; g < size_; ++g) outs[g].copy_(rows.narrow(0, g * block, sizes[g]).view(outs[g].sizes()));
  });
}

c10::intrusive_ptr<c10d::Work> HierarchicalBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                    const c10d::AllgatherOptions&) {
  return enqueue(c10d::OpType::_ALLGATHER_BASE, "all_gather_into_tensor", {output},
                 [this, out = output, in = input] { allgather_tensor(out, in); });
}

c10::intrusive_ptr<c10d::Work> HierarchicalBackend::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& output_lists, std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions&) {
  std::vector<at::Tensor> result;
  for (const auto& l : output_lists) result.insert(result.end(), l.begin(), l.end());
  return enqueue(c10d::OpType::ALLGATHER_COALESCED, "all_gather_coalesced", result, [this, output_lists, inputs] {
    TORCH_CHECK(!inputs.empty(), "expected at least one input");
    TORCH_CHECK(int(output_lists.size()) == size_, "expected ", size_, " output lists (one per rank), got ",
                output_lists.size());
    std::vector<at::Tensor> flat;
    for (size_t i = 0; i < inputs.size(); ++i) {
      TORCH_CHECK(inputs[i].scalar_type() == inputs[0].scalar_type(), "input ", i, " is ", inputs[i].scalar_type(),
                  " but input 0 is ", inputs[0].scalar_type());
      flat.push_back(inputs[i].reshape({-1}));
    }
    for (int g = 0; g < size_; ++g) {
      TORCH_CHECK(output_lists[g].size() == inputs.size(), "output list ", g, " holds ", output_lists[g].size(),
                  " tensors, expected ", inputs.size(), " (one per input)");
      for (size_t i = 0; i < inputs.size(); ++i)
        TORCH_CHECK(output_lists[g][i].numel() == inputs[i].numel() &&
                        output_lists[g][i].scalar_type() == inputs[i].scalar_type(),
                    "output ", i, " of rank ", g, " holds ", output_lists[g][i].numel(), " elements of ",
                    output_lists[g][i].scalar_type(), ", expected ", inputs[i].numel(), " of ", inputs[i].scalar_type());
    }
    // Every rank's inputs back to back: one gather of rows of `total` elements.
    at::Tensor mine = at::cat(flat);
    const int64_t total = mine.numel();
    at::Tensor rows = scratch(int64_t(size_) * total, mine.options());
    allgather_tensor(rows, mine);
    for (int g = 0; g < size_; ++g) {
      int64_t off = int64_t(g) * total;
      for (const auto& o : output_lists[g]) {
        o.copy_(rows.narrow(0, off, o.numel()).view(o.sizes()));
        off += o.numel();
      }
    }
  });
}

c10::intrusive_ptr<c10d::Work> HierarchicalBackend::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                                    std::vector<at::Tensor>& inputs,
                                                                                    const c10d::AllgatherOptions&) {
  return enqueue(c10d::OpType::COALESCED, "all_gather_into_tensor_coalesced", outputs, [this, outputs, inputs] {
    TORCH_CHECK(outputs.size() == inputs.size(), outputs.size(), " outputs for ", inputs.size(), " inputs");
    for (const auto& [b, e] : fused_runs(inputs)) {
      bool fits = true;  // else one by one, where allgather_tensor names the output that does not fit
      for (size_t i = b; i < e; ++i)
        fits &= outputs[i].numel() == int64_t(size_) * inputs[i].numel() &&
                outputs[i].scalar_type() == inputs[i].scalar_type() && outputs[i].is_contiguous();
      if (e - b == 1 || !fits) {
        for (size_t i = b; i < e; ++i) allgather_tensor(outputs[i], inputs[i]);
        continue;
      }
      // Every rank's packed inputs, as rows; output i takes its columns of every row.
      at::Tensor mine = packed(inputs, b, e);
      const int64_t total = mine.numel();
      at::Tensor rows = scratch(int64_t(size_) * total, mine.options());
      allgather_tensor(rows, mine);
      at::Tensor by_rank = rows.view({size_, total});
      int64_t off = 0;
      for (size_t i = b; i < e; off += inputs[i].numel(), ++i) {
        const int64_t n = inputs[i].numel();
        outputs[i].view({size_, n}).copy_(by_rank.narrow(1, off, n));
      }
    }
  });
}

c10::intrusive_ptr<c10d::Work> HierarchicalBackend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                                   std::vector<std::vector<at::Tensor>>& inputs,
                                                                   const c10d::ReduceScatterOptions& opts) {
  return enqueue(c10d::OpType::REDUCE_SCATTER, "reduce_scatter", outputs,
                 [this, outputs, inputs, op = opts.reduceOp] {
                   const at::Tensor& out = the_one(outputs);
                   const auto& ins = the_list(inputs, size_, "input");
                   // Uneven blocks: padded to the largest.
                   std::vector<int64_t> sizes;
                   const int64_t block = list_blocks(ins, out, "input", "output", "reduce_scatter input sizes", sizes);
                   const bool even = block == out.numel() &&
                                     std::all_of(sizes.begin(), sizes.end(), [&](int64_t n) { return n == block; });
                   at::Tensor rows = scratch(int64_t(size_) * block, out.options());
                   for (int g = 0; g < size_; ++g) {
                     at::Tensor row = rows.narrow(0, g * block, block);
                     row.narrow(0, 0, sizes[g]).copy_(ins[g].reshape({-1}));
                     if (sizes[g] < block) row.narrow(0, sizes[g], block - sizes[g]).zero_();
                   }
                   if (even) {
                     reduce_scatter_tensor(out, rows, op, "reduce_scatter");
                     return;
                   }
                   at::Tensor mine = scratch(block, out.options());
                   reduce_scatter_tensor(mine, rows, op, "reduce_scatter");
                   out.copy_(mine.narrow(0, 0, out.numel()).view(out.sizes()));
                 });
}

c10::intrusive_ptr<c10d::Work> HierarchicalBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                         const c10d::ReduceScatterOptions& opts) {
  return enqueue(c10d::OpType::_REDUCE_SCATTER_BASE, "reduce_scatter_tensor", {output},
                 [this, out = output, in = input, op = opts.reduceOp] {
                   reduce_scatter_tensor(out, in, op, "reduce_scatter_tensor");
                 });
}

c10::intrusive_ptr<c10d::Work> HierarchicalBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::ReduceScatterOptions& opts) {
  return enqueue(c10d::OpType::COALESCED, "reduce_scatter_tensor_coalesced", outputs,
                 [this, outputs, inputs, op = opts.reduceOp] {
                   TORCH_CHECK(outputs.size() == inputs.size(), outputs.size(), " outputs for ", inputs.size(),
                               " inputs");
                   for (const auto& [b, e] : fused_runs(outputs)) {
                     bool fits = true;  // else one by one, where reduce_scatter_tensor names the misfit
                     for (size_t i = b; i < e; ++i)
                       fits &= inputs[i].numel() == int64_t(size_) * outputs[i].numel() &&
                               inputs[i].scalar_type() == outputs[i].scalar_type();
                     if (e - b == 1 || !fits) {
                       for (size_t i = b; i < e; ++i)
                         reduce_scatter_tensor(outputs[i], inputs[i], op, "reduce_scatter_tensor_coalesced");
                       continue;
                     }
                     // Row g of the packed input: every input's block g, back to back.
                     int64_t total = 0;
                     for (size_t i = b; i < e; ++i) total += outputs[i].numel();
                     at::Tensor rows = scratch(int64_t(size_) * total, outputs[b].options());
                     at::Tensor by_rank = rows.view({size_, total});
                     int64_t off = 0;
                     for (size_t i = b; i < e; off += outputs[i].numel(), ++i) {
                       const int64_t n = outputs[i].numel();
                       by_rank.narrow(1, off, n).copy_(inputs[i].reshape({size_, n}));
                     }
                     at::Tensor mine = scratch(total, outputs[b].options());
                     reduce_scatter_tensor(mine, rows, op, "reduce_scatter_tensor_coalesced");
                     off = 0;
                     for (size_t i = b; i < e; off += outputs[i].numel(), ++i)
                       outputs[i].copy_(mine.narrow(0, off, outputs[i].numel()).view(outputs[i].sizes()));
                   }
                 });
}

c10::intrusive_ptr<c10d::Work> HierarchicalBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                           std::vector<at::Tensor>& inputs,
                                                           const c10d::GatherOptions& opts) {
  auto outs = outputs;
  auto ins = inputs;
  std::vector<at::Tensor> result = outs.empty() ? std::vector<at::Tensor>{} : outs[0];
  return enqueue(c10d::OpType::GATHER, "gather", result, [this, outs, ins, opts]() mutable {
    inter_step(inter_.collectives->gather(outs, ins, opts));
  });
}

c10::intrusive_ptr<c10d::Work> HierarchicalBackend::scatter(std::vector<at::Tensor>& outputs,
                                                            std::vector<std::vector<at::Tensor>>& inputs,
                                                            const c10d::ScatterOptions& opts) {
  auto outs = outputs;
  auto ins = inputs;
  return enqueue(c10d::OpType::SCATTER, "scatter", outputs, [this, outs, ins, opts]() mutable {
    inter_step(inter_.collectives->scatter(outs, ins, opts));
  });
}

namespace {
// Each rank's block of a tensor split along dim 0 (`splits` in rows; empty: equal blocks), as
// bytes.
std::vector<at::Tensor> byte_blocks(const at::Tensor& t, const std::vector<int64_t>& splits, int size,
                                    const char* what) {
  const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
  const int64_t row_bytes = rows == 0 ? 0 : int64_t(t.nbytes()) / rows;
  TORCH_CHECK(splits.empty() || int64_t(splits.size()) == size, what, " splits name ", splits.size(),
              " ranks, the group has ", size);
  TORCH_CHECK(!splits.empty() || rows % size == 0, what, " of ", rows, " rows does not split evenly over ", size,
              " ranks");
  at::Tensor bytes = t.view({-1}).view(at::kByte);
  std::vector<at::Tensor> out;
  int64_t at = 0;
  for (int g = 0; g < size; ++g) {
    const int64_t n = splits.empty() ? rows / size : splits[size_t(g)];
    TORCH_CHECK(n >= 0 && at + n <= rows, what, " splits exceed its ", rows, " rows");
    out.push_back(bytes.narrow(0, at * row_bytes, n * row_bytes));
    at += n;
  }
  TORCH_CHECK(at == rows, what, " splits cover ", at, " of its ", rows, " rows");
  return out;
}

// Whether blocks[first..] lie back to back in memory, in this order.
bool back_to_back(const std::vector<at::Tensor>& blocks) {
  for (size_t i = 1; i < blocks.size(); ++i)
    if (static_cast<const uint8_t*>(blocks[i].data_ptr()) !=
        static_cast<const uint8_t*>(blocks[i - 1].data_ptr()) + blocks[i - 1].numel())
      return false;
  return true;
}
}  // namespace

bool HierarchicalBackend::alltoall_in_two_hops() const {
  return inter_.rail && local_size() > 1 && local_->engine()->config().all_to_all_hops == "two_hops";
}

void HierarchicalBackend::alltoall_two_hops(const std::vector<at::Tensor>& send, const std::vector<at::Tensor>& recv,
                                            const char* what) {
  const int H = map_.hosts(), L = local_size(), hm = my_host(), lm = map_.local_of[size_t(rank_)];
  auto rank_at = [&](int h, int l) { return map_.ranks[size_t(h)][size_t(l)]; };
  // Hop 0: every rank tells local rank l the sizes of its blocks for rank l of every host.
  at::Tensor mine = at::empty({int64_t(L) * H}, at::kLong);
  for (int l = 0; l < L; ++l)
    for (int h = 0; h < H; ++h) mine.data_ptr<int64_t>()[l * H + h] = send[size_t(rank_at(h, l))].numel();
  at::Tensor theirs = at::empty({int64_t(L) * H}, at::kLong);
  host_alltoall(theirs, mine, std::vector<int64_t>(size_t(L), H), std::vector<int64_t>(size_t(L), H));
  const int64_t* fwd = theirs.data_ptr<int64_t>();  // fwd[s * H + h]: local rank s's block for rank (h, lm)
  // Over the rail, ahead of the data: what each forwarder will send this rank, block by block,
  // so that every receiver checks each source's block against its own splits.
  at::Tensor heads_out = at::empty({int64_t(H) * L}, at::kLong), heads_in = at::empty({int64_t(H) * L}, at::kLong);
  for (int h = 0; h < H; ++h)
    for (int s = 0; s < L; ++s) heads_out.data_ptr<int64_t>()[h * L + s] = fwd[s * H + h];
  std::vector<int64_t> per_host(size_t(H), L);
  auto heads = inter_.rail->alltoall_base(heads_in, heads_out, per_host, per_host, c10d::AllToAllOptions());
  // Hop 1 (this host's cam group): to local rank l, this rank's blocks for rank l of every host.
  std::vector<int64_t> in1(size_t(L), 0), out1(size_t(L), 0);
  for (int l = 0; l < L; ++l)
    for (int h = 0; h < H; ++h) in1[size_t(l)] += send[size_t(rank_at(h, l))].numel();
  for (int s = 0; s < L; ++s)
    for (int h = 0; h < H; ++h) out1[size_t(s)] += fwd[s * H + h];
  at::Tensor packed = scratch(std::accumulate(in1.begin(), in1.end(), int64_t(0)), at::kByte);
  {
    int64_t at = 0;
    for (int l = 0; l < L; ++l)
      for (int h = 0; h < H; ++h) {
        const at::Tensor& b = send[size_t(rank_at(h, l))];
        packed.narrow(0, at, b.numel()).copy_(b);
        at += b.numel();
      }
  }
  // Checked before any data moves: a rank that fails here leaves its host's exchange, so every
  // rank of every host fails with it (none completes on blocks that happened to match; checked
  // after the host's exchange instead, the ranks of a rail whose blocks matched would complete).
  inter_step(heads);
  const int64_t* head = heads_in.data_ptr<int64_t>();  // head[h * L + s]: rank (h, s)'s block for this rank
  for (int h = 0; h < H; ++h)
    for (int s = 0; s < L; ++s) {
      const int64_t got = h == hm ? fwd[s * H + hm] : head[h * L + s], want = recv[size_t(rank_at(h, s))].numel();
      TORCH_CHECK(got == want, what, ": rank ", rank_at(h, s), " sends ", got, " bytes, this rank expects ", want);
    }
  at::Tensor gathered = scratch(std::accumulate(out1.begin(), out1.end(), int64_t(0)), at::kByte);
  host_alltoall(gathered, packed, out1, in1);
  // Hop 2 (rail lm): to rank lm of host h, every local rank's block for it; this host's own
  // blocks are the rail's self block.
  std::vector<int64_t> in2(size_t(H), 0), out2(size_t(H), 0);
  std::vector<int64_t> from(size_t(L) * H);  // where local rank s's block for host h lies in `gathered`
  {
    int64_t at = 0;
    for (int s = 0; s < L; ++s)
      for (int h = 0; h < H; ++h) from[size_t(s * H + h)] = at, at += fwd[s * H + h];
  }
  for (int h = 0; h < H; ++h)
    for (int s = 0; s < L; ++s) {
      in2[size_t(h)] += fwd[s * H + h];
      out2[size_t(h)] += recv[size_t(rank_at(h, s))].numel();
    }
  at::Tensor forward = scratch(std::accumulate(in2.begin(), in2.end(), int64_t(0)), at::kByte);
  {
    int64_t at = 0;
    for (int h = 0; h < H; ++h)
      for (int s = 0; s < L; ++s) {
        const int64_t n = fwd[s * H + h];
        forward.narrow(0, at, n).copy_(gathered.narrow(0, from[size_t(s * H + h)], n));
        at += n;
      }
  }
  // Blocks arrive by host, then local index: straight into the output where it is laid out so.
  std::vector<at::Tensor> order;
  for (int h = 0; h < H; ++h)
    for (int s = 0; s < L; ++s) order.push_back(recv[size_t(rank_at(h, s))]);
  const bool in_place = back_to_back(order);
  const int64_t total = std::accumulate(out2.begin(), out2.end(), int64_t(0));
  at::Tensor landed = in_place && !order.empty()
                          ? at::from_blob(order[0].data_ptr(), {total}, at::kByte)
                          : scratch(total, at::kByte);
  rail_alltoall(landed, forward, out2, in2);
  if (!in_place) {
    int64_t at = 0;
    for (const at::Tensor& b : order) {
      at::Tensor dst = b;
      dst.copy_(landed.narrow(0, at, b.numel()));
      at += b.numel();
    }
  }
}

c10::intrusive_ptr<c10d::Work> HierarchicalBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                                  std::vector<int64_t>& output_splits,
                                                                  std::vector<int64_t>& input_splits,
                                                                  const c10d::AllToAllOptions& opts) {
  at::Tensor out = output, in = input;
  auto os = output_splits, is = input_splits;
  return enqueue(c10d::OpType::ALLTOALL_BASE, "all_to_all_single", {output}, [this, out, in, os, is, opts]() mutable {
    if (!alltoall_in_two_hops()) {
      inter_step(inter_.collectives->alltoall_base(out, in, os, is, opts));
      return;
    }
    TORCH_CHECK(in.scalar_type() == out.scalar_type(), "all_to_all_single: the input is ", in.scalar_type(),
                " but the output is ", out.scalar_type());
    at::Tensor src = in.contiguous(), dst = out.is_contiguous() ? out : at::empty_like(out, at::MemoryFormat::Contiguous);
    alltoall_two_hops(byte_blocks(src, is, size_, "all_to_all_single input"),
                      byte_blocks(dst, os, size_, "all_to_all_single output"), "all_to_all_single");
    if (!dst.is_same(out)) out.copy_(dst);
  });
}

c10::intrusive_ptr<c10d::Work> HierarchicalBackend::alltoall(std::vector<at::Tensor>& outputs,
                                                             std::vector<at::Tensor>& inputs,
                                                             const c10d::AllToAllOptions& opts) {
  auto outs = outputs, ins = inputs;
  return enqueue(c10d::OpType::ALLTOALL, "all_to_all", outputs, [this, outs, ins, opts]() mutable {
    if (!alltoall_in_two_hops()) {
      inter_step(inter_.collectives->alltoall(outs, ins, opts));
      return;
    }
    TORCH_CHECK(int(outs.size()) == size_ && int(ins.size()) == size_, "all_to_all needs one input and one output "
                "tensor per rank (", size_, "), got ", ins.size(), " and ", outs.size());
    std::vector<at::Tensor> send, recv, staged(outs.size());
    for (size_t g = 0; g < ins.size(); ++g) {
      TORCH_CHECK(ins[g].scalar_type() == outs[g].scalar_type(), "all_to_all: input ", g, " is ", ins[g].scalar_type(),
                  " but output ", g, " is ", outs[g].scalar_type());
      send.push_back(ins[g].contiguous().view({-1}).view(at::kByte));
      staged[g] = outs[g].is_contiguous() ? outs[g] : at::empty_like(outs[g], at::MemoryFormat::Contiguous);
      recv.push_back(staged[g].view({-1}).view(at::kByte));
    }
    alltoall_two_hops(send, recv, "all_to_all");
    for (size_t g = 0; g < outs.size(); ++g)
      if (!staged[g].is_same(outs[g])) outs[g].copy_(staged[g]);
  });
}

void HierarchicalBackend::run(const std::string& name, Body body) { enqueue(c10d::OpType::UNKNOWN, name, {}, std::move(body))->wait(); }

void HierarchicalBackend::host_alltoall(at::Tensor out, at::Tensor in, std::vector<int64_t> out_splits,
                                        std::vector<int64_t> in_splits) {
  local_step(local_->alltoall_base(out, in, out_splits, in_splits, c10d::AllToAllOptions()));
}

void HierarchicalBackend::rail_alltoall(at::Tensor out, at::Tensor in, std::vector<int64_t> out_splits,
                                        std::vector<int64_t> in_splits) {
  TORCH_CHECK(inter_.rail, "cam: a rail all_to_all needs hosts of equal size");
  inter_step(inter_.rail->alltoall_base(out, in, out_splits, in_splits, c10d::AllToAllOptions()));
}

c10::intrusive_ptr<c10d::Work> HierarchicalBackend::barrier(const c10d::BarrierOptions&) {
  return enqueue(c10d::OpType::BARRIER, "barrier", {}, [this] { barrier_all(); });
}

void HierarchicalBackend::monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) {
  // A zero timeout means "now" (gloo's semantics); an unset one, the group's.
  const auto timeout = opts.timeout == c10d::kUnsetTimeout ? local_->engine()->config().timeout : opts.timeout;
  enqueue(c10d::OpType::BARRIER, "monitored_barrier", {},
          [this, timeout, wait_all_ranks] { monitored_barrier_all(timeout, wait_all_ranks); })
      ->wait();
}

}  // namespace cam
