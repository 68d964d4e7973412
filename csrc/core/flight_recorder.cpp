#include "flight_recorder.hpp"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>

namespace cam {

namespace {

int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// Recorders alive in this process (each removes itself when its group goes away).
std::mutex& registry_mu() {
  static std::mutex mu;
  return mu;
}
std::vector<FlightRecorder*>& registry() {
  static std::vector<FlightRecorder*> r;
  return r;
}
std::atomic<int> g_process_rank{-1};

void json_string(std::string& out, const std::string& s) {
  out += '"';
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += char(c);
        }
    }
  }
  out += '"';
}

const char* state_name(FlightRecorder::State s) {
  switch (s) {
    case FlightRecorder::State::kIssued: return "issued";
    case FlightRecorder::State::kStarted: return "started";
    case FlightRecorder::State::kCompleted: return "completed";
    case FlightRecorder::State::kFailed: return "failed";
  }
  return "?";
}

}  // namespace

std::shared_ptr<FlightRecorder> FlightRecorder::create(Group group, int64_t capacity) {
  std::shared_ptr<FlightRecorder> r(new FlightRecorder(std::move(group), capacity));
  std::lock_guard<std::mutex> lk(registry_mu());
  registry().push_back(r.get());
  return r;
}

FlightRecorder::FlightRecorder(Group group, int64_t capacity)
    : group_(std::move(group)), ring_(size_t(std::max<int64_t>(capacity, 0))) {}

FlightRecorder::~FlightRecorder() {
  std::lock_guard<std::mutex> lk(registry_mu());
  auto& r = registry();
  r.erase(std::remove(r.begin(), r.end(), this), r.end());
}

uint64_t FlightRecorder::issued(const char* op, const char* kind, uint64_t seq, int peer,
                                const std::vector<at::Tensor>* tensors, bool started) {
  if (ring_.empty()) return 0;
  std::lock_guard<std::mutex> lk(mu_);
  const uint64_t id = next_id_++;
  Entry& e = ring_[id % ring_.size()];
  e.id = id;
  e.seq = seq;
  e.op = op;
  e.kind = kind;
  e.peer = peer;
  e.state = started ? State::kStarted : State::kIssued;
  e.issued_us = now_us();
  e.started_us = started ? e.issued_us : 0;
  e.ended_us = 0;
  e.error.clear();
  e.dtype = -1;
  e.ndim = 0;
  e.tensors = 0;
  e.numel = 0;
  if (tensors != nullptr) {
    for (const auto& t : *tensors) {
      if (!t.defined()) continue;
      if (e.tensors++ == 0) {
        e.dtype = int16_t(t.scalar_type());
        e.ndim = int8_t(std::min<int64_t>(t.dim(), 6));
        for (int d = 0; d < e.ndim; ++d) e.sizes[d] = t.size(d);
      }
      e.numel += t.numel();
    }
  }
  return id;
}

FlightRecorder::Entry* FlightRecorder::find(uint64_t id) {
  if (id == 0 || ring_.empty()) return nullptr;
  Entry& e = ring_[id % ring_.size()];
  return e.id == id ? &e : nullptr;
}

void FlightRecorder::started(uint64_t id) {
  if (id == 0) return;
  std::lock_guard<std::mutex> lk(mu_);
  Entry* e = find(id);
  if (e != nullptr && e->state == State::kIssued) {
    e->state = State::kStarted;
    e->started_us = now_us();
  }
}

void FlightRecorder::finished(uint64_t id, const char* error) {
  if (id == 0) return;
  std::lock_guard<std::mutex> lk(mu_);
  Entry* e = find(id);
  if (e == nullptr || e->state == State::kCompleted || e->state == State::kFailed) return;
  e->state = error == nullptr ? State::kCompleted : State::kFailed;
  e->ended_us = now_us();
  if (error != nullptr) e->error = error;
}

void FlightRecorder::set_process_rank(int rank) { g_process_rank.store(rank); }
int FlightRecorder::process_rank() { return g_process_rank.load(); }

void FlightRecorder::append_json(std::string& out) const {
  std::lock_guard<std::mutex> lk(mu_);
  out += "{\"group\": ";
  json_string(out, group_.id);
  out += ", \"desc\": ";
  json_string(out, group_.desc);
  out += ", \"rank\": " + std::to_string(group_.rank) + ", \"size\": " + std::to_string(group_.size);
  out += ", \"capacity\": " + std::to_string(ring_.size()) + ", \"entries\": [";
  // Oldest first: ids are consecutive, so the live ones are the last ring_.size() issued.
  const uint64_t last = next_id_ - 1;
  const uint64_t first = last >= ring_.size() ? last - ring_.size() + 1 : 1;
  bool comma = false;
  for (uint64_t id = first; id <= last && !ring_.empty(); ++id) {
    const Entry& e = ring_[id % ring_.size()];
    if (e.id != id) continue;
    out += comma ? ",\n    " : "\n    ";
    comma = true;
    out += "{\"id\": " + std::to_string(e.id) + ", \"seq\": " + std::to_string(e.seq) + ", \"op\": ";
    json_string(out, e.op);
    out += ", \"kind\": ";
    json_string(out, e.kind);
    out += ", \"peer\": " + std::to_string(e.peer) + ", \"dtype\": ";
    if (e.dtype < 0) out += "null";
    else json_string(out, c10::toString(c10::ScalarType(e.dtype)));
    out += ", \"sizes\": [";
    for (int d = 0; d < e.ndim; ++d) out += (d ? ", " : "") + std::to_string(e.sizes[d]);
    out += "], \"tensors\": " + std::to_string(e.tensors) + ", \"numel\": " + std::to_string(e.numel);
    out += ", \"state\": ";
    json_string(out, state_name(e.state));
    out += ", \"issued_us\": " + std::to_string(e.issued_us) + ", \"started_us\": " +
           std::to_string(e.started_us) + ", \"ended_us\": " + std::to_string(e.ended_us) + ", \"error\": ";
    if (e.error.empty()) out += "null";
    else json_string(out, e.error);
    out += "}";
  }
  out += "]}";
}

std::string FlightRecorder::dump_json(const std::string& reason) {
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  std::string out = "{\"version\": 1, \"rank\": " + std::to_string(process_rank()) +
                    ", \"pid\": " + std::to_string(getpid()) + ", \"host\": ";
  json_string(out, host);
  out += ", \"reason\": ";
  json_string(out, reason);
  out += ", \"dumped_us\": " + std::to_string(now_us()) + ",\n \"groups\": [";
  std::lock_guard<std::mutex> lk(registry_mu());
  bool comma = false;
  for (const FlightRecorder* r : registry()) {
    out += comma ? ",\n  " : "\n  ";
    comma = true;
    r->append_json(out);
  }
  out += "]}\n";
  return out;
}

std::string FlightRecorder::dump_to(const std::string& path, const std::string& reason) {
  const std::string text = dump_json(reason);
  const std::string tmp = path + ".tmp." + std::to_string(getpid());
  FILE* f = std::fopen(tmp.c_str(), "w");
  if (f == nullptr) return "cannot create " + tmp + ": " + std::strerror(errno);
  const bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  const bool closed = std::fclose(f) == 0;
  if (!ok || !closed || std::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    std::remove(tmp.c_str());
    return "cannot write " + path + ": " + why;
  }
  return "";
}

}  // namespace cam
