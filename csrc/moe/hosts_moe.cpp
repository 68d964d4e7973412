#include "hosts_moe.hpp"

#include <algorithm>
#include <cstring>
#include <numeric>

#include "../backend/hierarchical_backend.hpp"
#include "../core/errors.hpp"
#include "../runtime/op_issuer.hpp"
#include "gathered_rows.hpp"
#include "moe_args.hpp"

namespace cam::moe {
namespace {

// The shared-expert chunk of rank r's T tokens that goes to shared rank c of S (the rotation of
// dispatch.cpp, which balances the remainder over the shared ranks).
int64_t shared_lo(int64_t r, int64_t c, int64_t T, int64_t S) { return (c + r) * T / S - r * T / S; }

// (n, k) uint8 view of a contiguous tensor's n rows.
at::Tensor row_bytes(const at::Tensor& t) {
  int64_t per_row = int64_t(t.element_size());
  for (int64_t d = 1; d < t.dim(); ++d) per_row *= t.size(d);
  return t.view(-1).view(at::kByte).view({t.size(0), per_row});
}

at::Tensor positions(const std::vector<int64_t>& pos) {
  return at::from_blob(const_cast<int64_t*>(pos.data()), {int64_t(pos.size())}, at::kLong);
}

// Routing header fields (HostsMoe::Header).
enum DispatchField {
  kTokens, kTopK, kExperts, kWidth, kAuxBytes, kMaxTokens, kCapacity, kSlab, kShared, kPerRank, kQuant,
  kHasWeights, kDtype, kHidden, kPrequant, kBadKind, kBadToken, kBadSlot, kBadValue
};
enum CombineField { kRows, kCombineHidden, kSegments, kCombineDtype, kCombineQuant };

}  // namespace

HostsMoe::HostsMoe(c10::intrusive_ptr<c10d::Backend> group, int rank, int size)
    : group_(std::move(group)), rank_(rank), size_(size) {
  TORCH_CHECK(group_, "cam moe: HostsMoe needs the group's backend");
  if (auto* h = dynamic_cast<HierarchicalBackend*>(group_.get())) {
    const HostMap& m = h->host_map();
    if (m.uniform() && m.max_local() > 1) hier_ = h, hosts_ = &m;
  }
}

void HostsMoe::set_two_hop_min_bytes(int64_t n) {
  TORCH_CHECK(n >= 0, "cam moe: two_hop_min_bytes must be >= 0, got ", n);
  two_hop_min_bytes_ = n;
}

std::vector<int64_t> HostsMoe::tokens_per_host(const std::vector<Sent>& sent, const std::vector<int64_t>& at,
                                               int64_t tokens) const {
  std::vector<int64_t> out(hosts_->ranks.size(), 0);
  std::vector<int32_t> counted(size_t(tokens), -1);  // the host a token was last counted for
  for (size_t h = 0; h < hosts_->ranks.size(); ++h) {
    if (int(h) == hosts_->host_of[size_t(rank_)]) continue;  // this host's ranks get their rows directly
    for (int d : hosts_->ranks[h]) {
      for (int64_t r = at[size_t(d)]; r < at[size_t(d) + 1]; ++r) {
        int32_t& mark = counted[size_t(sent[size_t(r)].token)];
        if (mark != int32_t(h)) mark = int32_t(h), ++out[h];
      }
    }
  }
  return out;
}

bool HostsMoe::two_hop(const Agreed& g, const RowsTo& rows_to, int64_t payload) const {
  if (hier_ == nullptr) return false;
  int64_t between = 0;  // rows that cross a link when each goes straight to its receiver
  for (int s = 0; s < size_; ++s)
    for (int d = 0; d < size_; ++d)
      if (hosts_->host_of[size_t(s)] != hosts_->host_of[size_t(d)]) between += rows_to(s, d);
  return between * payload >= two_hop_min_bytes_;
}

// The shape of a dispatch in two hops, for one rank: the descriptor that stands for a record
// on the first hop is the receiver's local index and the row's payload index, then the
// record's tail (weight, token, slot).
struct HostsMoe::TwoHops {
  const HostMap& map;
  const Agreed& g;
  const RowsTo& rows_to;
  int64_t payload, rec, tail, desc, tokens_at;
  int me, hm, lm, hosts, per_host;
  // Distinct tokens rank s sends the ranks of host h (counted by s, agreed by all).
  int64_t tokens(int s, int h) const { return g.extras[size_t(s)][size_t(tokens_at + h)]; }
  int64_t to_host(int s, int h) const {
    int64_t n = 0;
    for (int d : map.ranks[size_t(h)]) n += rows_to(s, d);
    return n;
  }
  int rail_peer(int h, int l) const { return map.ranks[size_t(h)][size_t(l)]; }
};

at::Tensor HostsMoe::first_hop(const TwoHops& x, const uint8_t* records, const std::vector<Sent>& sent,
                               const std::vector<int64_t>& at, const std::vector<int64_t>& bytes) const {
  at::Tensor out = at::empty({std::accumulate(bytes.begin(), bytes.end(), int64_t(0))}, at::kByte);
  uint8_t* o = out.data_ptr<uint8_t>();
  int32_t max_token = 0;
  for (const Sent& r : sent) max_token = std::max(max_token, r.token);
  std::vector<int32_t> index(size_t(max_token) + 1);  // token -> its payload's place in this host's block
  for (int h = 0; h < x.hosts; ++h) {
    if (h == x.hm) continue;
    std::fill(index.begin(), index.end(), -1);
    int32_t unique = 0;
    for (int d : x.map.ranks[size_t(h)])  // payloads, in order of first use
      for (int64_t r = at[size_t(d)]; r < at[size_t(d) + 1]; ++r) {
        int32_t& i = index[size_t(sent[size_t(r)].token)];
        if (i >= 0) continue;
        i = unique++;
        std::memcpy(o, records + r * x.rec, size_t(x.payload));
        o += x.payload;
      }
    TORCH_CHECK(unique == x.tokens(x.me, h), "counted ", x.tokens(x.me, h), " tokens for host ", h, ", packed ", unique);
    for (int d : x.map.ranks[size_t(h)])
      for (int64_t r = at[size_t(d)]; r < at[size_t(d) + 1]; ++r) {
        const int32_t head[2] = {int32_t(x.map.local_of[size_t(d)]), index[size_t(sent[size_t(r)].token)]};
        std::memcpy(o, head, 8);
        std::memcpy(o + 8, records + r * x.rec + x.payload, size_t(x.tail));
        o += x.desc;
      }
  }
  return out;
}

at::Tensor HostsMoe::second_hop(const TwoHops& x, const uint8_t* records, const std::vector<int64_t>& at,
                                const at::Tensor& arrived, const std::vector<int64_t>& arrived_bytes,
                                const std::vector<int64_t>& bytes) const {
  at::Tensor out = at::empty({std::accumulate(bytes.begin(), bytes.end(), int64_t(0))}, at::kByte);
  uint8_t* o = out.data_ptr<uint8_t>();
  // Hop 1's block from each other host: its payloads, then its descriptors (the next unused).
  std::vector<const uint8_t*> payloads(x.hosts), descs(x.hosts);
  const uint8_t* block = arrived.data_ptr<uint8_t>();
  for (int h = 0; h < x.hosts; ++h) {
    payloads[size_t(h)] = block;
    descs[size_t(h)] = block + x.tokens(x.rail_peer(h, x.lm), x.hm) * x.payload;
    block += arrived_bytes[size_t(h)];
  }
  for (int l = 0; l < x.per_host; ++l) {
    const int d = x.rail_peer(x.hm, l);
    for (int h = 0; h < x.hosts; ++h) {
      const int s = x.rail_peer(h, x.lm);
      const int64_t rows = x.rows_to(s, d);
      if (s == x.me) {  // this rank's own records for d
        std::memcpy(o, records + at[size_t(d)] * x.rec, size_t(rows * x.rec));
        o += rows * x.rec;
        continue;
      }
      for (int64_t k = 0; k < rows; ++k, descs[size_t(h)] += x.desc) {
        int32_t head[2];
        std::memcpy(head, descs[size_t(h)], 8);
        TORCH_CHECK(head[0] == l && head[1] >= 0 && head[1] < x.tokens(s, x.hm), "rank ", s,
                    " sent a record for local rank ", head[0], " (payload ", head[1],
                    ") where this rank expects one for local rank ", l);
        std::memcpy(o, payloads[size_t(h)] + int64_t(head[1]) * x.payload, size_t(x.payload));
        std::memcpy(o + x.payload, descs[size_t(h)] + 8, size_t(x.tail));
        o += x.rec;
      }
    }
  }
  return out;
}

at::Tensor HostsMoe::dispatch_two_hop(const at::Tensor& send, const std::vector<Sent>& sent,
                                      const std::vector<int64_t>& at, const Agreed& g, const RowsTo& rows_to,
                                      int64_t payload, std::vector<int>& order) {
  const HostMap& map = *hosts_;
  const int64_t rec = send.size(1);
  const TwoHops x{map, g, rows_to, payload, rec, rec - payload, 8 + rec - payload,
                  g.heads[size_t(rank_)][kExperts] + g.heads[size_t(rank_)][kShared], rank_,
                  map.host_of[size_t(rank_)], map.local_of[size_t(rank_)], map.hosts(), int(map.ranks[0].size())};
  // Bytes of hop 1 to and from each other host, and of hop 2 to and from each rank of this host.
  std::vector<int64_t> in_a(x.hosts, 0), out_a(x.hosts, 0), in_b(x.per_host, 0), out_b(x.per_host, 0);
  for (int h = 0; h < x.hosts; ++h) {
    if (h == x.hm) continue;
    const int s = x.rail_peer(h, x.lm);
    in_a[size_t(h)] = x.tokens(x.me, h) * payload + x.to_host(x.me, h) * x.desc;
    out_a[size_t(h)] = x.tokens(s, x.hm) * payload + x.to_host(s, x.hm) * x.desc;
  }
  for (int l = 0; l < x.per_host; ++l)
    for (int h = 0; h < x.hosts; ++h) {
      in_b[size_t(l)] += rows_to(x.rail_peer(h, x.lm), x.rail_peer(x.hm, l)) * rec;
      out_b[size_t(l)] += rows_to(x.rail_peer(h, l), x.me) * rec;
    }
  const uint8_t* records = send.data_ptr<uint8_t>();
  at::Tensor recv = at::empty({std::accumulate(out_b.begin(), out_b.end(), int64_t(0))}, at::kByte);
  try {
    // Packed and exchanged on the group's worker: a failure anywhere fails the op on every rank.
    hier_->run("moe_dispatch (two hops)", [&] {
      at::Tensor arrived = at::empty({std::accumulate(out_a.begin(), out_a.end(), int64_t(0))}, at::kByte);
      hier_->rail_alltoall(arrived, first_hop(x, records, sent, at, in_a), out_a, in_a);
      hier_->host_alltoall(recv, second_hop(x, records, at, arrived, out_a, in_b), out_b, in_b);
    });
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "cam moe_dispatch on rank ", rank_, ": ", e.what());
  }
  // Blocks arrive by forwarder (local index), then host.
  order.clear();
  for (int l = 0; l < x.per_host; ++l)
    for (int h = 0; h < x.hosts; ++h) order.push_back(x.rail_peer(h, l));
  return recv.view({recv.numel() / rec, rec});
}

