#include "kv_transfer.hpp"

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdio>
#include <cstring>

#include "../runtime/cam_work.hpp"
#include "../core/errors.hpp"

namespace cam::kv {

namespace {
constexpr int kFields = 11;  // KVLayoutDesc's fields

// A request id for messages: printable bytes as they are, others as \xNN.
std::string printable(const std::string& id) {
  std::string out;
  for (unsigned char c : id) {
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      out += char(c);
    } else {
      char buf[5];
      std::snprintf(buf, sizeof(buf), "\\x%02x", c);
      out += buf;
    }
  }
  return out;
}

void to_fields(const KVLayoutDesc& d, int64_t* f) {
  const int64_t v[kFields] = {d.mla,   d.num_layers, d.num_blocks, d.block_size, d.num_kv_heads, d.head_dim,
                              d.dtype, d.hnd,        d.tp_rank,    d.tp_size,    d.total_kv_heads};
  std::memcpy(f, v, sizeof(v));
}
KVLayoutDesc from_fields(const int64_t* f) {
  return KVLayoutDesc{f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7], f[8], f[9], f[10]};
}

// The engine's view of a job: the progress thread (or a waiter) advances it one layer per
// step. Its failures are the job's own (the group stays usable), so they are ValidationErrors;
// the job keeps its own deadline, so the engine's is only a backstop.
class KVTransferOp : public Op {
 public:
  KVTransferOp(std::shared_ptr<KVTransfer> owner, std::shared_ptr<KVTransferJob> job, Clock::time_point backstop)
      : Op("kv_transfer", 0, backstop), owner_(std::move(owner)), job_(std::move(job)) {}
  bool step(Context&) override {
    const bool moved = owner_->advance(*job_);
    if (job_->done()) {
      if (!job_->error().empty()) throw ValidationError(job_->error());
      mark_done();
      return true;
    }
    return moved;
  }
  std::string waiting_for() const override { return job_->what() + " to finish"; }
  int trace_peer() const override { return job_->peer(); }

 private:
  std::shared_ptr<KVTransfer> owner_;
  std::shared_ptr<KVTransferJob> job_;
};
}  // namespace

// ---- jobs -----------------------------------------------------------------------------------

KVTransferJob::KVTransferJob(std::string what, int64_t kind, int peer, std::string request_id, uint64_t version,
                             KVCopyPlan plan, std::vector<char*> local_pools, std::vector<int64_t> peer_pools,
                             Clock::time_point deadline)
    : what_(std::move(what)), kind_(kind), peer_(peer), request_id_(std::move(request_id)), version_(version),
      plan_(std::move(plan)), local_pools_(std::move(local_pools)), peer_pools_(std::move(peer_pools)),
      deadline_(deadline) {}

bool KVTransferJob::layer_done(int64_t layer) const {
  const auto& ls = plan_.layers();
  const int64_t n = layers_copied_.load(std::memory_order_acquire);
  for (int64_t i = 0; i < n; ++i) {
    if (ls[size_t(i)] == layer) return true;
  }
  return false;
}

std::vector<int64_t> KVTransferJob::failed_blocks() const {
  if (done() && error_.empty()) return {};
  return plan_.dst_blocks();  // failed, or stopped by the group's failure: none is known complete
}

// ---- setup and registration -----------------------------------------------------------------

KVTransfer::KVTransfer(std::shared_ptr<Engine> engine, std::chrono::milliseconds timeout, int rank, int world)
    : engine_(std::move(engine)), timeout_(timeout), rank_(rank < 0 ? engine_->heap().rank() : rank),
      world_(world < 0 ? engine_->heap().world_size() : world), layout_{world_} {
  // Never released: a peer may read this block (and write its rings) after this object is gone,
  // and a heap tensor reusing the bytes would be taken for a registration. A few KiB per peer.
  control_offset_ = engine_->heap().arena()->reserve_block(layout_.bytes());
  control_ = engine_->heap().arena()->block(control_offset_);
  std::memset(control_, 0, size_t(layout_.bytes()));
  peer_cache_.resize(size_t(world_));
  ring_mu_ = std::make_unique<std::mutex[]>(size_t(world_));
  liveness_ = std::make_unique<PeerLiveness[]>(size_t(world_));
  sent_.assign(size_t(world_), 0);
}

