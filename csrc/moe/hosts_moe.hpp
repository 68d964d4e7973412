// HostsMoe: MoE dispatch and combine on a group whose ranks span hosts (or on a group whose
// backend is cam's one-sided engine alone, as the in-process test transport's groups are). It
// takes the single-host ops' arguments (MoeDispatchArgs, MoeCombineArgs) and gives the same
// outputs bit for bit (but for the order of combine_two_hop's sum), over the group's own
// collectives, so that the rows travel over shared memory inside a host and over UCX (or the
// gloo fallback) between hosts. An op is, on the group's c10d backend, called from here and
// complete before the call returns:
//
//   1. an all-gather of every rank's fixed-size record: its refusal text (argument errors are
//      found before anything moves), a header of shapes and options (every rank checks every
//      rank's against its own and names the one that differs), and its counts (dispatch: rows
//      per expert and per shared-expert rank, so every rank checks every receiver's capacity
//      alike; combine: its segment table). Counts past kInlineInts take a second all-gather
//      padded to the longest;
//   2. one all_to_all_single of packed rows: each row a receiver gets is sent once, in the
//      order the receiver lays out one source's rows (dispatch: the row, int8 + scale when the
//      sender can quantize (no per-expert smooth scales), side data, weight, token and slot;
//      combine: int8 + scale under comm quantization), and the receiver places, quantizes or
//      weights them from that one buffer with the single-host kernels (gathered_rows.hpp).
//      Where hosts hold equally many ranks, more than one each, large ops cross hosts in two
//      hops instead, once per token and host (dispatch_two_hop, combine_two_hop).
//
// The index math is plain loops over the counts: no tensor op per step, so a decode-sized call
// costs its two collectives and little else.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <array>
#include <functional>
#include <string>
#include <vector>

#include "moe_ops.hpp"

namespace cam {
class HierarchicalBackend;
struct HostMap;
}

namespace cam::moe {

class HostsMoe {
 public:
  static constexpr int kHeaderInts = 24;
  static constexpr int64_t kErrorBytes = 1024;
  static constexpr int64_t kInlineInts = 256;

  HostsMoe(c10::intrusive_ptr<c10d::Backend> group, int rank, int size);

  void dispatch(const MoeDispatchArgs& a);
  void combine(const MoeCombineArgs& a);
  // Takes part in the group's next MoE op as a refusal of this rank's arguments: every rank
  // raises naming this rank and `reason` (here too).
  [[noreturn]] void refuse(const std::string& kind, const std::string& op, const std::string& reason);
  // (W, n) every rank's `counts` (n int32 each; undefined: W zeros), or, when any rank passes
  // a non-empty `reason`, its refusal raised on every rank.
  at::Tensor all_gather_counts(const std::string& op, const at::Tensor& counts, const std::string& reason);
  const c10::intrusive_ptr<c10d::Backend>& backend() const { return group_; }
  int rank() const { return rank_; }
  int size() const { return size_; }
  // Counts that ride inline in the first all-gather (tests lower it to exercise the second).
  int64_t inline_ints() const { return inline_ints_; }
  void set_inline_ints(int64_t n);
  // Dispatch rows cross hosts in two hops (see dispatch_two_hop) when the group's hosts hold
  // equally many ranks, more than one each, and the bytes between hosts reach this; combine
  // does (combine_two_hop) when they reach it and its partial sums cross fewer bytes than the
  // rows would. 0 sends both ops through two hops always (tests).
  static constexpr int64_t kTwoHopMinBytes = 1 << 20;
  int64_t two_hop_min_bytes() const { return two_hop_min_bytes_; }
  void set_two_hop_min_bytes(int64_t n);
  bool two_hop_possible() const { return hier_ != nullptr; }
  // Dispatches so far that took two hops, and that went straight to their receivers.
  int64_t two_hop_dispatches() const { return two_hop_dispatches_; }
  int64_t direct_dispatches() const { return direct_dispatches_; }
  int64_t two_hop_combines() const { return two_hop_combines_; }
  int64_t direct_combines() const { return direct_combines_; }
  // Each group rank's host index (where two hops are possible; else empty): the order a
  // combine in two hops sums in depends on it.
  std::vector<int> host_of() const;