void HostsMoe::set_inline_ints(int64_t n) {
  TORCH_CHECK(n >= 0, "cam moe: inline_ints must be >= 0, got ", n);
  inline_ints_ = n;
}

at::Tensor HostsMoe::all_gather(const std::string& op, const at::Tensor& mine) {
  at::Tensor every = at::empty({int64_t(size_) * mine.numel()}, mine.options());
  try {
    at::Tensor in = mine;
    group_->_allgather_base(every, in, c10d::AllgatherOptions())->wait();
  } catch (const std::exception& e) {  // a peer or the group failed: say which op of this rank saw it
    TORCH_CHECK(false, "cam ", op, " on rank ", rank_, ": ", e.what());
  }
  return every;
}

at::Tensor HostsMoe::exchange_rows(const std::string& op, const at::Tensor& send, const std::vector<int64_t>& send_rows,
                                   const std::vector<int64_t>& recv_rows, int64_t width) {
  const int64_t total = std::accumulate(recv_rows.begin(), recv_rows.end(), int64_t(0));
  at::Tensor recv = at::empty({total * width}, at::kByte);
  std::vector<int64_t> out_splits(size_), in_splits(size_);
  for (int p = 0; p < size_; ++p) {
    out_splits[p] = recv_rows[p] * width;
    in_splits[p] = send_rows[p] * width;
  }
  try {
    at::Tensor in = send.view(-1);
    group_->alltoall_base(recv, in, out_splits, in_splits, c10d::AllToAllOptions())->wait();
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "cam ", op, " on rank ", rank_, ": ", e.what());
  }
  return recv.view({total, width});
}