int64_t KVTransfer::control_offset() const { return control_offset_; }

void KVTransfer::connect(const std::vector<int64_t>& offsets, const PeerMaker& make) {
  TORCH_CHECK(int64_t(offsets.size()) == world_, "cam KVTransfer on rank ", rank_, ": expected ", world_,
              " control block offsets, got ", offsets.size());
  std::vector<std::unique_ptr<KVPeer>> peers;
  peers.resize(size_t(world_));
  for (int r = 0; r < world_; ++r) {  // this rank too: its own registration reads the same way
    peers[size_t(r)] = make(r, offsets[size_t(r)]);
    TORCH_CHECK(offsets[size_t(r)] >= 0 && offsets[size_t(r)] + layout_.bytes() <= peers[size_t(r)]->arena_bytes(),
                "cam KVTransfer on rank ", rank_, ": rank ", r, "'s control block offset ", offsets[size_t(r)],
                " is outside its tensor heap");
  }
  peers_ = std::move(peers);
}

void KVTransfer::connect(const std::vector<int64_t>& offsets) {
  const SymmetricHeap& heap = engine_->heap();
  const int64_t cap = engine_->config().tensor_heap_bytes;
  connect(offsets, [&](int r, int64_t off) { return std::make_unique<MappedKVPeer>(heap, r, off, cap); });
}

uint64_t KVTransfer::register_pools(const std::vector<at::Tensor>& pools, const KVLayoutDesc& layout) {
  layout.validate();
  TORCH_CHECK_VALUE(int64_t(pools.size()) == layout.num_layers && layout.num_layers <= kMaxLayers,
                    "cam KVTransfer.register on rank ", rank_, ": expected ", layout.num_layers,
                    " layer pools (at most ", kMaxLayers, "), got ", pools.size());
  std::vector<int64_t> offsets;
  for (size_t l = 0; l < pools.size(); ++l) {
    const at::Tensor& t = pools[l];
    layout.check_pool(t, str("cam KVTransfer.register on rank ", rank_, ": layer ", l, " pool"));
    const int64_t off = engine_->heap().arena()->offset_of(t.data_ptr(), int64_t(t.nbytes()));
    TORCH_CHECK_VALUE(off >= 0, "cam KVTransfer.register on rank ", rank_, ": layer ", l,
                      " pool is not in this group's tensor heap; allocate it with torch_cam.empty(..., group=group)");
    offsets.push_back(off);
  }
  std::lock_guard<std::mutex> lk(register_mu_);
  auto* reg = KVControlLayout::registration(control_);
  const uint64_t v = version_;
  std::atomic_ref<uint64_t>(reg->version).store(v + 1, std::memory_order_relaxed);  // odd: being rewritten
  std::atomic_thread_fence(std::memory_order_release);
  std::memset(reg->fields, 0, sizeof(reg->fields));
  to_fields(layout, reg->fields);
  std::memcpy(reg->layer_offset, offsets.data(), offsets.size() * sizeof(int64_t));
  signal_release(reg->version, v + 2);
  version_ = v + 2;
  pools_ = std::make_shared<const std::vector<at::Tensor>>(pools);
  layout_desc_ = layout;
  return version_;
}

