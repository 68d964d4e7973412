#include "ucx_transport.hpp"

#include <poll.h>
#include <ucp/api/ucp.h>

#include <cstdlib>
#include <cstring>
#include <deque>

#include "../core/errors.hpp"

namespace cam {
namespace {

std::string status_text(ucs_status_t s) { return ucs_status_string(s); }

size_t slots_offset(int size) { return (size_t(16) * size + 63) / 64 * 64; }

// The active message that carries a post(): the sender's rank as header, the bytes as data.
constexpr unsigned kPostMessage = 1;

}  // namespace

struct UcxTransport::Peer {
  int rank = 0;
  ucp_ep_h ep = nullptr;
  uint64_t window = 0;                  // its control window's address
  std::unique_ptr<UcxRemoteKey> rkey;   // and key
  ucs_status_t failed = UCS_OK;         // set by the endpoint's error handler
};

struct UcxTransport::Request {
  void* req;
  int peer;
  const char* kind;
};

// ---- registration ----

UcxRegion::UcxRegion(ucp_context_h ctx, void* base, size_t bytes) : ctx_(ctx), base_(base) {
  ucp_mem_map_params_t mp{};
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  mp.address = base;
  mp.length = bytes ? bytes : 1;
  ucs_status_t s = ucp_mem_map(ctx, &mp, &memh_);
  if (s != UCS_OK) throw FatalError(str("cannot register ", bytes, " bytes with UCX: ", status_text(s)));
  void* packed = nullptr;
  size_t n = 0;
  s = ucp_rkey_pack(ctx, memh_, &packed, &n);
  if (s != UCS_OK) {
    ucp_mem_unmap(ctx, memh_);
    throw FatalError(str("cannot pack a UCX remote key: ", status_text(s)));
  }
  rkey_.assign(static_cast<uint8_t*>(packed), static_cast<uint8_t*>(packed) + n);
  ucp_rkey_buffer_release(packed);
}

UcxRegion::~UcxRegion() {
  if (memh_) ucp_mem_unmap(ctx_, memh_);
}

UcxRemoteKey::UcxRemoteKey(ucp_ep_h ep, const void* packed) {
  const ucs_status_t s = ucp_ep_rkey_unpack(ep, packed, &rkey_);
  if (s != UCS_OK) throw FatalError(str("cannot unpack a peer's UCX remote key: ", status_text(s)));
}

UcxRemoteKey::~UcxRemoteKey() {
  if (rkey_) ucp_rkey_destroy(rkey_);
}

// ---- construction ----

UcxTransport::UcxTransport(c10::intrusive_ptr<c10d::Store> store, UcxOptions opts) : opts_(std::move(opts)) {
  const int n = opts_.size;
  const std::string what = "cam UCX transport setup";
  // Over TCP UCX moves RMA in segments of TCP_*_SEG_SIZE (8 KiB by default): 256 KiB took a
  // 16 MiB get between two simulated hosts from 0.97 to 1.76 GB/s (raw stream 2.0 GB/s). The
  // user's own UCX_* settings win.
  setenv("UCX_TCP_TX_SEG_SIZE", "256k", 0);
  setenv("UCX_TCP_RX_SEG_SIZE", "256k", 0);
  ucp_config_t* config = nullptr;
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &config);
  if (s != UCS_OK) raise(what, "cannot read UCX's configuration: " + status_text(s));
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_AMO64 | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP |
                    (opts_.tagged ? UCP_FEATURE_TAG : 0);
  s = ucp_init(&params, config, &ctx_);
  ucp_config_release(config);
  if (s != UCS_OK) raise(what, "cannot create a UCX context: " + status_text(s));
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;
  s = ucp_worker_create(ctx_, &wp, &worker_);
  if (s != UCS_OK) raise(what, "cannot create a UCX worker: " + status_text(s));
  s = ucp_worker_get_efd(worker_, &efd_);
  if (s != UCS_OK) raise(what, "the UCX worker has no event descriptor: " + status_text(s));

