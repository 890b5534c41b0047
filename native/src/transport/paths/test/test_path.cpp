#include "transport/paths/test/test_path.h"

#include <cstring>
#include <mutex>
#include <utility>
#include <vector>

#include "registry.h"
#include "transport/auth.h"
#include "transport/planned_frame.h"
#include "transport/target_resolver.h"

namespace datadist::test_path {

using llm_datadist::LLM_SUCCESS;

namespace {

#pragma pack(push, 1)
struct Part {
  uint8_t token[16];
  uint64_t engine;
};
#pragma pack(pop)

// The engines of this process with the path on, by number; an entry goes
// when its engine's transport stops, under the lock, so a registry found
// here is there while the lock is held.
struct Engines {
  std::mutex mu;
  std::map<uint64_t, Registry *> registries;
  uint64_t next = 1;
  uint8_t token[16];
  Engines() { auth::random_bytes(token, sizeof(token)); }
};

Engines &engines() {
  static Engines *e = new Engines();  // outlives every engine
  return *e;
}

std::string encode(uint64_t engine) {
  Part part{};
  std::memcpy(part.token, engines().token, sizeof(part.token));
  part.engine = engine;
  return std::string(reinterpret_cast<const char *>(&part), sizeof(part));
}

// The peer's engine number when `bytes` name an engine of this process; 0 otherwise.
uint64_t peer_of(const std::string &bytes) {
  Part part{};
  if (bytes.size() != sizeof(part)) return 0;
  std::memcpy(&part, bytes.data(), sizeof(part));
  Engines &e = engines();
  std::lock_guard<std::mutex> lock(e.mu);
  if (std::memcmp(part.token, e.token, sizeof(part.token)) != 0) return 0;
  return e.registries.count(part.engine) != 0 ? part.engine : 0;
}

class Handshake : public PathHandshake {
 public:
  explicit Handshake(uint64_t engine) : engine_(engine) {}
  std::string hello_part(uint32_t index) override { return index == 0 ? encode(engine_) : std::string(); }
  Status settle(const std::string &part, bool, std::string &) override {
    peer_ = peer_of(part);
    return LLM_SUCCESS;
  }
  Status accept(const std::vector<std::string> &parts, bool, std::string &) override {
    peer_ = parts.empty() ? 0 : peer_of(parts[0]);
    return LLM_SUCCESS;
  }
  std::string ack_part() override { return peer_ != 0 ? encode(engine_) : std::string(); }
  void paths(std::vector<std::shared_ptr<DataPath>> &out) override {
    if (peer_ != 0) out.push_back(std::make_shared<TestPath>(peer_));
  }

 private:
  const uint64_t engine_;
  uint64_t peer_ = 0;
};

}  // namespace

TestKind::TestKind(Registry &registry)
    : engine_([&registry] {
        Engines &e = engines();
        std::lock_guard<std::mutex> lock(e.mu);
        const uint64_t engine = e.next++;
        e.registries[engine] = &registry;
        return engine;
      }()) {}

TestKind::~TestKind() { TestKind::stop(); }

void TestKind::stop() {
  Engines &e = engines();
  std::lock_guard<std::mutex> lock(e.mu);
  e.registries.erase(engine_);
}

std::unique_ptr<PathHandshake> TestKind::handshake(uint64_t, bool) { return std::make_unique<Handshake>(engine_); }

bool TestPath::move(bool write, const PlannedFrame &planned, const std::shared_ptr<cuda::Device> &device,
                    const Settle &settle) {
  const wire::Target &t = planned.target;
  if (device || (t.flags & (wire::kReleaseKey | wire::kPathTrailer)) != 0) return false;
  // The request as the owner reads it off the wire: strides unrolled, its
  // sizes bounded.
  std::vector<wire::Stride> strides = planned.strides;
  for (wire::Stride &stride : strides) stride.segment_stride = 0;
  wire::Request req;
  if (!wire::decode_request(wire::encode_request(t, planned.ranges, planned.bounds, {}, strides), req).empty()) {
    return false;
  }
  ResolvedTarget target;
  Status st;
  {
    Engines &e = engines();
    std::lock_guard<std::mutex> lock(e.mu);
    auto it = e.registries.find(peer_engine_);
    if (it == e.registries.end()) return false;  // the owner stopped: its link goes down
    st = resolve_request(*it->second, req, target);
  }
  if (st != LLM_SUCCESS) {
    refused_.fetch_add(1, std::memory_order_relaxed);
    settle(st, "refused by the owner's checks, nothing moved: " + target.why);
    return true;
  }
  // The owner's device memory goes by the other paths; `target.pins` keep
  // its memory while the bytes move.
  if (target.device || target.iov.size() != planned.local.size()) return false;
  for (size_t i = 0; i < target.iov.size(); ++i) {
    if (target.iov[i].iov_len != planned.local[i].iov_len) return false;
  }
  for (size_t i = 0; i < target.iov.size(); ++i) {
    const iovec &mine = planned.local[i], &theirs = target.iov[i];
    std::memcpy(write ? theirs.iov_base : mine.iov_base, write ? mine.iov_base : theirs.iov_base, mine.iov_len);
  }
  moves_.fetch_add(1, std::memory_order_relaxed);
  bytes_.fetch_add(req.total_bytes, std::memory_order_relaxed);
  settle(LLM_SUCCESS, {});
  return true;
}

void TestPath::counters(std::map<std::string, uint64_t> &out) const {
  out["test_moves"] += moves_.load(std::memory_order_relaxed);
  out["test_bytes"] += bytes_.load(std::memory_order_relaxed);
  out["test_refused"] += refused_.load(std::memory_order_relaxed);
}

}  // namespace datadist::test_path