 private:
  using Header = std::array<int64_t, kHeaderInts>;
  struct Agreed {
    std::vector<Header> heads;                 // [rank]
    std::vector<std::vector<int64_t>> extras;  // [rank], each zero-padded to the longest
  };
  // Round 1 (and 2 for extras past the inline room). Raises on every rank if any rank refused,
  // this rank's own reason first.
  Agreed agree(const std::string& op, const Header& header, const std::string& error,
               const std::vector<int64_t>& extra);
  at::Tensor all_gather(const std::string& op, const at::Tensor& mine);
  // all_to_all_single of (rows, width) uint8 by row counts per peer.
  at::Tensor exchange_rows(const std::string& op, const at::Tensor& send, const std::vector<int64_t>& send_rows,
                           const std::vector<int64_t>& recv_rows, int64_t width);
  // A row a rank sends: its token and routing slot (-1: a shared-expert row); the 8 bytes that
  // end every dispatch record.
  struct Sent {
    int32_t token, slot;
  };
  using RowsTo = std::function<int64_t(int src, int dst)>;
  // Distinct tokens of `sent` (in destination order; `at`: where each destination's records
  // start, and where the last ends) bound for each host.
  std::vector<int64_t> tokens_per_host(const std::vector<Sent>& sent, const std::vector<int64_t>& at,
                                       int64_t tokens) const;
  // Whether this dispatch takes two hops: decided from the agreed counts, alike on every rank.
  bool two_hop(const Agreed& g, const RowsTo& rows_to, int64_t payload) const;
  // The dispatch records this rank receives, when each row crosses to another host once: to
  // the rank of this rank's local index there (rail), carrying its token's row (payload bytes)
  // once and a short descriptor per record, and that rank rebuilds the records and forwards
  // them over its host's shared memory. Blocks arrive by forwarder, then host: `order` says
  // whose.
  at::Tensor dispatch_two_hop(const at::Tensor& send, const std::vector<Sent>& sent,
                              const std::vector<int64_t>& at, const Agreed& g, const RowsTo& rows_to,
                              int64_t payload, std::vector<int>& order);
  struct TwoHops;
  // Hop 1's message to every other host (`bytes` each): payloads, then descriptors.
  at::Tensor first_hop(const TwoHops& x, const uint8_t* records, const std::vector<Sent>& sent,
                       const std::vector<int64_t>& at, const std::vector<int64_t>& bytes) const;
  // Hop 2's message to every rank of this host (`bytes` each): the records rebuilt from what
  // hop 1 brought (`arrived`, `arrived_bytes` from each host), and this rank's own.
  at::Tensor second_hop(const TwoHops& x, const uint8_t* records, const std::vector<int64_t>& at,
                        const at::Tensor& arrived, const std::vector<int64_t>& arrived_bytes,
                        const std::vector<int64_t>& bytes) const;
  struct CombinePlan;
  // Whether this combine takes two hops: decided from the agreed tables, alike on every rank.
  bool combine_in_two_hops(const CombinePlan& c) const;
  // Combine in two hops (see hosts_moe.cpp): this rank's output, summed from its own host's rows
  // and one partial sum per token from each other host.
  void combine_two_hop(const CombinePlan& c, const MoeCombineArgs& a, const at::Tensor& rows);
  void check_dispatch_headers(const std::vector<Header>& heads) const;
  void check_capacity(const Agreed& g, int64_t M, int64_t S, int64_t L) const;

  c10::intrusive_ptr<c10d::Backend> group_;
  int rank_, size_;
  int64_t inline_ints_ = kInlineInts;
  int64_t two_hop_min_bytes_ = kTwoHopMinBytes;
  int64_t two_hop_dispatches_ = 0, direct_dispatches_ = 0, two_hop_combines_ = 0, direct_combines_ = 0;
  // Hosts of equal size, more than one rank each (else null): where two hops can pay. Both
  // live as long as group_.
  HierarchicalBackend* hier_ = nullptr;
  const HostMap* hosts_ = nullptr;
};

}  // namespace cam::moe