  window_bytes_ = slots_offset(n) + size_t(n) * kSlotsPerPeer * kSlotBytes;
  if (posix_memalign(&window_, 4096, window_bytes_) != 0) raise(what, "out of memory for the control window");
  std::memset(window_, 0, window_bytes_);
  ucp_am_handler_param_t hp{};
  hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS | UCP_AM_HANDLER_PARAM_FIELD_CB |
                  UCP_AM_HANDLER_PARAM_FIELD_ARG;
  hp.id = kPostMessage;
  hp.flags = UCP_AM_FLAG_WHOLE_MSG;
  hp.cb = [](void* arg, const void* header, size_t header_bytes, void* data, size_t bytes,
            const ucp_am_recv_param_t* param) {
    uint32_t from = ~0u;
    if (header_bytes == sizeof from) std::memcpy(&from, header, sizeof from);
    static_cast<UcxTransport*>(arg)->place_post(from, data, bytes, (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) == 0);
    return UCS_OK;  // the data was copied
  };
  hp.arg = this;
  s = ucp_worker_set_am_recv_handler(worker_, &hp);
  if (s != UCS_OK) raise(what, "cannot set the UCX message handler: " + status_text(s));
  window_region_ = std::make_unique<UcxRegion>(ctx_, window_, window_bytes_);
  outbox_.resize(n);

  // Publish: window address, worker address, window rkey.
  ucp_address_t* address = nullptr;
  size_t address_len = 0;
  s = ucp_worker_get_address(worker_, &address, &address_len);
  if (s != UCS_OK) raise(what, "cannot get the UCX worker's address: " + status_text(s));
  std::vector<uint8_t> record;
  append_u64(record, uint64_t(window_));
  append_u64(record, address_len);
  record.insert(record.end(), reinterpret_cast<uint8_t*>(address), reinterpret_cast<uint8_t*>(address) + address_len);
  const auto& rk = window_region_->packed_key();
  record.insert(record.end(), rk.begin(), rk.end());
  ucp_worker_release_address(worker_, address);
  store->set("ucx/" + std::to_string(opts_.rank), record);

  peers_.resize(n);
  for (int q = 0; q < n; ++q) {
    if (q == opts_.rank) continue;
    auto p = std::make_unique<Peer>();
    p->rank = q;
    const std::vector<uint8_t> r = store->get("ucx/" + std::to_string(q));
    p->window = read_u64(r, 0);
    const size_t alen = read_u64(r, 8);
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.address = reinterpret_cast<const ucp_address_t*>(r.data() + 16);
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = [](void* arg, ucp_ep_h, ucs_status_t status) {
      auto* peer = static_cast<Peer*>(arg);
      if (peer->failed == UCS_OK) peer->failed = status;
    };
    ep.err_handler.arg = p.get();
    s = ucp_ep_create(worker_, &ep, &p->ep);
    if (s != UCS_OK) raise(what, str("cannot create a UCX endpoint to rank ", q, " (", peer_name(q), "): ", status_text(s)));
    p->rkey = std::make_unique<UcxRemoteKey>(p->ep, r.data() + 16 + alen);
    peers_[q] = std::move(p);
  }

  // Wire up: read one word of every peer's window, then stay progressing until every peer has
  // done the same (a peer's read is served by this rank's progress, over TCP).
  std::vector<uint64_t> probe(n);
  for (int q = 0; q < n; ++q)
    if (q != opts_.rank) get(q, &probe[q], 8, peers_[q]->window, peers_[q]->rkey->get());
  complete(what);
  store->set("ucx_ready/" + std::to_string(opts_.rank), std::vector<uint8_t>{1});
  std::vector<std::string> ready;
  for (int q = 0; q < n; ++q) ready.push_back("ucx_ready/" + std::to_string(q));
  auto last_check = std::chrono::steady_clock::now() - std::chrono::hours(1);
  wait_until(
      [&] {
        // The store is a network round trip: ask it once a millisecond, progress in between.
        const auto now = std::chrono::steady_clock::now();
        if (now - last_check < std::chrono::milliseconds(1)) return false;
        last_check = now;
        return store->check(ready);
      },
      what, [] { return std::string("every rank to connect"); });
}