KVTransfer::PeerRegistration KVTransfer::read_registration(int r) {
  KVPeer& p = peer(r);
  const auto deadline = Clock::now() + timeout_;
  Backoff backoff(engine_->config().spin_us, engine_->config().yield_us, engine_->config().sleep_max_us);
  std::lock_guard<std::mutex> lk(peers_mu_);
  PeerRegistration& cached = peer_cache_[size_t(r)];
  constexpr int64_t version_at = KVControlLayout::version_at();
  while (true) {
    const uint64_t v = p.load(version_at);
    if (v == cached.version) return cached;  // unchanged since last read (or still 0: none)
    if (v % 2 == 0) {
      int64_t f[kFields];
      p.read(int64_t(offsetof(KVRegistration, fields)), f, sizeof(f));
      const KVLayoutDesc desc = from_fields(f);
      std::vector<int64_t> offsets(size_t(std::clamp<int64_t>(desc.num_layers, 0, kMaxLayers)));
      p.read(int64_t(offsetof(KVRegistration, layer_offset)), offsets.data(), offsets.size() * sizeof(int64_t));
      std::atomic_thread_fence(std::memory_order_acquire);
      if (p.load(version_at) == v) {
        p.prepare_pools(desc, offsets);
        cached = PeerRegistration{v, desc, std::move(offsets)};
        return cached;
      }
    }
    TORCH_CHECK(Clock::now() < deadline, "cam KVTransfer on rank ", rank_, ": rank ", r,
                "'s registration stayed half-written for ", timeout_.count(), " ms");
    backoff.pause();
  }
}

std::pair<uint64_t, KVLayoutDesc> KVTransfer::peer_registration(int peer) {
  TORCH_CHECK_VALUE(peer >= 0 && peer < world_, "cam KVTransfer on rank ", rank_, ": rank ", peer,
                    " is outside the group of ", world_);
  auto r = read_registration(peer);
  return {r.version, r.layout};
}

std::vector<int64_t> KVTransfer::peer_offsets(int peer) {
  TORCH_CHECK_VALUE(peer >= 0 && peer < world_, "cam KVTransfer on rank ", rank_, ": rank ", peer,
                    " is outside the group of ", world_);
  return read_registration(peer).offsets;
}

// ---- transfers ------------------------------------------------------------------------------

std::shared_ptr<KVTransferJob> KVTransfer::prepare(int64_t kind, int peer, BlockIds src_ids, BlockIds dst_ids,
                                                   int64_t num_tokens, std::vector<int64_t> layers,
                                                   bool all_layers, const std::string& request_id,
                                                   int64_t expect_version) {
  const std::string what = str("cam KV ", kind == kPush ? "push to" : "pull from", " rank ", peer, " (request '",
                               printable(request_id), "') on rank ", rank_);
  TORCH_CHECK_VALUE(peer >= 0 && peer < world_ && peer != rank_, "cam KVTransfer on rank ", rank_, ": peer ", peer,
                    " is not another rank of the group of ", world_);
  TORCH_CHECK_VALUE(int64_t(request_id.size()) <= kIdBytes, "cam KVTransfer on rank ", rank_, ": request_id has ",
                    request_id.size(), " bytes, at most ", kIdBytes);
  std::shared_ptr<const std::vector<at::Tensor>> own;
  KVLayoutDesc own_layout;
  {
    std::lock_guard<std::mutex> lk(register_mu_);
    own = pools_;
    own_layout = layout_desc_;
  }
  TORCH_CHECK(own != nullptr, "cam KVTransfer on rank ", rank_, ": register this rank's pools first");
  PeerRegistration reg;
  try {
    reg = read_registration(peer);
  } catch (const FatalError& e) {  // the transport to the peer failed (a peer on another host lost)
    TORCH_CHECK(false, what, ": ", e.what());
  }
  TORCH_CHECK(reg.version != 0, "cam KVTransfer on rank ", rank_, ": rank ", peer, " has registered no KV pools");
  try {
    const auto deadline = Clock::now() + timeout_;
    TORCH_CHECK(expect_version < 0 || uint64_t(expect_version) == reg.version, "rank ", peer,
                "'s KV pools were re-registered (version ", expect_version, " -> ", reg.version,
                "); block ids planned against the old registration are refused");
    const bool push = kind == kPush;
    const KVLayoutDesc& src = push ? own_layout : reg.layout;
    const KVLayoutDesc& dst = push ? reg.layout : own_layout;
    KVCopyPlan plan(src, src_ids, dst, dst_ids, num_tokens, std::move(layers), all_layers);
    const int64_t cap = this->peer(peer).arena_bytes();
    std::vector<char*> local_pools;
    std::vector<int64_t> peer_pools;
    for (int64_t l : plan.layers()) {
      const int64_t off = reg.offsets[size_t(l)];
      TORCH_CHECK(off >= 0 && off + reg.layout.pool_bytes() <= cap, "rank ", peer, "'s layer ", l,
                  " pool at offset ", off, " is outside its tensor heap");
      local_pools.push_back(static_cast<char*>((*own)[size_t(l)].data_ptr()));
      peer_pools.push_back(off);
    }
    auto job = std::make_shared<KVTransferJob>(what, kind, peer, request_id, reg.version, std::move(plan),
                                               std::move(local_pools), std::move(peer_pools), deadline);
    job->own_pools_ = std::move(own);
    return job;
  } catch (const c10::Error& e) {
    // The message names the transfer (direction, peer, request, rank); the peer still hears
    // that this request failed (it may be waiting for it).
    throw_like(e, refuse(kind, peer, request_id, e.msg()));
  }
}

