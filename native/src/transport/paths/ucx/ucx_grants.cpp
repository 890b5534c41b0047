#include "transport/paths/ucx/ucx_grants.h"

#include <unistd.h>

#include <algorithm>
#include <thread>
#include <cstring>
#include <utility>

#include "log.h"
#include "transport/paths/same_host/same_host.h"
#include "transport/pidfd.h"

namespace datadist::ucx {

namespace {

constexpr uint32_t kMaxGrantTensors = 1u << 16;

#pragma pack(push, 1)
struct WantGrants {
  uint32_t kind;
  uint32_t rma;
  int64_t pid;
};
struct GrantHead {
  uint32_t kind;
  uint32_t num_tensors;  // then, per tensor, a GrantTensor and its key padded to 8 bytes
  uint64_t number;
  int64_t cache_id;
  uint64_t tensor_size;
  uint64_t slot_size;
  uint64_t num_slots;
  uint64_t blocks_model_id;
  uint32_t has_model;
  uint32_t slot;  // DIRECT: the grant's slot in the owner's table (else 0)
  uint64_t state;  // DIRECT: its state there (else 0)
};
struct GrantTensor {
  uint64_t addr;
  uint32_t key_length;
  uint32_t zero;
};
struct RevokeMessage {
  uint32_t kind;  // kRevoke or kRevoked
  uint32_t zero;
  uint64_t number;
};
#pragma pack(pop)
struct TableMessage {
  uint32_t kind;  // kTable or kTableTaken
  uint32_t slots;  // kTableTaken: 1 taken, 0 not
  uint32_t fd;     // the table's descriptor in the owner's process
  uint32_t zero;
  int64_t pid;     // the owner's
};
static_assert(sizeof(GrantHead) == 72, "grant layout");

template <class T>
std::vector<uint8_t> bytes_of(const T &message) {
  std::vector<uint8_t> body(sizeof(T));
  std::memcpy(body.data(), &message, sizeof(T));
  return body;
}

size_t padded(size_t n) { return (n + 7) / 8 * 8; }

}  // namespace

uint32_t grant_message_kind(const uint8_t *body, size_t size) {
  uint32_t kind = 0;
  if (size < sizeof(kind)) return 0;
  std::memcpy(&kind, body, sizeof(kind));
  return kind == kWantGrants || kind == kGrant || kind == kRevoke || kind == kRevoked || kind == kTable ||
                 kind == kTableTaken
             ? kind
             : 0;
}

std::vector<uint8_t> want_grants_message(int rma, pid_t pid) {
  return bytes_of(WantGrants{kWantGrants, static_cast<uint32_t>(rma), static_cast<int64_t>(pid)});
}

bool read_want_grants(const uint8_t *body, size_t size, int &rma, pid_t &pid) {
  WantGrants m{};
  if (size != sizeof(m)) return false;
  std::memcpy(&m, body, sizeof(m));
  if (m.kind != kWantGrants || m.rma > DATADIST_UCX_RMA_DIRECT || m.pid <= 0 || m.pid > INT32_MAX) {
    return false;
  }
  rma = static_cast<int>(m.rma);
  pid = static_cast<pid_t>(m.pid);
  return true;
}

// -- owner -------------------------------------------------------------------

Grantor::Grantor(std::shared_ptr<Worker> worker, Registry &registry, Send send, int rma, pid_t holder)
    : worker_(std::move(worker)),
      registry_(registry),
      send_(std::move(send)),
      rma_(rma),
      holder_(holder) {}

Grantor::~Grantor() { reap(); }

bool Grantor::start(std::string &why) {
  same_host::sweep_held();
  std::shared_ptr<same_host::GrantTable> table;
  if (rma_ == DATADIST_UCX_RMA_DIRECT) {
    table = same_host::GrantTable::create(why);
    if (!table) return false;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (started_ || reaped_) return true;
    started_ = true;
    table_ = table;
    if (table_) {
      // The table before any grant: the link sends this end's messages in order.
      send_(bytes_of(TableMessage{kTable, same_host::GrantTable::kSlots, static_cast<uint32_t>(table_->fd()), 0,
                                  static_cast<int64_t>(::getpid())}));
    }
  }
  registry_.watch(weak_from_this());
  for (const auto &entry : registry_.entries()) added(entry);
  return true;
}

void Grantor::added(const std::shared_ptr<CacheEntry> &entry) {
  // Only what the registry lets peers reach, in host memory.
  if (!entry->remote_accessible || entry->id <= 0 || entry->addrs.empty()) return;
  const size_t n = entry->addrs.size();
  std::vector<std::shared_ptr<Mapping>> maps;
  size_t bytes = sizeof(GrantHead);
  std::string why;
  bool grantable = !entry->device && n <= kMaxGrantTensors;
  for (size_t t = 0; grantable && t < n; ++t) {
    maps.push_back(tensor_mapping(worker_, *entry, t, why));
    grantable = maps.back() != nullptr;
    if (grantable) bytes += sizeof(GrantTensor) + padded(maps.back()->rkey().size());
  }
  if (!grantable || bytes > wire::kMaxBodyBytes) {
    // Its operations stay served here.
    log_message(LogLevel::kDebug, "cache " + std::to_string(entry->id) + " is not granted over UCX" +
                                      (why.empty() ? std::string() : ": " + why));
    refused_.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  std::vector<uint8_t> body(bytes, 0);
  GrantHead head{kGrant,
                 static_cast<uint32_t>(n),
                 0,
                 entry->id,
                 entry->geometry.tensor_size,
                 entry->geometry.slot_size,
                 entry->geometry.num_slots,
                 entry->blocks_model_id.value_or(0),
                 entry->blocks_model_id ? 1u : 0u,
                 0,
                 0};
  uint8_t *at = body.data() + sizeof(head);
  for (const auto &m : maps) {
    const GrantTensor tensor{m->base(), static_cast<uint32_t>(m->rkey().size()), 0};
    std::memcpy(at, &tensor, sizeof(tensor));
    at += sizeof(tensor);
    std::memcpy(at, m->rkey().data(), m->rkey().size());
    at += padded(m->rkey().size());
  }
  // Sent under the lock: a revocation never overtakes its grant.
  std::lock_guard<std::mutex> lock(mu_);
  // Withdrawn is read under the lock removed() takes: a cache withdrawn
  // after this check is revoked by the removed() that follows.
  if (!started_ || reaped_ || entry->withdrawn.load() || given_.count(entry.get()) != 0) return;
  Given given{entry, next_number_++, 0, 0};
  if (table_ && !table_->claim(given.slot, given.state)) {
    refused_.fetch_add(1, std::memory_order_relaxed);  // its operations stay served here
    return;
  }
  head.number = given.number;
  head.slot = given.slot;
  head.state = given.state;
  std::memcpy(body.data(), &head, sizeof(head));
  given_.emplace(entry.get(), std::move(given));
  granted_.fetch_add(1, std::memory_order_relaxed);
  send_(std::move(body));
}

void Grantor::mark_revoked(const Given &given) {
  if (table_) table_->slot(given.slot).state.store(given.state | 1);
}

bool Grantor::quiet(const Given &given) const {
  return table_ && table_->slot(given.slot).in_flight.load() == 0;
}

void Grantor::let_go(Given given) {
  if (table_) table_->release(given.slot);
  given.pin.reset();  // the memory may go back now
}

void Grantor::removed(const std::shared_ptr<CacheEntry> &entry) {
  uint64_t number = 0;
  Given through;  // let go after the lock
  bool done = false;
  {
    std::unique_lock<std::mutex> lock(mu_);
    auto it = given_.find(entry.get());
    if (it == given_.end()) return;
    number = it->second.number;
    mark_revoked(it->second);
    revoking_.emplace(number, std::move(it->second));
    given_.erase(it);
    revoked_.fetch_add(1, std::memory_order_relaxed);
    send_(bytes_of(RevokeMessage{kRevoke, 0, number}));
    // Through once the holder answered (a get or put's time), or (DIRECT)
    // once no operation runs in its slot; the link's end (reap) takes it over.
    auto through_now = [&] {
      auto left = revoking_.find(number);
      return left == revoking_.end() || quiet(left->second);
    };
    // DIRECT: a holder that exited holds nothing (its count stays where it
    // died); its pidfd is opened once the wait begins.
    std::shared_ptr<Pidfd> holder;
    auto gone = [&] { return table_ && exited(holder, holder_); };
    const auto until = std::chrono::steady_clock::now() + kRevokeWait;
    bool waited = false;
    while (!through_now() && !gone() && std::chrono::steady_clock::now() < until) {
      if (!waited) revoke_waits_.fetch_add(1, std::memory_order_relaxed);
      waited = true;
      answered_cv_.wait_for(lock, std::chrono::microseconds(200));
    }
    auto left = revoking_.find(number);
    if (left != revoking_.end()) {
      if (quiet(left->second) || gone()) {
        through = std::move(left->second);
        done = true;
      } else {
        held_.fetch_add(1, std::memory_order_relaxed);
        log_warning("a peer (pid " + std::to_string(holder_) + ") has not let go of its UCX grant of cache " +
                    std::to_string(entry->id) + "; its memory is held until it does");
        quarantined_.emplace(number, std::move(left->second));
      }
      revoking_.erase(left);
    }
  }
  if (done) let_go(std::move(through));
  same_host::sweep_held();
}

bool Grantor::take_answer(const uint8_t *body, size_t size) {
  uint32_t kind = 0;
  if (size < sizeof(kind)) return false;
  std::memcpy(&kind, body, sizeof(kind));
  if (kind == kTableTaken) {
    TableMessage m{};
    if (size != sizeof(m)) return false;
    std::memcpy(&m, body, sizeof(m));
    if (m.slots > 1 || m.fd != 0 || m.zero != 0 || m.pid != 0) return false;
    std::lock_guard<std::mutex> lock(mu_);
    if (table_) table_->close_fd();
    return true;
  }
  RevokeMessage m{};
  if (size != sizeof(m)) return false;
  std::memcpy(&m, body, sizeof(m));
  if (m.kind != kRevoked || m.zero != 0) return false;
  Given through;  // let go after the lock
  bool done = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = revoking_.find(m.number);
    if (it != revoking_.end()) {
      through = std::move(it->second);
      revoking_.erase(it);
      done = true;
      answered_cv_.notify_all();
    } else if ((it = quarantined_.find(m.number)) != quarantined_.end()) {
      through = std::move(it->second);
      quarantined_.erase(it);
      done = true;
    }
  }
  if (done) let_go(std::move(through));
  return true;
}

void Grantor::reap() {
  std::vector<Given> outstanding;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (reaped_) return;
    reaped_ = true;
    for (auto &[entry, g] : given_) outstanding.push_back(std::move(g));
    for (auto &[number, g] : revoking_) outstanding.push_back(std::move(g));
    for (auto &[number, g] : quarantined_) outstanding.push_back(std::move(g));
    given_.clear();
    revoking_.clear();
    quarantined_.clear();
    answered_cv_.notify_all();
  }
  // FENCED: the holder's endpoint reaches memory only while it is mapped
  // here, and it is unmapped before it goes. DIRECT: each grant marked
  // revoked in its slot, and through once no operation runs there or the
  // holder has exited.
  for (Given &g : outstanding) mark_revoked(g);
  const auto until = std::chrono::steady_clock::now() + kRevokeWait;
  std::shared_ptr<Pidfd> holder;  // opened once a grant is not through at once
  for (Given &g : outstanding) {
    while (table_ && !quiet(g) && !exited(holder, holder_) && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    if (!table_ || quiet(g) || exited(holder, holder_)) {
      g.pin.reset();
    } else {
      held_.fetch_add(1, std::memory_order_relaxed);
      hold(std::move(g), holder);
    }
  }
  same_host::sweep_held();
}

void Grantor::hold(Given given, std::shared_ptr<Pidfd> holder) {
  log_warning("a peer (pid " + std::to_string(holder_) + ") is still in an operation under its UCX grant of cache " +
              std::to_string(given.pin->id) + " as its link goes; its memory is held until the peer leaves it or exits");
  same_host::hold_until_quiet(table_, given.slot, std::move(given.pin), std::move(holder));
}

void Grantor::counters(std::map<std::string, uint64_t> &out) const {
  out["grants_given"] += granted_.load(std::memory_order_relaxed);
  out["grants_revoked"] += revoked_.load(std::memory_order_relaxed);
  out["grant_revoke_waits"] += revoke_waits_.load(std::memory_order_relaxed);
  out["grants_quarantined"] += held_.load(std::memory_order_relaxed);
  out["grants_refused"] += refused_.load(std::memory_order_relaxed);
}

// -- holder ------------------------------------------------------------------

bool GrantBook::take(const uint8_t *body, size_t size) {
  uint32_t kind = 0;
  if (size < sizeof(kind)) return false;
  std::memcpy(&kind, body, sizeof(kind));
  if (kind == kTable) {
    TableMessage m{};
    if (size != sizeof(m)) return false;
    std::memcpy(&m, body, sizeof(m));
    if (!direct_ || m.slots != same_host::GrantTable::kSlots || m.zero != 0 || m.pid <= 0 || m.pid > INT32_MAX) {
      return false;
    }
    // The owner's descriptor, taken as the same-host path takes its table
    // (the kernel's ptrace rule, which cma's copies need too).
    std::string why;
    std::shared_ptr<same_host::GrantTable> table = same_host::GrantTable::take(static_cast<pid_t>(m.pid), m.fd, why);
    if (!table) {
      log_warning("the peer's (pid " + std::to_string(m.pid) + ") UCX grant table cannot be taken (" + why +
                  "); its caches are reached through it");
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (table_ || cleared_) return cleared_;  // one table a link
    table_ = std::move(table);
    send_(bytes_of(TableMessage{kTableTaken, table_ ? 1u : 0u, 0, 0, 0}));
    return true;
  }
  if (kind == kRevoke) {
    RevokeMessage m{};
    if (size != sizeof(m)) return false;
    std::memcpy(&m, body, sizeof(m));
    if (m.zero != 0) return false;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = by_number_.find(m.number);
    if (it != by_number_.end()) {
      HeldGrant &g = *it->second;
      g.revoked = true;
      forget_locked(g);
      if (g.in_flight != 0) return true;  // answered by the last leave()
      by_number_.erase(it);
    }
    // Nothing runs under it (or it was never held): answered now.
    send_(bytes_of(RevokeMessage{kRevoked, 0, m.number}));
    return true;
  }
  if (kind != kGrant) return false;
  GrantHead head{};
  if (size < sizeof(head)) return false;
  std::memcpy(&head, body, sizeof(head));
  if (head.num_tensors == 0 || head.num_tensors > kMaxGrantTensors || head.cache_id <= 0 || head.has_model > 1 ||
      head.slot_size == 0 || head.number == 0 || head.slot >= same_host::GrantTable::kSlots ||
      (head.state & 1) != 0 || (!direct_ && (head.slot != 0 || head.state != 0))) {
    return false;
  }
  auto grant = std::make_shared<HeldGrant>();
  auto cache = std::make_shared<CacheEntry>();
  cache->id = head.cache_id;
  cache->geometry = Geometry{head.tensor_size, head.slot_size, head.num_slots};
  cache->remote_accessible = true;
  cache->addrs.resize(head.num_tensors);
  if (head.has_model) cache->blocks_model_id = head.blocks_model_id;
  size_t at = sizeof(head);
  for (uint32_t t = 0; t < head.num_tensors; ++t) {
    GrantTensor tensor{};
    if (size - at < sizeof(tensor)) return false;
    std::memcpy(&tensor, body + at, sizeof(tensor));
    at += sizeof(tensor);
    uint64_t end;
    if (tensor.addr == 0 || __builtin_add_overflow(tensor.addr, head.tensor_size, &end) || tensor.zero != 0 ||
        tensor.key_length == 0 || tensor.key_length > kMaxKeyBytes || size - at < padded(tensor.key_length)) {
      return false;
    }
    const uint8_t *key = body + at;
    if (!std::all_of(key + tensor.key_length, key + padded(tensor.key_length), [](uint8_t b) { return b == 0; })) {
      return false;
    }
    cache->addrs[t] = reinterpret_cast<uint8_t *>(static_cast<uintptr_t>(tensor.addr));
    grant->keys.emplace_back(reinterpret_cast<const char *>(key), tensor.key_length);
    at += padded(tensor.key_length);
  }
  if (at != size) return false;
  grant->cache = std::move(cache);
  grant->number = head.number;
  grant->slot = head.slot;
  grant->state = head.state;
  std::lock_guard<std::mutex> lock(mu_);
  if (cleared_) return true;  // the link is gone
  if (by_number_.count(head.number) != 0) return false;
  grant->table = table_;
  by_number_[head.number] = grant;
  by_id_[head.cache_id] = head.number;
  if (head.has_model) by_model_[head.blocks_model_id] = head.cache_id;
  return true;
}

void GrantBook::forget_locked(const HeldGrant &grant) {
  auto id = by_id_.find(grant.cache->id);
  if (id != by_id_.end() && id->second == grant.number) by_id_.erase(id);
  if (grant.cache->blocks_model_id) {
    auto model = by_model_.find(*grant.cache->blocks_model_id);
    if (model != by_model_.end() && model->second == grant.cache->id && by_id_.count(grant.cache->id) == 0) {
      by_model_.erase(model);
    }
  }
}

std::shared_ptr<HeldGrant> GrantBook::enter(const wire::Target &target, bool *revoked) {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t id = 0;
  if (!same_host::granted_id(target, by_model_, id)) return nullptr;
  auto number = by_id_.find(id);
  if (number == by_id_.end()) return nullptr;
  std::shared_ptr<HeldGrant> grant = by_number_.at(number->second);
  if (!same_host::names_model(target, *grant->cache)) return nullptr;
  if (direct_) {
    // DIRECT: only under the table, counted in its slot, then checked.
    if (!grant->table) return nullptr;
    same_host::GrantSlot &slot = grant->table->slot(grant->slot);
    slot.in_flight.fetch_add(1);
    if (slot.state.load() != grant->state) {
      slot.in_flight.fetch_sub(1);
      forget_locked(*grant);  // its revocation message follows, and is answered then
      if (revoked != nullptr) *revoked = true;
      return nullptr;
    }
  }
  ++grant->in_flight;
  return grant;
}

void GrantBook::leave(const std::shared_ptr<HeldGrant> &grant) {
  if (grant->table) grant->table->slot(grant->slot).in_flight.fetch_sub(1);
  std::lock_guard<std::mutex> lock(mu_);
  if (--grant->in_flight != 0 || !grant->revoked || cleared_) return;
  by_number_.erase(grant->number);
  send_(bytes_of(RevokeMessage{kRevoked, 0, grant->number}));
}

size_t GrantBook::held() const {
  std::lock_guard<std::mutex> lock(mu_);
  return direct_ && !table_ ? 0 : by_id_.size();
}

void GrantBook::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  cleared_ = true;
  table_.reset();
  by_number_.clear();
  by_id_.clear();
  by_model_.clear();
}

}  // namespace datadist::ucx