UcxTransport::~UcxTransport() {
  // Requests still pending (an op that raised) are abandoned with their endpoints.
  for (auto& r : pending_) ucp_request_free(r.req);
  pending_.clear();
  // A put completes here when its buffer is free, before the target has it: flush, so that no
  // target still holds a put of ours when the endpoints close (UCX aborts the process of a
  // target whose acknowledgement finds the sender gone). Bounded: a dead peer never answers.
  if (worker_) {
    ucp_request_param_t fp{};
    void* flush = ucp_worker_flush_nbx(worker_, &fp);
    if (UCS_PTR_IS_PTR(flush)) {
      const auto flush_until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
      while (ucp_request_check_status(flush) == UCS_INPROGRESS && std::chrono::steady_clock::now() < flush_until)
        ucp_worker_progress(worker_);
      ucp_request_free(flush);
    }
  }
  std::vector<void*> closing;
  for (auto& p : peers_) {
    if (!p) continue;
    p->rkey.reset();
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    rp.flags = UCP_EP_CLOSE_FLAG_FORCE;
    void* req = ucp_ep_close_nbx(p->ep, &rp);
    if (UCS_PTR_IS_PTR(req)) closing.push_back(req);
  }
  // A forced close completes locally; bound the wait anyway.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  for (void* req : closing) {
    while (ucp_request_check_status(req) == UCS_INPROGRESS && std::chrono::steady_clock::now() < until)
      ucp_worker_progress(worker_);
    ucp_request_free(req);
  }
  window_region_.reset();
  if (worker_) ucp_worker_destroy(worker_);
  if (ctx_) ucp_cleanup(ctx_);
  std::free(window_);
}

// ---- operations ----

std::unique_ptr<MemoryRegion> UcxTransport::register_memory(void* base, size_t bytes) {
  return std::make_unique<UcxRegion>(ctx_, base, bytes);
}

std::unique_ptr<RemoteKey> UcxTransport::unpack_key(int peer, const void* packed) {
  return std::make_unique<UcxRemoteKey>(peers_.at(peer)->ep, packed);
}

void UcxTransport::put(int peer, const void* src, size_t bytes, uint64_t remote_addr, const RemoteKey& key) {
  put(peer, src, bytes, remote_addr, static_cast<const UcxRemoteKey&>(key).get());
}

void UcxTransport::track(void* status_ptr, int peer, const char* kind) {
  if (status_ptr == nullptr) return;  // completed at once
  if (UCS_PTR_IS_ERR(status_ptr))
    raise(str("cam UCX ", kind), str("the ", kind, " to rank ", peer, " (", peer_name(peer), ") failed: ",
                                    status_text(UCS_PTR_STATUS(status_ptr))));
  pending_.push_back(Request{status_ptr, peer, kind});
}

void UcxTransport::put(int peer, const void* src, size_t bytes, uint64_t remote_addr, ucp_rkey_h rkey) {
  if (bytes == 0) return;
  unfenced_puts_ = true;
  ucp_request_param_t rp{};
  track(ucp_put_nbx(peers_[peer]->ep, src, bytes, remote_addr, rkey, &rp), peer, "put");
}

void UcxTransport::get(int peer, void* dst, size_t bytes, uint64_t remote_addr, ucp_rkey_h rkey) {
  if (bytes == 0) return;
  ucp_request_param_t rp{};
  track(ucp_get_nbx(peers_[peer]->ep, dst, bytes, remote_addr, rkey, &rp), peer, "get");
}

void UcxTransport::add(int peer, uint64_t remote_addr, ucp_rkey_h rkey, uint64_t value) {
  // The operand must outlive the request: it is kept until complete().
  operands_.push_back(value);
  const uint64_t* operand = &operands_.back();
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_DATATYPE;
  rp.datatype = ucp_dt_make_contig(8);
  track(ucp_atomic_op_nbx(peers_[peer]->ep, UCP_ATOMIC_OP_ADD, operand, 1, remote_addr, rkey, &rp), peer,
        "atomic add");
}

void UcxTransport::fence() {
  unfenced_puts_ = false;
  const ucs_status_t s = ucp_worker_fence(worker_);
  if (s != UCS_OK) raise("cam UCX fence", status_text(s));
}

void UcxTransport::complete(const std::string& what) {
  wait_until(
      [&] {
        size_t keep = 0;
        for (auto& r : pending_) {
          const ucs_status_t s = ucp_request_check_status(r.req);
          if (s == UCS_INPROGRESS) {
            pending_[keep++] = r;
            continue;
          }
          ucp_request_free(r.req);
          if (s != UCS_OK) {
            const Request failed = r;
            pending_.erase(pending_.begin() + keep, pending_.begin() + keep + 1);
            raise(what, str("the ", failed.kind, " to rank ", failed.peer, " (", peer_name(failed.peer),
                            ") failed: ", status_text(s)));
          }
        }
        pending_.resize(keep);
        if (!pending_.empty()) return false;
        operands_.clear();
        return true;
      },
      what, [&] { return str(pending_.size(), " operations to complete"); });
}

// ---- tagged messages ----