HostsMoe::Agreed HostsMoe::agree(const std::string& op, const Header& header, const std::string& error,
                                 const std::vector<int64_t>& extra) {
  // Record: [refusal text | text bytes, extra length, header, inline extra] (int64 after the text).
  const int64_t ints = 2 + kHeaderInts + inline_ints_;
  const int64_t record = kErrorBytes + 8 * ints;
  at::Tensor mine = at::zeros({record}, at::kByte);
  uint8_t* m = mine.data_ptr<uint8_t>();
  const int64_t text = std::min<int64_t>(int64_t(error.size()), kErrorBytes);
  std::memcpy(m, error.data(), size_t(text));
  auto* mi = reinterpret_cast<int64_t*>(m + kErrorBytes);
  mi[0] = text;
  mi[1] = int64_t(extra.size());
  std::copy(header.begin(), header.end(), mi + 2);
  const bool inline_extra = int64_t(extra.size()) <= inline_ints_;
  if (inline_extra) std::copy(extra.begin(), extra.end(), mi + 2 + kHeaderInts);
  at::Tensor every = all_gather(op, mine);
  const uint8_t* e = every.data_ptr<uint8_t>();
  auto ints_of = [&](int r) { return reinterpret_cast<const int64_t*>(e + r * record + kErrorBytes); };
  for (int i = 0; i < size_; ++i) {
    const int r = i == 0 ? rank_ : (i <= rank_ ? i - 1 : i);  // this rank's own reason first
    const int64_t n = ints_of(r)[0];
    if (n == 0) continue;
    const std::string why(reinterpret_cast<const char*>(e + r * record), size_t(n));
    TORCH_CHECK(false, "cam ", op, " on rank ", rank_, ": ", r == rank_ ? "" : cam::str("rank ", r, " refused its arguments: "),
                why);
  }
  Agreed g;
  int64_t longest = 0;
  for (int r = 0; r < size_; ++r) {
    Header h;
    std::copy(ints_of(r) + 2, ints_of(r) + 2 + kHeaderInts, h.begin());
    g.heads.push_back(h);
    longest = std::max(longest, ints_of(r)[1]);
  }
  g.extras.assign(size_, std::vector<int64_t>(size_t(longest), 0));
  if (longest <= inline_ints_) {
    for (int r = 0; r < size_; ++r) std::copy(ints_of(r) + 2 + kHeaderInts, ints_of(r) + 2 + kHeaderInts + longest,
                                              g.extras[r].begin());
    return g;
  }
  at::Tensor padded = at::zeros({longest}, at::kLong);
  std::copy(extra.begin(), extra.end(), padded.data_ptr<int64_t>());
  at::Tensor all = all_gather(op, padded);
  const int64_t* a = all.data_ptr<int64_t>();
  for (int r = 0; r < size_; ++r) std::copy(a + r * longest, a + (r + 1) * longest, g.extras[r].begin());
  return g;
}

void HostsMoe::refuse(const std::string& kind, const std::string& op, const std::string& reason) {
  TORCH_CHECK(kind == "moe_dispatch" || kind == "moe_combine", "HostsMoe.refuse: '", kind,
              "' is not an MoE op (use all_gather_counts)");
  TORCH_CHECK(!reason.empty(), "HostsMoe.refuse: give the reason");
  agree(op, Header{}, reason, {});
  TORCH_CHECK(false, "unreachable: a refusal raises");
}

