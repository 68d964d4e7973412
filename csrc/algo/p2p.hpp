// Point-to-point messaging through per-pair outboxes.
//
// Rank s owns, in its window, one byte ring per destination d. A message is a 64-byte header
// {index, nbytes, tag, dtype} followed by the payload padded to 64 bytes. s advances head[d]
// (its window) as it writes; d advances tail[s] (its own window) as it reads, so s may reuse
// ring bytes below tail. Messages larger than the ring stream through it in pieces.
//
// Matching is MPI-like and per (peer, tag) FIFO: the receiver reads headers in arrival order
// and binds each to the earliest posted recv with that (source or any-source, tag). A message
// nobody has asked for stays in the ring (it costs nothing) unless a posted recv is stuck
// behind it, in which case its payload is drained into a private buffer.
//
// Binding writes an acknowledgement slot (in the receiver's window) that tells the sender the
// size and dtype the recv expected; a send completes once its bytes are in the ring and it is
// acknowledged, so a size or dtype mismatch fails on both sides and no data is corrupted.
//
// A send whose tensor is heap-resident (torch_cam.empty, or born in the process heap) sends
// only the header, naming the tensor by heap offset: the receiver copies the payload straight
// out of it (one copy instead of two) when a recv binds the message, or into a private buffer
// when it drains it, and only then writes the acknowledgement, so the sender, which completes
// on the acknowledgement, keeps its tensor untouched until the copy is done.
//
// Refusals: a send whose own checks refused its arguments is still sent, as a message of dtype
// kRefusalDtype whose payload is the reason, and fails the recv it matches; a refused recv
// still matches the next message and answers it with kAckRefused and its reason in the ack
// slot, failing the send. So one rank's bad argument fails its partner at once, not at the
// timeout.
#pragma once

#include <deque>
#include <memory>

#include "op.hpp"

namespace cam {

struct alignas(64) MsgHeader {
  uint64_t index_plus1;
  int64_t nbytes;
  int32_t tag;
  int32_t dtype;
  int64_t heap_off;  // >= 0: the payload is not in the ring but in the sender's heap, here
};
static_assert(sizeof(MsgHeader) == 64);
constexpr int32_t kRefusalDtype = -1;  // MsgHeader::dtype of a refused send (no ScalarType is < 0)

class SendOp final : public Op {
 public:
  SendOp(Clock::time_point deadline, int dst, int tag, at::Tensor tensor);
  // A refused send: the message carries `reason` instead of a tensor.
  SendOp(Clock::time_point deadline, int dst, int tag, const std::string& reason);
  bool step(Context&) override { return false; }  // progressed by P2PEngine
  Family family() const override { return Family::kSend; }
  void assign_index(uint64_t msg) { set_seq(msg); }
  // Header plus payload padded to 64 bytes (only the header when the payload is read in
  // place): what the message occupies in the outbox.
  int64_t framed_bytes() const {
    return int64_t(sizeof(MsgHeader)) + (heap_off >= 0 ? 0 : (nbytes + 63) / 64 * 64);
  }
  void waiting_on(int peer) {
    waiting(peer, written < framed_bytes() ? "outbox space" : "a matching recv");
  }
  void finish_ok() { mark_done(); }
  int trace_peer() const override { return dst; }
  int dst, tag, dtype;
  at::Tensor buf;
  int64_t nbytes;
  int64_t heap_off = -1;  // decided when the header is written
  int64_t written = 0;  // framed bytes written into the outbox
};

class RecvOp final : public Op {
 public:
  RecvOp(uint64_t seq, Clock::time_point deadline, int src, int tag, at::Tensor tensor);
  // A refused recv: it matches like any recv and answers the message with `reason`.
  RecvOp(uint64_t seq, Clock::time_point deadline, int src, int tag, std::string reason);
  bool refused() const { return !refusal.empty(); }
  bool step(Context&) override { return false; }  // progressed by P2PEngine
  Family family() const override { return Family::kRecv; }
  void finalize() override;
  void matched(int src) { source_rank_ = src; }
  void complete() { mark_done(); }
  void await(int peer, const char* what) { waiting(peer, what); }
  int trace_peer() const override { return src; }
  int src, tag, dtype;  // src < 0: any source
  at::Tensor user, buf;
  int64_t nbytes;
  std::string refusal;
};

class P2PEngine {
 public:
  explicit P2PEngine(int world_size);
  using Finished = FinishedOps;
  void add_send(std::shared_ptr<SendOp> op);
  void post_recv(Context& ctx, std::shared_ptr<RecvOp> op, Finished& finished);
  bool progress(Context& ctx, Finished& finished);
  // Takes back a posted recv that no message has matched yet: true when it was still posted
  // (no message will ever bind to it), false when a message already has.
  bool withdraw(const RecvOp& op);
  void clear();

 private:
  struct Record {
    int src;
    uint64_t msg;
    MsgHeader hdr;
    int64_t consumed = 0;  // padded payload bytes taken out of the ring
    bool complete = false;
    bool discard = false;
    std::vector<char> buffer;  // payload drained before a recv matched
    std::shared_ptr<RecvOp> bound;
    std::shared_ptr<RecvOp> told;  // a recv matched to a refused send: fails once the reason is in
  };
  bool progress_acks(Context& ctx, int dst, Finished& finished);
  bool progress_tx(Context& ctx, int dst);
  bool progress_rx(Context& ctx, int src, Finished& finished);
  bool needs_drain(int src) const;
  std::shared_ptr<RecvOp> match_posted(int src, int tag);
  void bind(Context& ctx, const std::shared_ptr<Record>& rec, const std::shared_ptr<RecvOp>& r,
            Finished& finished);
  void fail_told(Context& ctx, Record& rec, Finished& finished);
  // Copies an in-place message's payload out of the sender's heap.
  void read_in_place(Context& ctx, const Record& rec, void* dst);

  int world_;
  std::vector<std::deque<std::shared_ptr<SendOp>>> tx_queue_;
  // Per destination, the sends written and not yet acknowledged, by message index (ascending:
  // messages are written in index order). A deque allocates a block per few dozen entries
  // where a map or list allocates a node per op.
  std::vector<std::deque<std::pair<uint64_t, std::shared_ptr<SendOp>>>> tx_unacked_;
  std::vector<uint64_t> tx_head_, tx_msgs_, rx_tail_, rx_msgs_;
  std::vector<std::shared_ptr<Record>> rx_cur_;
  std::vector<std::deque<std::shared_ptr<Record>>> unexpected_;
  std::deque<std::shared_ptr<RecvOp>> posted_;  // recvs waiting for a message, in posting order
  int any_source_start_ = 0;
};

}  // namespace cam