UcxTagged UcxTransport::send_tagged(int peer, const void* buf, size_t bytes, uint64_t tag) {
  UcxTagged t{nullptr, std::make_shared<UcxTagged::Completion>()};
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  rp.cb.send = [](void*, ucs_status_t status, void* user) {
    auto* c = static_cast<UcxTagged::Completion*>(user);
    c->status = int(status);
    c->done = true;
  };
  rp.user_data = t.completion.get();
  void* r = ucp_tag_send_nbx(peers_.at(size_t(peer))->ep, buf, bytes, tag, &rp);
  if (UCS_PTR_IS_ERR(r))
    raise("cam UCX send", str("the send to rank ", peer, " (", peer_name(peer), ") failed: ",
                              status_text(UCS_PTR_STATUS(r))));
  t.request = r;
  if (r == nullptr) t.completion->done = true;  // completed when issued (no callback then)
  return t;
}

namespace {

// How every tagged receive completes: always through the callback (an immediate completion did
// not report the length, UCX 1.13), which records status and length in the Completion.
ucp_request_param_t recv_param(UcxTagged::Completion* c) {
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  rp.cb.recv = [](void*, ucs_status_t status, const ucp_tag_recv_info_t* got, void* user) {
    auto* c = static_cast<UcxTagged::Completion*>(user);
    c->status = int(status);
    c->length = got != nullptr ? got->length : 0;
    c->done = true;
  };
  rp.user_data = c;
  return rp;
}

}  // namespace

UcxTagged UcxTransport::recv_tagged(void* buf, size_t bytes, uint64_t tag, uint64_t mask) {
  UcxTagged t{nullptr, std::make_shared<UcxTagged::Completion>()};
  const ucp_request_param_t rp = recv_param(t.completion.get());
  void* r = ucp_tag_recv_nbx(worker_, buf, bytes, tag, mask, &rp);
  if (UCS_PTR_IS_ERR(r)) raise("cam UCX receive", status_text(UCS_PTR_STATUS(r)));
  t.request = r;
  return t;
}

void* UcxTransport::probe_tagged(uint64_t tag, uint64_t mask, bool take, uint64_t* sender_tag, size_t* length) {
  ucp_tag_recv_info_t info{};
  ucp_tag_message_h m = ucp_tag_probe_nb(worker_, tag, mask, take ? 1 : 0, &info);
  if (m != nullptr) *sender_tag = info.sender_tag, *length = info.length;
  return m;
}

UcxTagged UcxTransport::recv_taken(void* message, size_t length, void* buf, size_t bytes) {
  UcxTagged t{nullptr, std::make_shared<UcxTagged::Completion>()};
  ucp_request_param_t rp = recv_param(t.completion.get());
  // The probe told the length, so an immediate completion needs no callback; one that does not
  // fit keeps the callback, which reports the truncation.
  if (length <= bytes) rp.op_attr_mask &= ~uint32_t(UCP_OP_ATTR_FLAG_NO_IMM_CMPL);
  void* r = ucp_tag_msg_recv_nbx(worker_, buf, bytes, static_cast<ucp_tag_message_h>(message), &rp);
  if (UCS_PTR_IS_ERR(r)) raise("cam UCX receive", status_text(UCS_PTR_STATUS(r)));
  t.request = r;
  if (r == nullptr) *t.completion = {true, int(UCS_OK), length};  // completed when issued
  return t;
}

bool UcxTransport::tagged_done(const UcxTagged& t, std::string* error, size_t* received) {
  if (!t.completion->done) return false;
  *received = t.completion->length;
  *error = t.completion->status == int(UCS_OK) ? std::string() : status_text(ucs_status_t(t.completion->status));
  return true;
}

void UcxTransport::cancel(const UcxTagged& t) {
  if (t.request != nullptr && !t.completion->done) ucp_request_cancel(worker_, t.request);
}

void UcxTransport::release(UcxTagged& t) {
  if (t.request == nullptr) return;
  ucp_request_free(t.request);
  t.request = nullptr;
}

// ---- the control window ----

void UcxTransport::post(int peer, std::vector<uint8_t> bytes) {
  if (bytes.size() > kSlotBytes)
    raise("cam UCX post", str("a descriptor of ", bytes.size(), " bytes exceeds the slot of ", kSlotBytes));
  auto& box = outbox_[peer];
  box = std::move(bytes);  // the message's source, alive until complete()
  // One eager message carries the bytes and their count together, where a put, a fence and an
  // atomic add were three operations (issuing them took 38-41 us between two simulated hosts,
  // the message 29-34 us: the kernel's TCP send is most of it).
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  rp.flags = UCP_AM_SEND_FLAG_EAGER;
  track(ucp_am_send_nbx(peers_[peer]->ep, kPostMessage, &am_header_, sizeof am_header_, box.data(), box.size(), &rp),
        peer, "post");
}