at::Tensor HostsMoe::all_gather_counts(const std::string& op, const at::Tensor& counts, const std::string& reason) {
  std::vector<int64_t> mine(size_t(size_), 0);
  if (counts.defined()) {
    at::Tensor c = counts.reshape(-1).to(at::kLong).contiguous();
    mine.assign(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
  }
  Agreed g = agree(op, Header{}, reason, mine);
  const int64_t n = g.extras.empty() ? 0 : int64_t(g.extras[0].size());
  at::Tensor out = at::empty({size_, n}, at::kInt);
  int32_t* o = out.data_ptr<int32_t>();
  for (int r = 0; r < size_; ++r)
    for (int64_t i = 0; i < n; ++i) o[r * n + i] = int32_t(g.extras[r][i]);
  return out;
}

// ---- dispatch --------------------------------------------------------------------------------

void HostsMoe::check_dispatch_headers(const std::vector<Header>& heads) const {
  const Header& me = heads[rank_];
  const std::string where = cam::str("cam moe_dispatch on rank ", rank_);
  auto who = [&](int r) { return r == rank_ ? std::string("this rank") : cam::str("rank ", r); };
  static const std::pair<int, const char*> kSame[] = {
      {kExperts, "moe_expert_num (routed expert ids)"},
      {kTopK, "top-k (expert_ids.size(1))"},
      {kShared, "shared_expert_rank_num"},
      {kPerRank, "experts per rank"},
      {kHidden, "hidden size (x.size(1))"},
      {kWidth, "bytes per token row"},
      {kAuxBytes, "bytes of per-token side data"},
      {kHasWeights, "routing weights given (expert_scales)"},
      {kMaxTokens, "max tokens per rank (global_bs / ep_world_size)"},
      {kPrequant, "int8 rows quantized by the sender (quantization without smooth scales)"}};
  for (int r = 0; r < size_; ++r) {
    const Header& p = heads[r];
    for (const auto& [i, what] : kSame) {
      TORCH_CHECK(p[i] == me[i], where, ": rank ", r, " dispatches with ", what, " = ", p[i], " while this rank uses ",
                  me[i], "; every rank of the EP group must pass the same value");
    }
    TORCH_CHECK(p[kQuant] == me[kQuant], where, ": rank ", r, " dispatches with quant_mode = ", 2 * p[kQuant],
                " while this rank uses ", 2 * me[kQuant], "; every rank of the EP group must pass the same value");
    TORCH_CHECK(p[kDtype] == me[kDtype], where, ": rank ", r, " dispatches ", cam::dtype_name(int(p[kDtype])),
                " tokens while this rank dispatches ", cam::dtype_name(int(me[kDtype])));
    TORCH_CHECK(me[kMaxTokens] != 0 || p[kTokens] == me[kTokens], where, ": ", who(r), " has ", p[kTokens],
                " tokens while this rank has ", me[kTokens],
                "; ranks with different batch sizes must pass global_bs = max tokens per rank * ep_world_size");
    TORCH_CHECK(p[kMaxTokens] <= 0 || p[kTokens] <= p[kMaxTokens], where, ": ", who(r), " has ", p[kTokens],
                " tokens, more than the ", p[kMaxTokens],
                " per rank the outputs are sized for (global_bs / ep_world_size, or num_max_dispatch_tokens_per_rank)");
    if (p[kBadKind] != 0) {
      TORCH_CHECK(false, where, ": ", who(r), ": expert_ids[", p[kBadToken], ", ", p[kBadSlot], "] = ", p[kBadValue],
                  p[kBadKind] == 1 ? cam::str(" is out of range; expected an expert id in [0, ", p[kExperts], ")")
                                   : std::string(" repeats an expert already chosen earlier in that token's row; each "
                                                 "token's expert ids must be distinct"));
    }
  }
}

void HostsMoe::check_capacity(const Agreed& g, int64_t M, int64_t S, int64_t L) const {
  const std::string where = cam::str("cam moe_dispatch on rank ", rank_);
  const int64_t slab = g.heads[rank_][kSlab];
  for (int d = 0; d < size_; ++d) {
    int64_t total = 0;
    if (d < S) {
      for (int r = 0; r < size_; ++r) total += g.extras[r][M + d];
    } else {
      for (int64_t j = 0; j < L; ++j) {
        int64_t per = 0;
        for (int r = 0; r < size_; ++r) per += g.extras[r][(d - S) * L + j];
        TORCH_CHECK(slab <= 0 || per <= slab, where, ": expert ", (d - S) * L + j, " on rank ", d, " receives ", per,
                    " rows but its slab holds ", slab, " (num_max_dispatch_tokens_per_rank * num_ranks)");
        total += per;
      }
    }
    const int64_t cap = g.heads[d][kCapacity];
    TORCH_CHECK(total <= cap, where, ": ", d == rank_ ? std::string("this rank") : cam::str("rank ", d), " would receive ",
                total, " rows but its output holds ", cap,
                " (sized from global_bs and the expert layout); pass a global_bs that bounds every rank's tokens");
  }
}

void HostsMoe::dispatch(const MoeDispatchArgs& a) {
  const int W = size_, me = rank_;
  const int64_t M = a.num_experts, S = a.shared_ranks, L = a.experts_per_rank;
  std::string refusal;  // this rank's argument error: every rank raises it, naming this rank
  try {
    check_dispatch_args(a, me, W);
    // Routed expert e lives on rank S + e / L: the layout must tile the routed ranks exactly.
    CAM_CHECK_ARG(M == (W - S) * L, "invalid expert layout: ", M, " routed experts over ", W - S, " ranks of ", L,
                  " experts each");
  } catch (...) {
    refusal = argument_error_reason();
  }
  const bool ok = refusal.empty();
  const bool prequant = a.quant && !a.smooth.defined();
  const int64_t T = ok ? a.rows.size(0) : 0, H = ok ? a.rows.size(1) : 0, K = ok ? a.ids.size(1) : 0;
  const int64_t cap = ok ? a.out_rows.size(0) : 0, width = ok ? H * int64_t(a.rows.element_size()) : 0;
  const int64_t aux_bytes = ok && a.aux.defined() ? a.aux.size(1) : 0;

  // Header and counts (rows per expert, then per shared-expert rank).
  Header header{};
  std::vector<int64_t> counts;
  const int32_t* ids = ok ? a.ids.data_ptr<int32_t>() : nullptr;
  const bool* active = ok ? a.token_active.data_ptr<bool>() : nullptr;
  if (ok) {
    int64_t bad_kind = 0, bad_t = 0, bad_k = 0, bad_value = 0;
    for (int64_t t = 0; t < T && bad_kind == 0; ++t) {
      for (int64_t k = 0; k < K && bad_kind == 0; ++k) {
        const int32_t e = ids[t * K + k];
        if (e == -1) continue;
        if (e < 0 || e >= M) {
          bad_kind = 1;
        } else {
          for (int64_t k2 = 0; k2 < k; ++k2)
            if (ids[t * K + k2] == e) bad_kind = 2;
        }
        if (bad_kind) bad_t = t, bad_k = k, bad_value = e;
      }
    }
    header = {T, K, M, width, aux_bytes, a.max_tokens, cap, a.slab_rows, S, L, int64_t(a.quant),
              int64_t(a.weights.defined()), int64_t(a.rows.scalar_type()), H, int64_t(prequant), bad_kind, bad_t,
              bad_k, bad_value};
    counts.assign(size_t(M + S), 0);
    for (int64_t i = 0; i < T * K; ++i)
      if (ids[i] >= 0 && ids[i] < M) ++counts[ids[i]];
  }

  // The rows this rank sends, in destination order: each shared rank's chunk of active tokens,
  // then the routed entries grouped by expert, (token, slot) order within an expert. Counts
  // per shared rank follow from the chunks.
  std::vector<Sent> sent;
  std::vector<int64_t> send_rows(W, 0), starts(size_t(W) + 1, 0);  // starts: each destination's first record
  if (ok) {
    for (int64_t d = 0; d < S; ++d) {
      if (me != d && me < S) continue;
      const int64_t lo = me == d ? 0 : shared_lo(me, d, T, S), hi = me == d ? T : shared_lo(me, d + 1, T, S);
      const size_t before = sent.size();
      for (int64_t t = lo; t < hi; ++t)
        if (active[t]) sent.push_back({int32_t(t), -1});
      send_rows[d] = counts[M + d] = int64_t(sent.size() - before);
    }
    std::vector<int64_t> fill(size_t(M + 1), 0);
    for (int64_t e = 0; e < M; ++e) fill[e + 1] = fill[e] + counts[e];
    const size_t routed_at = sent.size();
    sent.resize(routed_at + size_t(fill[M]));
    for (int64_t i = 0; i < T * K; ++i) {
      const int32_t e = ids[i];
      if (e >= 0 && e < M) sent[routed_at + size_t(fill[e]++)] = {int32_t(i / K), int32_t(i % K)};
    }
    for (int64_t e = 0; e < M; ++e) send_rows[S + e / L] += counts[e];
    for (int d = 0; d < W; ++d) starts[size_t(d) + 1] = starts[size_t(d)] + send_rows[size_t(d)];
    // Where two hops are possible, every rank also says how many distinct tokens it sends each host.
    if (hier_) {
      const auto tokens = tokens_per_host(sent, starts, T);
      counts.insert(counts.end(), tokens.begin(), tokens.end());
    }
  }
  const Agreed g = agree("moe_dispatch", header, refusal, counts);
  check_dispatch_headers(g.heads);
  check_capacity(g, M, S, L);

  // One record per row: the row (or int8 + scale), side data, weight, token and slot.
  const bool has_w = a.weights.defined();
  const int64_t row_len = prequant ? H + 4 : width;
  const int64_t rec = row_len + aux_bytes + (has_w ? 4 : 0) + 8;
  at::Tensor q, q_scales;
  if (prequant) {
    q = at::empty({T, H}, at::kChar);
    q_scales = at::empty({T}, at::kFloat);
    quantize_rows(a.rows, at::Tensor(), at::Tensor(), q, q_scales);
  }
  at::Tensor send = at::empty({int64_t(sent.size()), rec}, at::kByte);
  {
    uint8_t* s = send.data_ptr<uint8_t>();
    const char* rows = static_cast<const char*>(a.rows.data_ptr());
    const float* w = has_w ? a.weights.data_ptr<float>() : nullptr;
    const uint8_t* aux = aux_bytes ? a.aux.data_ptr<uint8_t>() : nullptr;
    for (const Sent& r : sent) {
      uint8_t* o = s;
      if (prequant) {
        std::memcpy(o, q.data_ptr<int8_t>() + r.token * H, size_t(H));
        std::memcpy(o + H, q_scales.data_ptr<float>() + r.token, 4);
      } else {
        std::memcpy(o, rows + r.token * width, size_t(width));
      }
      o += row_len;
      if (aux_bytes) std::memcpy(o, aux + r.token * aux_bytes, size_t(aux_bytes)), o += aux_bytes;
      if (has_w) {
        const float v = r.slot >= 0 ? w[r.token * K + r.slot] : 0.0f;
        std::memcpy(o, &v, 4);
        o += 4;
      }
      std::memcpy(o, &r, 8);
      s += rec;
    }
  }
  // Rows rank s sends rank d, from everyone's counts.
  auto rows_to = [&](int s, int d) {
    if (d < S) return g.extras[s][M + d];
    int64_t n = 0;
    for (int64_t j = 0; j < L; ++j) n += g.extras[s][(d - S) * L + j];
    return n;
  };
  std::vector<int64_t> recv_rows(W, 0);
  for (int p = 0; p < W; ++p) recv_rows[p] = rows_to(p, me);
  // The sources' blocks lie in `order` in what arrives: rank order, or by forwarder with two hops.
  std::vector<int> order(W);
  std::iota(order.begin(), order.end(), 0);
  const bool hops = two_hop(g, rows_to, row_len + aux_bytes);
  const at::Tensor recv = hops ? dispatch_two_hop(send, sent, starts, g, rows_to, row_len + aux_bytes, order)
                               : exchange_rows("moe_dispatch", send, send_rows, recv_rows, rec);
  ++(hops ? two_hop_dispatches_ : direct_dispatches_);

  // Where each received row goes (a source's rows arrive in expert order), and ep_recv_counts.
  const int64_t n = recv.size(0);
  std::vector<int64_t> pos(static_cast<size_t>(n)), src(static_cast<size_t>(n)), smooth_row(static_cast<size_t>(n), 0);
  int32_t* out_counts = a.out_counts.data_ptr<int32_t>();
  std::vector<int64_t> block(size_t(W * (me < S ? 1 : L)));  // [src][j]: where src's rows of expert j start
  if (me < S) {
    for (int64_t ch = 0; ch < S; ++ch) {
      int64_t own = 0;
      for (int64_t t = 0; t < shared_lo(me, ch + 1, T, S); ++t) own += active[t];
      out_counts[ch] = int32_t(own);
    }
    int64_t running = 0;
    for (int p = 0; p < W; ++p) {
      block[size_t(p)] = running;  // a shared rank's rows lie in source order
      running += recv_rows[p];
      if (p >= S) out_counts[p] = int32_t(running);
    }
  } else {
    int64_t running = 0;
    for (int64_t j = 0; j < L; ++j) {
      int64_t before_src = 0;  // rows of expert j from earlier sources
      for (int p = 0; p < W; ++p) {
        const int64_t rows = g.extras[p][(me - S) * L + j];
        block[size_t(p * L + j)] = a.slab_rows > 0 ? j * a.slab_rows + before_src : running;
        before_src += rows;
        running += rows;
        out_counts[j * W + p] = int32_t(running);
      }
    }
  }
  int64_t i = 0;
  for (int p : order) {
    const int64_t groups = me < S ? 1 : L;
    for (int64_t j = 0; j < groups; ++j) {
      const int64_t rows = me < S ? recv_rows[p] : g.extras[p][(me - S) * L + j];
      for (int64_t k = 0; k < rows; ++k, ++i) {
        pos[size_t(i)] = block[size_t(p * groups + j)] + k;
        src[size_t(i)] = p;
        if (me >= S) smooth_row[size_t(i)] = (me - S) * L + j + a.smooth_shift;
      }
    }
  }
  const at::Tensor at_pos = positions(pos);
  int64_t col = 0;
  if (prequant) {
    at::Tensor dst = row_bytes(a.out_rows), dst_scales = row_bytes(a.out_scales.view({-1, 1}));
    place_rows(recv.narrow(1, 0, H), at_pos, dst);
    place_rows(recv.narrow(1, H, 4), at_pos, dst_scales);
    col = H + 4;
  } else if (a.quant) {
    at::Tensor raw = recv.narrow(1, 0, width).contiguous().view(a.rows.scalar_type()).view({n, H});
    at::Tensor qr = at::empty({n, H}, at::kChar), qs = at::empty({n}, at::kFloat);
    quantize_rows(raw, a.smooth, positions(smooth_row), qr, qs);
    at::Tensor dst = row_bytes(a.out_rows), dst_scales = row_bytes(a.out_scales.view({-1, 1}));
    place_rows(row_bytes(qr), at_pos, dst);
    place_rows(row_bytes(qs.view({-1, 1})), at_pos, dst_scales);
    col = width;
  } else {
    at::Tensor dst = row_bytes(a.out_rows);
    place_rows(recv.narrow(1, 0, width), at_pos, dst);
    col = width;
  }
  if (aux_bytes) {
    if (a.out_aux.defined()) {
      at::Tensor dst = a.out_aux;
      place_rows(recv.narrow(1, col, aux_bytes), at_pos, dst);
    }
    col += aux_bytes;
  }
  const uint8_t* r = recv.data_ptr<uint8_t>();
  if (a.out_weights.defined()) {
    float* ow = a.out_weights.data_ptr<float>();
    for (int64_t i = 0; i < n; ++i) {
      float v = 0.0f;
      if (has_w) std::memcpy(&v, r + i * rec + col, 4);
      ow[pos[size_t(i)]] = v;
    }
  }
  if (has_w) col += 4;
  if (a.out_info.defined()) {
    int32_t* info = a.out_info.data_ptr<int32_t>();
    for (int64_t i = 0; i < n; ++i) {
      int32_t* row = info + pos[size_t(i)] * a.info_stride;
      row[0] = int32_t(src[size_t(i)]);
      std::memcpy(row + 1, r + i * rec + col, 8);
    }
  }
  if (a.out_occurrence.defined()) {  // expand_idx: the entry's place among this rank's entries of its expert
    int32_t* occ = a.out_occurrence.data_ptr<int32_t>();
    std::vector<int32_t> seen(size_t(M), 0);
    for (int64_t i = 0; i < T * K; ++i) occ[i] = ids[i] >= 0 ? seen[size_t(ids[i])]++ : -1;
  }
}

// ---- combine ---------------------------------------------------------------------------------

// One rank's combine against the agreed tables: every rank's segments (which rows it serves
// whom), and, where two hops are possible, how many tokens and plan entries each rank has on
// each host; and this rank's plan, checked entry by entry against those tables.
struct HostsMoe::CombinePlan {
  const Agreed& g;
  int64_t H, width;  // hidden size; bytes per row as sent (int8 + scale under quantization)
  bool quant;
  at::ScalarType dtype;  // of the served rows
  int64_t T, P;          // this rank's plan: tokens, entries per token
  const int32_t* peer;
  const int32_t* seg;
  const int64_t* off;
  const float* weight;        // null: 1
  std::vector<uint8_t> good;  // [T * P]: the entry names a row that exists and is this rank's
  std::string bad;            // the first bad entry, said as the error this rank raises

  int64_t segments(int p) const { return g.heads[size_t(p)][kSegments]; }
  // seg(p, s) = [first, rows, owner] of rank p's segment s.
  const int64_t* segment(int p, int64_t s) const { return &g.extras[size_t(p)][size_t(3 * s)]; }
  // Rank s's tokens with entries on host h, and those entries (as counted by plan_per_host).
  int64_t tokens(int s, int h) const { return g.extras[size_t(s)][size_t(3 * segments(s) + 2 * h)]; }
  int64_t entries(int s, int h) const { return g.extras[size_t(s)][size_t(3 * segments(s) + 2 * h + 1)]; }
};

namespace {

// [tokens, entries] on each host of the plan's entries that name a rank of the group, 2 per host.
std::vector<int64_t> plan_per_host(const MoeCombineArgs& a, const HostMap& hosts, int size) {
  const int64_t T = a.plan_peer.size(0), P = a.plan_peer.size(1);
  const int32_t* peer = a.plan_peer.data_ptr<int32_t>();
  std::vector<int64_t> out(size_t(2 * hosts.hosts()), 0);
  std::vector<int64_t> seen(size_t(hosts.hosts()), -1);  // the last token counted per host
  for (int64_t t = 0; t < T; ++t)
    for (int64_t s = 0; s < P; ++s) {
      const int32_t p = peer[t * P + s];
      if (p < 0 || p >= size) continue;
      const int h = hosts.host_of[size_t(p)];
      if (seen[size_t(h)] != t) seen[size_t(h)] = t, ++out[size_t(2 * h)];
      ++out[size_t(2 * h + 1)];
    }
  return out;
}

}  // namespace

bool HostsMoe::combine_in_two_hops(const CombinePlan& c) const {
  if (hier_ == nullptr) return false;
  const HostMap& m = *hosts_;
  int64_t rows = 0, hops = 0;  // bytes between hosts: each row on its own; in two hops
  for (int p = 0; p < size_; ++p) {
    for (int64_t s = 0; s < c.segments(p); ++s) {
      const int64_t* e = c.segment(p, s);
      if (m.host_of[size_t(e[2])] != m.host_of[size_t(p)]) rows += e[1] * c.width;
    }
    for (int h = 0; h < m.hosts(); ++h)
      if (h != m.host_of[size_t(p)]) hops += c.tokens(p, h) * (4 + 4 * c.H) + c.entries(p, h) * 16;
  }
  return rows >= two_hop_min_bytes_ && (two_hop_min_bytes_ == 0 || hops < rows);
}

std::vector<int> HostsMoe::host_of() const { return hosts_ ? hosts_->host_of : std::vector<int>(); }

void HostsMoe::combine(const MoeCombineArgs& a) {
  const int W = size_, me = rank_;
  std::string refusal;  // this rank's argument error: every rank raises it, naming this rank
  try {
    check_combine_args(a, W);
  } catch (...) {
    refusal = argument_error_reason();
  }
  const bool ok = refusal.empty();
  const int64_t n = ok ? a.rows.size(0) : 0, H = ok ? a.rows.size(1) : 0, nseg = ok ? a.segments.size(0) : 0;
  Header header{};
  std::vector<int64_t> table;
  if (ok) {
    header[kRows] = n;
    header[kCombineHidden] = H;
    header[kSegments] = nseg;
    header[kCombineDtype] = int64_t(a.rows.scalar_type());
    header[kCombineQuant] = int64_t(a.quant);
    table.assign(a.segments.data_ptr<int64_t>(), a.segments.data_ptr<int64_t>() + 3 * nseg);
    if (hier_) {  // what two hops would carry
      const auto per_host = plan_per_host(a, *hosts_, W);
      table.insert(table.end(), per_host.begin(), per_host.end());
    }
  }
  const Agreed g = agree("moe_combine", header, refusal, table);
  const std::string where = cam::str("cam moe_combine on rank ", me);
  int first_serving = -1;
  for (int r = 0; r < W; ++r) {
    const Header& p = g.heads[r];
    TORCH_CHECK(p[kCombineQuant] == g.heads[me][kCombineQuant], where, ": rank ", r, " combines with comm_quant_mode ",
                2 * p[kCombineQuant], " while this rank uses ", 2 * g.heads[me][kCombineQuant],
                "; every rank must pass the same value");
  }
  for (int r = 0; r < W; ++r) {
    const Header& p = g.heads[r];
    if (p[kRows] <= 0) continue;
    if (first_serving < 0) first_serving = r;
    TORCH_CHECK(p[kCombineHidden] == H, where, ": rank ", r, " returns rows of hidden size ", p[kCombineHidden],
                " while this rank combines into rows of ", H);
    TORCH_CHECK(p[kCombineDtype] == g.heads[first_serving][kCombineDtype], where, ": rank ", r, " returns ",
                cam::dtype_name(int(p[kCombineDtype])), " rows while rank ", first_serving, " returns ",
                cam::dtype_name(int(g.heads[first_serving][kCombineDtype])), "; every rank must return one dtype");
  }
  const auto dtype = first_serving >= 0 ? at::ScalarType(g.heads[first_serving][kCombineDtype]) : a.rows.scalar_type();
  const int64_t elem = int64_t(c10::elementSize(dtype));
  CombinePlan c{g, H, a.quant ? H + 4 : H * elem, a.quant, dtype, a.plan_peer.size(0), a.plan_peer.size(1),
                a.plan_peer.data_ptr<int32_t>(), a.plan_seg.data_ptr<int32_t>(), a.plan_off.data_ptr<int64_t>(),
                a.plan_weight.defined() ? a.plan_weight.data_ptr<float>() : nullptr, {}, {}};

  // The plan against what every peer serves (a bad plan fails this rank, after its peers have
  // their rows: as on one host).
  c.good.assign(size_t(c.T * c.P), 0);
  for (int64_t i = 0; i < c.T * c.P; ++i) {
    const int64_t p = c.peer[i], s = c.seg[i], o = c.off[i];
    if (p < 0) continue;
    std::string what;
    if (p >= W) {
      what = cam::str("names rank ", p, " outside the group of ", W);
    } else if (s < 0 || s >= c.segments(int(p))) {
      what = cam::str("names segment ", s, " of rank ", p, ", which serves ", c.segments(int(p)),
                      " segments (ep_send_counts / handle from another dispatch?)");
    } else {
      const int64_t* e = c.segment(int(p), s);
      if (o < 0 || o >= e[1] || e[0] + o >= g.heads[p][kRows])
        what = cam::str("names row ", o, " of segment ", s, " of rank ", p, ", which holds ", e[1],
                        " rows there and returns ", g.heads[p][kRows], " in all (expand_idx / handle from another "
                        "dispatch, or expand_x shorter than dispatch produced?)");
      else if (e[2] != me)
        what = cam::str("names segment ", s, " of rank ", p, ", which holds rank ", e[2], "'s tokens, not this rank's");
    }
    if (what.empty()) c.good[size_t(i)] = 1;
    else if (c.bad.empty()) c.bad = cam::str(where, ": token ", i / c.P, " slot ", i % c.P, ": ", what);
  }
  // The served rows as they travel: as they are, or int8 + scale.
  at::Tensor rows;
  if (n == 0) {
    rows = at::empty({0, c.width}, at::kByte);
  } else if (a.quant) {
    at::Tensor q = at::empty({n, H}, at::kChar), qs = at::empty({n}, at::kFloat);
    quantize_rows(a.rows, at::Tensor(), at::Tensor(), q, qs);
    rows = at::cat({row_bytes(q), row_bytes(qs.view({-1, 1}))}, 1);
  } else {
    rows = row_bytes(a.rows);
  }
  if (combine_in_two_hops(c)) {
    combine_two_hop(c, a, rows);
    ++two_hop_combines_;
    return;
  }
  ++direct_combines_;

  // The rows this rank sends each owner: its segments of that owner, in segment order.
  std::vector<int64_t> send_rows(W, 0), send_index;
  for (int s = 0; s < W; ++s) {
    for (int64_t i = 0; i < nseg; ++i) {
      const int64_t* e = c.segment(me, i);
      if (e[2] != s) continue;
      for (int64_t k = 0; k < e[1]; ++k) send_index.push_back(e[0] + k);
      send_rows[s] += e[1];
    }
  }
  at::Tensor send = at::empty({int64_t(send_index.size()), c.width}, at::kByte);
  uint8_t* to = send.data_ptr<uint8_t>();
  const uint8_t* from = rows.data_ptr<uint8_t>();
  for (size_t i = 0; i < send_index.size(); ++i)
    std::memcpy(to + i * c.width, from + send_index[i] * c.width, size_t(c.width));
  // Each peer's segments of this rank: where their rows land in the received buffer.
  std::vector<int64_t> recv_rows(W, 0);
  std::vector<std::vector<int64_t>> seg_base(W);
  int64_t base = 0;
  for (int p = 0; p < W; ++p) {
    seg_base[p].assign(size_t(std::max<int64_t>(c.segments(p), 1)), 0);
    for (int64_t s = 0; s < c.segments(p); ++s) {
      seg_base[p][size_t(s)] = base;
      if (c.segment(p, s)[2] == me) base += c.segment(p, s)[1], recv_rows[p] += c.segment(p, s)[1];
    }
  }
  const at::Tensor recv = exchange_rows("moe_combine", send, send_rows, recv_rows, c.width);
  TORCH_CHECK(c.bad.empty(), c.bad);
  at::Tensor index = at::empty({c.T, c.P}, at::kLong);
  int64_t* idx = index.data_ptr<int64_t>();
  for (int64_t i = 0; i < c.T * c.P; ++i)
    idx[i] = c.good[size_t(i)] ? seg_base[size_t(c.peer[i])][size_t(c.seg[i])] + c.off[i] : -1;
  at::Tensor rows_in, scales_in;
  if (a.quant) {
    rows_in = recv.narrow(1, 0, H).contiguous().view(at::kChar);
    scales_in = recv.narrow(1, H, 4).contiguous().view(at::kFloat).view(-1);
  } else {
    rows_in = recv.view(dtype).view({-1, H});
  }
  at::Tensor out = a.out;
  weighted_sum_rows(rows_in, scales_in, index, a.plan_weight, a.add, a.add_first, out);
}

// Combine in two hops (DeepEP's normal mode, and the way back of dispatch_two_hop). A served row
// goes first, over this host's shared memory, to the rank of its owner's local index here (the
// owner itself when it is on this host). That rank sums, for each token of its rail peer on
// another host, the token's rows on this host: in float32, in the owner's slot order, weighted
// by the owner's plan, which reached it over the rail before; and returns one float32 partial
// per token over the rail. The owner then sums, in slot order, its own host's rows and each
// other host's partial in the place of that host's first slot. So rows cross a link summed, not
// one by one, and the sum's order (its last bits) differs from the direct path's wherever a
// token has rows on a host other than its owner's; moe_reference's `hosts` gives the same sums.
//   hop 1, rail:  per token with entries there (token order) its entry count, then the entries:
//                 16 bytes each (local index of the serving rank, its segment, offset, weight;
//                 local index -1: an entry this rank found bad, skipped)
//   hop 2, host:  served rows, to the rank of their owner's local index, in segment order
//   hop 3, rail:  float32 partial sums, one per token with entries on the sender's host
void HostsMoe::combine_two_hop(const CombinePlan& c, const MoeCombineArgs& a, const at::Tensor& rows) {
  struct Entry {
    int32_t local, seg, off;
    float weight;
  };
  static_assert(sizeof(Entry) == 16);
  const HostMap& m = *hosts_;
  const int me = rank_, hm = m.host_of[size_t(me)], lm = m.local_of[size_t(me)], hosts = m.hosts();
  const int L = int(m.ranks[0].size());
  auto rail_peer = [&](int h, int l) { return m.ranks[size_t(h)][size_t(l)]; };
  const int64_t H = c.H, partial = 4 * H;

  // Hop 1: this rank's plan for each other host.
  std::vector<int64_t> in_a(hosts, 0), out_a(hosts, 0);
  for (int h = 0; h < hosts; ++h) {
    if (h == hm) continue;
    in_a[size_t(h)] = 4 * c.tokens(me, h) + 16 * c.entries(me, h);
    out_a[size_t(h)] = 4 * c.tokens(rail_peer(h, lm), hm) + 16 * c.entries(rail_peer(h, lm), hm);
  }
  // Packed on the group's worker (as all below): a failure there fails the op on every rank.
  auto pack_plans = [&] {
    at::Tensor send_a = at::empty({std::accumulate(in_a.begin(), in_a.end(), int64_t(0))}, at::kByte);
    uint8_t* o = send_a.data_ptr<uint8_t>();
    for (int h = 0; h < hosts; ++h) {
      if (h == hm) continue;
      uint8_t* counts = o;
      uint8_t* entries = o + 4 * c.tokens(me, h);  // 16-byte entries, 4-byte aligned
      int64_t tokens = 0, n = 0;
      for (int64_t t = 0; t < c.T; ++t) {
        int32_t here = 0;
        for (int64_t s = 0; s < c.P; ++s) {
          const int64_t i = t * c.P + s;
          const int32_t p = c.peer[i];
          if (p < 0 || p >= size_ || m.host_of[size_t(p)] != h) continue;
          Entry e{-1, 0, 0, 0.f};
          if (c.good[size_t(i)])
            e = {int32_t(m.local_of[size_t(p)]), c.seg[i], int32_t(c.off[i]), c.weight ? c.weight[i] : 1.f};
          std::memcpy(entries + 16 * n++, &e, sizeof e);
          ++here;
        }
        if (here > 0) std::memcpy(counts + 4 * tokens++, &here, 4);
      }
      TORCH_CHECK(tokens == c.tokens(me, h) && n == c.entries(me, h), "counted ", c.tokens(me, h), " tokens and ",
                  c.entries(me, h), " entries for host ", h, ", packed ", tokens, " and ", n);
      o += in_a[size_t(h)];
    }
    return send_a;
  };
  // Hop 2: served rows to the rank of their owner's local index; `base[l][s]`: where local rank
  // l's segment s starts among the rows that arrive here.
  std::vector<int64_t> in_b(L, 0), out_b(L, 0);
  std::vector<std::vector<int64_t>> base(L);
  int64_t arrived = 0;
  for (int l = 0; l < L; ++l) {
    const int p = rail_peer(hm, l);
    base[size_t(l)].assign(size_t(std::max<int64_t>(c.segments(p), 1)), 0);
    for (int64_t s = 0; s < c.segments(p); ++s) {
      const int64_t* e = c.segment(p, s);
      base[size_t(l)][size_t(s)] = arrived;
      if (m.local_of[size_t(e[2])] == lm) arrived += e[1], out_b[size_t(l)] += e[1] * c.width;
    }
  }
  for (int64_t s = 0; s < c.segments(me); ++s)
    in_b[size_t(m.local_of[size_t(c.segment(me, s)[2])])] += c.segment(me, s)[1] * c.width;
  auto pack_rows = [&] {
    at::Tensor send_b = at::empty({std::accumulate(in_b.begin(), in_b.end(), int64_t(0))}, at::kByte);
    uint8_t* o = send_b.data_ptr<uint8_t>();
    const uint8_t* from = rows.data_ptr<uint8_t>();
    for (int l = 0; l < L; ++l)
      for (int64_t s = 0; s < c.segments(me); ++s) {
        const int64_t* e = c.segment(me, s);
        if (m.local_of[size_t(e[2])] != l) continue;
        std::memcpy(o, from + e[0] * c.width, size_t(e[1] * c.width));
        o += e[1] * c.width;
      }
    return send_b;
  };
  // Hop 3: a partial per token of each rail peer with entries on this host.
  std::vector<int64_t> in_c(hosts, 0), out_c(hosts, 0);
  for (int h = 0; h < hosts; ++h) {
    if (h == hm) continue;
    in_c[size_t(h)] = c.tokens(rail_peer(h, lm), hm) * partial;
    out_c[size_t(h)] = c.tokens(me, h) * partial;
  }
  at::Tensor recv_b = at::empty({arrived * c.width}, at::kByte);
  at::Tensor recv_c = at::empty({std::accumulate(out_c.begin(), out_c.end(), int64_t(0))}, at::kByte);
  const c10::ScalarType row_dtype = c.quant ? at::kChar : c.dtype;
  // Adds the row that arrived in hop 2 from local rank l's segment s, row o, to `terms`.
  auto add_served = [&](RowTerms& terms, int l, int64_t s, int64_t o, float w) {
    const uint8_t* row = recv_b.data_ptr<uint8_t>() + (base[size_t(l)][size_t(s)] + o) * c.width;
    float scale = 1.f;
    if (c.quant) std::memcpy(&scale, row + H, 4);
    terms.add(row, row_dtype, w, scale);
  };
  try {
    hier_->run("moe_combine (two hops)", [&] {
      at::Tensor recv_a = at::empty({std::accumulate(out_a.begin(), out_a.end(), int64_t(0))}, at::kByte);
      hier_->rail_alltoall(recv_a, pack_plans(), out_a, in_a);
      hier_->host_alltoall(recv_b, pack_rows(), out_b, in_b);
      RowTerms terms;
      const uint8_t* block = recv_a.data_ptr<uint8_t>();
      for (int h = 0; h < hosts; ++h) {
        if (h == hm) continue;
        const int s = rail_peer(h, lm);
        const int64_t tokens = c.tokens(s, hm);
        const uint8_t* e = block + 4 * tokens;
        int64_t left = c.entries(s, hm);  // what rank s said it sends: no count may read past it
        for (int64_t t = 0; t < tokens; ++t) {
          int32_t count;
          std::memcpy(&count, block + 4 * t, 4);
          TORCH_CHECK(count > 0 && count <= left, "rank ", s, " sent ", count, " plan entries for its token ", t,
                      " on this host, with ", left, " of its ", c.entries(s, hm), " left");
          left -= count;
          for (int32_t k = 0; k < count; ++k, e += 16) {
            Entry x;
            std::memcpy(&x, e, 16);
            if (x.local < 0) continue;  // the owner found it bad and raises
            const int p = x.local < L ? rail_peer(hm, x.local) : -1;
            const int64_t* sg = p >= 0 && x.seg >= 0 && x.seg < c.segments(p) ? c.segment(p, x.seg) : nullptr;
            TORCH_CHECK(sg && sg[2] == s && x.off >= 0 && x.off < sg[1], "rank ", s, " sent a plan entry (local rank ",
                        x.local, ", segment ", x.seg, ", row ", x.off, ") that names no row of its own on this host");
            add_served(terms, x.local, x.seg, x.off, x.weight);
          }
          terms.end_token();
        }
        block += out_a[size_t(h)];
      }
      at::Tensor sums = at::empty({terms.tokens(), H}, at::kFloat);
      sum_row_terms(terms, at::Tensor(), false, sums);
      hier_->rail_alltoall(recv_c, sums.view(-1).view(at::kByte), out_c, in_c);
    });
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "cam moe_combine on rank ", rank_, ": ", e.what());
  }
  TORCH_CHECK(c.bad.empty(), c.bad);

  // This rank's tokens: its host's rows and the other hosts' partials, in slot order.
  std::vector<const uint8_t*> partials(hosts, nullptr);  // the next partial from each host
  {
    const uint8_t* p = recv_c.data_ptr<uint8_t>();
    for (int h = 0; h < hosts; ++h) partials[size_t(h)] = p, p += out_c[size_t(h)];
  }
  RowTerms terms;
  std::vector<int64_t> taken(hosts, -1);  // the last token that took each host's partial
  for (int64_t t = 0; t < c.T; ++t) {
    for (int64_t s = 0; s < c.P; ++s) {
      const int64_t i = t * c.P + s;
      if (c.peer[i] < 0) continue;
      const int p = c.peer[i], h = m.host_of[size_t(p)];
      if (h == hm) {
        add_served(terms, m.local_of[size_t(p)], c.seg[i], c.off[i], c.weight ? c.weight[i] : 1.f);
      } else if (taken[size_t(h)] != t) {
        taken[size_t(h)] = t;
        terms.add(partials[size_t(h)], at::kFloat, 1.f, 1.f);
        partials[size_t(h)] += partial;
      }
    }
    terms.end_token();
  }
  at::Tensor out = a.out;
  sum_row_terms(terms, a.add, a.add_first, out);
}

}  // namespace cam::moe