void throw_like(const c10::Error& e, const std::string& msg) {
  const c10::SourceLocation here{__func__, __FILE__, uint32_t(__LINE__)};
  if (dynamic_cast<const c10::IndexError*>(&e)) throw c10::IndexError(here, msg);
  if (dynamic_cast<const c10::ValueError*>(&e)) throw c10::ValueError(here, msg);
  throw c10::Error(here, msg);
}

std::string KVTransfer::refuse(int64_t kind, int peer, const std::string& request_id, const std::string& reason) {
  const std::string what = str("cam KV ", kind == kPush ? "push to" : "pull from", " rank ", peer, " (request '",
                               printable(request_id), "') on rank ", rank_);
  std::string msg = str(what, ": ", reason);
  if (peer < 0 || peer >= world_ || peer == rank_ || int64_t(request_id.size()) > kIdBytes) return msg;
  try {
    notify(peer, kind, kFailed, 0, request_id, msg, Clock::now() + timeout_, what);
  } catch (const std::exception& unreachable) {
    msg += str(" (rank ", peer, " could not be told: ", unreachable.what(), ")");
  }
  return msg;
}

void KVTransfer::finish(KVTransferJob& job, std::string error, bool timed_out) {
  job.error_ = std::move(error);
  job.timed_out_ = timed_out;
  job.state_.store(KVTransferJob::State::kDone, std::memory_order_release);
}

bool KVTransfer::advance(KVTransferJob& job) {
  if (job.state_.load(std::memory_order_relaxed) == KVTransferJob::State::kDone) return false;
  try {
    return advance_once(job);
  } catch (const std::exception& e) {
    // The transport failed under the transfer (a peer on another host lost): the transfer's own
    // failure, not the group's.
    finish(job, str(job.what_, ": ", e.what()), false);
    return true;
  }
}