void UcxTransport::place_post(uint32_t from, const void* data, size_t bytes, bool whole) {
  if (from >= uint32_t(opts_.size) || int(from) == opts_.rank || bytes > kSlotBytes || !whole) {
    // Not a post of this build (no sender cam would send it): the waits report it.
    if (bad_post_.empty())
      bad_post_ = str("a descriptor message of ", bytes, " bytes", whole ? "" : " (rendezvous)", " with sender header ",
                      int(from), " arrived that fits no slot");
    return;
  }
  auto* posted = static_cast<uint64_t*>(window_) + from;  // only this handler adds to it
  std::memcpy(const_cast<uint8_t*>(slot(int(from), __atomic_load_n(posted, __ATOMIC_RELAXED))), data, bytes);
  __atomic_fetch_add(posted, 1, __ATOMIC_RELEASE);
}

void UcxTransport::signal_done(int peer) {
  const Peer& p = *peers_[peer];
  if (unfenced_puts_) fence();  // after the puts that the count announces
  add(peer, p.window + 8 * size_t(opts_.size + opts_.rank), p.rkey->get(), 1);
}

uint64_t UcxTransport::posted(int from) const {
  return __atomic_load_n(static_cast<uint64_t*>(window_) + from, __ATOMIC_ACQUIRE);
}

uint64_t UcxTransport::done(int from) const {
  return __atomic_load_n(static_cast<uint64_t*>(window_) + opts_.size + from, __ATOMIC_ACQUIRE);
}

const uint8_t* UcxTransport::slot(int from, uint64_t n) const {
  return static_cast<const uint8_t*>(window_) + slots_offset(opts_.size) +
         (size_t(from) * kSlotsPerPeer + n % kSlotsPerPeer) * kSlotBytes;
}

// ---- waiting ----

bool UcxTransport::progress() { return ucp_worker_progress(worker_) != 0; }

void UcxTransport::idle(std::chrono::nanoseconds waited) {
  if (waited < std::chrono::microseconds(opts_.spin_us)) return;
  // arm() says BUSY when events are already queued: progress again instead of sleeping.
  if (ucp_worker_arm(worker_) != UCS_OK) return;
  pollfd pfd{efd_, POLLIN, 0};
  ::poll(&pfd, 1, 1);
}

std::string UcxTransport::peer_failure(int peer) const {
  const auto& p = peers_.at(size_t(peer));
  if (!p || p->failed == UCS_OK) return {};
  return str("its UCX endpoint failed with \"", status_text(p->failed), "\" (the process died or ", peer_name(p->rank),
             " is down)");
}

std::string UcxTransport::lost_peer() const {
  if (!bad_post_.empty()) return bad_post_;
  if (!opts_.lost_peer_fails_waits) return {};  // a failed endpoint fails its own requests
  for (int q = 0; q < opts_.size; ++q) {
    const std::string why = peer_failure(q);
    if (!why.empty()) return str("rank ", q, " (", peer_name(q), ") is unreachable: ", why);
  }
  return {};
}

bool UcxTransport::drain_and_arm(bool* moved) {
  while (ucp_worker_progress(worker_) != 0) {
    if (moved) *moved = true;
  }
  // BUSY: events came in meanwhile. Any other failure to arm also returns true: the caller's
  // poll is bounded, and looping here would burn a core.
  return ucp_worker_arm(worker_) != UCS_ERR_BUSY;
}

void UcxTransport::wake() { ucp_worker_signal(worker_); }

std::string UcxTransport::peer_name(int peer) const {
  return peer >= 0 && size_t(peer) < opts_.names.size() ? opts_.names[peer] : "?";
}

void UcxTransport::raise(const std::string& what, const std::string& why) const {
  throw FatalError(str(what, " on rank ", opts_.rank, " of group ", opts_.group_desc, ": ", why));
}

std::string ucx_version() {
  unsigned major = 0, minor = 0, release = 0;
  ucp_get_version(&major, &minor, &release);
  return str(major, ".", minor, ".", release);
}

}  // namespace cam