bool KVTransfer::advance_once(KVTransferJob& job) {
  using State = KVTransferJob::State;
  const State state = job.state_.load(std::memory_order_relaxed);
  KVPeer& p = peer(job.peer_);
  if (state == State::kCopying) {
    const int64_t i = job.layers_copied_.load(std::memory_order_relaxed);
    const auto& layers = job.plan_.layers();
    if (i < int64_t(layers.size())) {
      job.nbytes_.fetch_add(
          p.copy_layer(job.plan_, job.kind_ == kPush, job.local_pools_[size_t(i)], job.peer_pools_[size_t(i)]),
          std::memory_order_relaxed);
      job.layers_copied_.store(i + 1, std::memory_order_release);
      return true;
    }
    // A re-registration during the copy may have handed the blocks to something else.
    const uint64_t now = p.load(KVControlLayout::version_at());
    if (now != job.version_) {
      job.status_ = kFailed;
      job.error_ = str(job.what_, ": rank ", job.peer_, " re-registered its KV pools during the transfer (version ",
                       job.version_, " -> ", now, "); the blocks may hold partial data");
    }
    job.state_.store(State::kNotifying, std::memory_order_relaxed);
  }
  std::string message = job.error_;
  if (message.empty()) {
    // Writes into a dead peer's pools succeed (the mapping outlives it), so the sender asks.
    const std::string dead = peer_dead(job.peer_);
    if (!dead.empty()) {
      finish(job, str(job.what_, ": rank ", job.peer_, " is gone (", dead, "); the data went nowhere"), false);
      return true;
    }
  }
  if (try_notify(job.peer_, job.kind_, job.status_, job.nbytes(), job.request_id_, message)) {
    finish(job, message, false);
    return true;
  }
  if (Clock::now() > job.deadline_) {
    finish(job,
           str(job.what_, ": rank ", job.peer_, " has not read its notifications for ", timeout_.count(),
               " ms (ring of ", kSlots, " full)", message.empty() ? "; the data was written" : "; " + message),
           true);
    return true;
  }
  const std::string dead = peer_dead(job.peer_);
  if (!dead.empty()) {
    finish(job, str(job.what_, ": cannot notify rank ", job.peer_, ": ", dead), false);
    return true;
  }
  return false;
}

void KVTransfer::run(KVTransferJob& job) {
  const auto& cfg = engine_->config();
  Backoff backoff(cfg.spin_us, cfg.yield_us, cfg.sleep_max_us);
  while (!job.done()) {
    if (advance(job)) backoff.reset();
    else backoff.pause();
  }
}

c10::intrusive_ptr<c10d::Work> KVTransfer::submit(std::shared_ptr<KVTransferJob> job) {
  auto op = std::make_shared<KVTransferOp>(shared_from_this(), std::move(job), Clock::now() + 2 * timeout_);
  engine_->submit(op);
  return c10::make_intrusive<CamWork>(engine_, op, rank_, c10d::OpType::UNKNOWN, "cam:kv_transfer",
                                      std::vector<at::Tensor>{});
}

// ---- notifications --------------------------------------------------------------------------

std::string KVTransfer::peer_dead(int peer) {
  // Reading /proc costs microseconds: ask at most once per liveness interval per peer, and
  // remember a death.
  PeerLiveness& p = liveness_[size_t(peer)];
  std::lock_guard<std::mutex> lk(p.mu);
  const auto now = Clock::now();
  if (p.dead.empty() && now >= p.next_check) {
    p.dead = this->peer(peer).dead();
    p.next_check = now + std::chrono::milliseconds(engine_->config().liveness_interval_ms);
  }
  return p.dead;
}

bool KVTransfer::try_notify(int peer, int64_t kind, int64_t status, int64_t nbytes, const std::string& request_id,
                            const std::string& message) {
  std::lock_guard<std::mutex> lk(ring_mu_[size_t(peer)]);
  KVPeer& p = this->peer(peer);
  const uint64_t seq = sent_[size_t(peer)];
  if (seq - p.load(layout_.tail_at(rank_)) >= uint64_t(kSlots)) return false;
  KVNoteSlot s;
  const size_t mlen = std::min(message.size(), size_t(kMessageBytes));
  s.seq = int64_t(seq + 1);
  s.status = status;
  s.kind = kind;
  s.nbytes = nbytes;
  s.id_len = int64_t(request_id.size());
  s.message_len = int64_t(mlen);
  std::memset(s.id, 0, sizeof(s.id));
  std::memcpy(s.id, request_id.data(), request_id.size());
  std::memcpy(s.message, message.data(), mlen);
  // The slot up to the message's last byte, then the head: publish() orders the transfer's
  // bytes and the slot before it.
  p.write(layout_.slot_at(rank_, int64_t(seq % kSlots)), &s, offsetof(KVNoteSlot, message) + mlen);
  p.publish(layout_.head_at(rank_), seq + 1);
  sent_[size_t(peer)] = seq + 1;
  return true;
}

void KVTransfer::notify(int peer, int64_t kind, int64_t status, int64_t nbytes, const std::string& request_id,
                        const std::string& message, Clock::time_point deadline, const std::string& what) {
  const auto& cfg = engine_->config();
  Backoff backoff(cfg.spin_us, cfg.yield_us, cfg.sleep_max_us);
  while (!try_notify(peer, kind, status, nbytes, request_id, message)) {
    const std::string dead = peer_dead(peer);
    TORCH_CHECK(dead.empty(), what, ": cannot notify rank ", peer, ": ", dead);
    TORCH_CHECK(Clock::now() < deadline, what, ": rank ", peer, " has not read its notifications for ",
                timeout_.count(), " ms (ring of ", kSlots, " full)");
    backoff.pause();
  }
}

void KVTransfer::drain() {
  char* block = control_;
  for (int p = 0; p < world_; ++p) {
    if (p == rank_) continue;
    const KVRing* ring = layout_.ring(block, p);
    SignalLine* tail = layout_.tail(block, p);
    const uint64_t head = signal_acquire(ring->head.value), from = signal_relaxed(tail->value);
    if (head == from) continue;
    for (uint64_t seq = from; seq < head; ++seq) {
      const KVNoteSlot& s = ring->slots[seq % kSlots];
      const auto id_len = size_t(std::clamp<int64_t>(s.id_len, 0, kIdBytes));
      const auto msg_len = size_t(std::clamp<int64_t>(s.message_len, 0, kMessageBytes));
      queue_.push_back(KVNotification{p, std::string(s.id, id_len), s.kind, s.status, s.nbytes,
                                      std::string(s.message, msg_len)});
    }
    signal_release(tail->value, head);  // the slots may be reused
  }
}

std::vector<KVNotification> KVTransfer::poll() {
  std::lock_guard<std::mutex> lk(queue_mu_);
  drain();
  std::vector<KVNotification> out;
  out.swap(queue_);
  return out;
}

KVNotification KVTransfer::wait_notification(const std::string& request_id, int peer,
                                              std::chrono::milliseconds timeout) {
  TORCH_CHECK_VALUE(peer < world_ && peer != rank_, "cam KVTransfer.wait_notification on rank ", rank_, ": peer ",
                    peer, " is not another rank of the group of ", world_);
  // No transfer can carry a longer id, so none can ever notify it.
  TORCH_CHECK_VALUE(int64_t(request_id.size()) <= kIdBytes, "cam KVTransfer.wait_notification on rank ", rank_,
                    ": request_id has ", request_id.size(), " bytes, at most ", kIdBytes);
  const auto& cfg = engine_->config();
  Backoff backoff(cfg.spin_us, cfg.yield_us, cfg.sleep_max_us);
  const auto deadline = Clock::now() + timeout;
  while (true) {
    {
      std::lock_guard<std::mutex> lk(queue_mu_);
      drain();
      for (auto it = queue_.begin(); it != queue_.end(); ++it) {
        if (it->request_id == request_id && (peer < 0 || it->peer == peer)) {
          KVNotification n = std::move(*it);
          queue_.erase(it);
          return n;
        }
      }
    }
    for (int p = 0; p < world_; ++p) {
      if (p == rank_ || (peer >= 0 && p != peer)) continue;
      const std::string dead = peer_dead(p);
      TORCH_CHECK(dead.empty(), "cam KVTransfer on rank ", rank_, ": waiting for request '", printable(request_id),
                  "' from rank ", p, ": ", dead);
    }
    if (Clock::now() > deadline) {
      throw KVTimeout(str("cam KVTransfer on rank ", rank_, ": no notification for request '", printable(request_id),
                                   "'", peer >= 0 ? str(" from rank ", peer) : std::string(), " within ",
                                   timeout.count(), " ms"));
    }
    backoff.pause();
  }
}

}  // namespace cam::kv
