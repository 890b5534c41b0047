#include "transport/paths/same_host/grants.h"

#include <poll.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>
#include <utility>

#include "log.h"
#include "transport/paths/device/exports.h"
#include "transport/paths/same_host/same_host.h"
#include "transport/pidfd.h"

namespace datadist::same_host {

namespace {

constexpr size_t kTableBytes = sizeof(GrantSlot) * GrantTable::kSlots;
constexpr uint32_t kMaxGrantTensors = 1u << 16;

#pragma pack(push, 1)
struct TableMessage {
  uint32_t kind;
  uint32_t slots;
  uint32_t fd;
  uint32_t zero;
};
struct GrantMessage {
  uint32_t kind;
  uint32_t slot;
  int64_t cache_id;
  uint64_t state;
  uint64_t tensor_size;
  uint64_t slot_size;
  uint64_t num_slots;
  uint64_t blocks_model_id;
  uint32_t has_model;
  uint32_t num_tensors;  // then one uint64 address per tensor (and, for a device cache, a DeviceExport)
};
#pragma pack(pop)

template <class T>
std::vector<uint8_t> bytes_of(const T &message, size_t extra = 0) {
  std::vector<uint8_t> body(sizeof(T) + extra);
  std::memcpy(body.data(), &message, sizeof(T));
  return body;
}

}  // namespace

namespace {

// Memory a holder was still inside (or may still reach) when its grant
// went: held until the holder leaves the slot or exits.
struct Held {
  std::shared_ptr<GrantTable> table;
  uint32_t slot;
  std::shared_ptr<CacheEntry> pin;
  std::shared_ptr<Pidfd> holder;
};
std::mutex held_mu;
std::vector<Held> held;

}  // namespace

void hold_until_quiet(std::shared_ptr<GrantTable> table, uint32_t slot, std::shared_ptr<CacheEntry> pin,
                      std::shared_ptr<Pidfd> holder) {
  std::lock_guard<std::mutex> lock(held_mu);
  held.push_back(Held{std::move(table), slot, std::move(pin), std::move(holder)});
}

void sweep_held() {
  std::vector<std::shared_ptr<CacheEntry>> freed;  // let go after the lock
  std::lock_guard<std::mutex> lock(held_mu);
  for (auto it = held.begin(); it != held.end();) {
    if (it->table->slot(it->slot).in_flight.load() == 0 || !it->holder->alive()) {
      freed.push_back(std::move(it->pin));
      it = held.erase(it);
    } else {
      ++it;
    }
  }
}

bool granted_id(const wire::Target &target, const std::map<uint64_t, int64_t> &by_model, int64_t &id) {
  if (target.kind == wire::kById) {
    id = target.cache_id;
    return true;
  }
  if (target.kind != wire::kBlocksOfModel) return false;
  auto model = by_model.find(target.model_id);
  if (model == by_model.end()) return false;
  id = model->second;
  return true;
}

bool names_model(const wire::Target &target, const CacheEntry &cache) {
  return target.kind != wire::kBlocksOfModel || (cache.blocks_model_id && *cache.blocks_model_id == target.model_id);
}

uint32_t message_kind(const uint8_t *body, size_t size) {
  uint32_t kind = 0;
  if (size < sizeof(kind)) return 0;
  std::memcpy(&kind, body, sizeof(kind));
  return kind == kReachesYouMessage || kind == kGrantTableMessage || kind == kGrantMessage ||
                 kind == kDeviceGrantMessage || kind == kTableTakenMessage
             ? kind
             : 0;
}

std::vector<uint8_t> reaches_you_message() { return bytes_of(kReachesYouMessage); }

std::vector<uint8_t> table_taken_message(bool taken) {
  return bytes_of(TableMessage{kTableTakenMessage, taken ? 1u : 0u, 0, 0});
}

std::shared_ptr<GrantTable> GrantTable::create(std::string &why) {
  const int fd = ::memfd_create("datadist-grants", MFD_CLOEXEC);
  if (fd < 0) {
    why = std::string("memfd_create: ") + std::strerror(errno);
    return nullptr;
  }
  if (::ftruncate(fd, kTableBytes) != 0) {
    why = std::string("ftruncate: ") + std::strerror(errno);
    ::close(fd);
    return nullptr;
  }
  void *at = ::mmap(nullptr, kTableBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (at == MAP_FAILED) {
    why = std::string("mmap: ") + std::strerror(errno);
    ::close(fd);
    return nullptr;
  }
  // A new memfd reads as zeros: every slot at generation 0, nothing in flight.
  return std::shared_ptr<GrantTable>(new GrantTable(static_cast<GrantSlot *>(at), fd));
}

std::shared_ptr<GrantTable> GrantTable::open(int fd, std::string &why) {
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || static_cast<size_t>(st.st_size) != kTableBytes) {
    why = "the owner's grant table is not a table of " + std::to_string(kSlots) + " slots";
    ::close(fd);
    return nullptr;
  }
  void *at = ::mmap(nullptr, kTableBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int error = errno;
  ::close(fd);
  if (at == MAP_FAILED) {
    why = std::string("mmap of the owner's grant table: ") + std::strerror(error);
    return nullptr;
  }
  return std::shared_ptr<GrantTable>(new GrantTable(static_cast<GrantSlot *>(at), -1));
}

GrantTable::~GrantTable() {
  ::munmap(slots_, kTableBytes);
  close_fd();
}

std::shared_ptr<GrantTable> GrantTable::take(pid_t owner, uint32_t number, std::string &why) {
  const int fd = take_descriptor(owner, number, why);
  return fd >= 0 ? open(fd, why) : nullptr;
}

bool GrantTable::claim(uint32_t &slot, uint64_t &state) {
  std::lock_guard<std::mutex> lock(claim_mu_);
  if (!filled_) {
    free_slots_.reserve(kSlots);
    for (uint32_t s = kSlots; s > 0; --s) free_slots_.push_back(s - 1);
    filled_ = true;
  }
  if (free_slots_.empty()) return false;
  slot = free_slots_.back();
  free_slots_.pop_back();
  state = ++generation_ << 1;
  slots_[slot].state.store(state);
  return true;
}

void GrantTable::release(uint32_t slot) {
  std::lock_guard<std::mutex> lock(claim_mu_);
  free_slots_.push_back(slot);
}

void GrantTable::close_fd() {
  const int fd = fd_.exchange(-1);
  if (fd >= 0) ::close(fd);
}

// -- owner -------------------------------------------------------------------

Grantor::Grantor(Registry &registry, Send send, pid_t holder)
    : registry_(registry), send_(std::move(send)), holder_(holder) {}

Grantor::~Grantor() { reap(); }

bool Grantor::take_answer(const uint8_t *body, size_t size) {
  (void)body;
  if (size != sizeof(TableMessage)) return false;
  std::lock_guard<std::mutex> lock(mu_);
  if (table_) table_->close_fd();
  return true;
}

bool Grantor::start(std::string &why) {
  std::shared_ptr<GrantTable> table = GrantTable::create(why);
  if (!table) return false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (reaped_) return false;
    table_ = table;
    started_ = true;
  }
  // The table before any grant: the link sends this end's messages in order.
  send_(bytes_of(TableMessage{kGrantTableMessage, GrantTable::kSlots, static_cast<uint32_t>(table->fd()), 0}));
  registry_.watch(weak_from_this());
  for (const auto &entry : registry_.entries()) added(entry);
  return true;
}

bool Grantor::export_tensors(const CacheEntry &entry, std::vector<device_exports::DeviceExport> &out) {
  out.clear();
  out.reserve(entry.addrs.size());
  for (uint8_t *at : entry.addrs) {
    const auto addr = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(at));
    cuda::Export e;
    std::string why;
    if (!entry.device->export_at(addr, true, e, why)) {
      log_message(LogLevel::kDebug, "cache " + std::to_string(entry.id) + " is not granted: " + why);
      return false;
    }
    if (addr - e.base > e.size || entry.geometry.tensor_size > e.size - (addr - e.base)) {
      log_message(LogLevel::kDebug, "cache " + std::to_string(entry.id) + " is not granted: a tensor spans allocations");
      return false;
    }
    out.push_back(device_exports::to_wire(e, entry.device->ordinal()));
  }
  return true;
}

void Grantor::added(const std::shared_ptr<CacheEntry> &entry) {
  // Only what the registry lets peers reach.
  if (!entry->remote_accessible || entry->id <= 0 || entry->addrs.empty()) return;
  // Device memory as its allocations' exports (made before the lock: the
  // driver is called), within what one message carries.
  std::vector<device_exports::DeviceExport> exports;
  if (entry->device) {
    const uint64_t bytes = sizeof(GrantMessage) + entry->addrs.size() * (sizeof(uint64_t) + sizeof(device_exports::DeviceExport));
    if (bytes > wire::kMaxBodyBytes || !export_tensors(*entry, exports)) {
      refused_.fetch_add(1, std::memory_order_relaxed);
      return;
    }
  }
  GrantMessage message{};
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Withdrawn is read under the lock removed() takes: a cache withdrawn
    // after this check is revoked by the removed() that follows.
    if (!started_ || reaped_ || entry->withdrawn.load() || given_.count(entry.get()) != 0) return;
    Given given;
    given.pin = entry;
    if (!table_->claim(given.slot, given.state)) {
      refused_.fetch_add(1, std::memory_order_relaxed);  // its operations stay served here
      return;
    }
    message = GrantMessage{entry->device ? kDeviceGrantMessage : kGrantMessage,
                           given.slot,
                           entry->id,
                           given.state,
                           entry->geometry.tensor_size,
                           entry->geometry.slot_size,
                           entry->geometry.num_slots,
                           entry->blocks_model_id.value_or(0),
                           entry->blocks_model_id ? 1u : 0u,
                           static_cast<uint32_t>(entry->addrs.size())};
    given_.emplace(entry.get(), std::move(given));
  }
  const size_t n = entry->addrs.size();
  std::vector<uint8_t> body = bytes_of(message, n * sizeof(uint64_t) + exports.size() * sizeof(device_exports::DeviceExport));
  uint8_t *at = body.data() + sizeof(GrantMessage);
  for (size_t t = 0; t < n; ++t, at += sizeof(uint64_t)) {
    const uint64_t addr = reinterpret_cast<uintptr_t>(entry->addrs[t]);
    std::memcpy(at, &addr, sizeof(addr));
  }
  if (!exports.empty()) std::memcpy(at, exports.data(), exports.size() * sizeof(device_exports::DeviceExport));
  granted_.fetch_add(1, std::memory_order_relaxed);
  send_(std::move(body));
}

void Grantor::removed(const std::shared_ptr<CacheEntry> &entry) {
  Given given;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = given_.find(entry.get());
    if (it == given_.end()) return;
    given = std::move(it->second);
    given_.erase(it);
  }
  revoke(std::move(given));
}

void Grantor::revoke(Given given) {
  GrantSlot &slot = table_->slot(given.slot);
  slot.state.store(given.state | 1);
  revoked_.fetch_add(1, std::memory_order_relaxed);
  // Once the count is seen at 0 after the state was marked, every copy
  // that found the grant standing has ended, and any later one finds it
  // revoked: a count seen above 0 again afterwards is such a one, leaving.
  // A copy running takes a kernel call's time; a holder that died holds
  // nothing.
  std::shared_ptr<Pidfd> holder;
  const auto until = std::chrono::steady_clock::now() + kRevokeWait;
  bool quiet = false;
  for (;;) {
    if (slot.in_flight.load() == 0) {
      quiet = true;
      break;
    }
    if (!holder) revoke_waits_.fetch_add(1, std::memory_order_relaxed);
    if (exited(holder, holder_)) {
      quiet = true;
      break;
    }
    if (std::chrono::steady_clock::now() >= until) break;
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  if (!quiet) {
    quarantined_.fetch_add(1, std::memory_order_relaxed);
    log_warning("a peer (pid " + std::to_string(holder_) + ") is still in a copy under its grant of cache " +
                std::to_string(given.pin->id) + "; its memory is held until that copy ends");
    hold_until_quiet(table_, given.slot, std::move(given.pin), std::move(holder));
    return;
  }
  table_->release(given.slot);
  given.pin.reset();  // the memory may go back now
  sweep_held();
}

void Grantor::reap() {
  std::unordered_map<const CacheEntry *, Given> given;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (reaped_) return;
    reaped_ = true;
    given.swap(given_);
  }
  for (auto &[entry, g] : given) revoke(std::move(g));
}

void Grantor::counters(std::map<std::string, uint64_t> &out) const {
  out["grants_given"] += granted_.load(std::memory_order_relaxed);
  out["grants_revoked"] += revoked_.load(std::memory_order_relaxed);
  out["grant_revoke_waits"] += revoke_waits_.load(std::memory_order_relaxed);
  out["grants_quarantined"] += quarantined_.load(std::memory_order_relaxed);
  out["grants_refused"] += refused_.load(std::memory_order_relaxed);
}

// -- holder ------------------------------------------------------------------

GrantUse::GrantUse(std::shared_ptr<GrantTable> table, const Grant &grant)
    : table_(std::move(table)), slot_(table_->slot(grant.slot)) {
  slot_.in_flight.fetch_add(1);
  entered_ = slot_.state.load() == grant.state;
  if (!entered_) slot_.in_flight.fetch_sub(1);
}

GrantUse::~GrantUse() {
  if (entered_) slot_.in_flight.fetch_sub(1);
}

bool GrantBook::take(const uint8_t *body, size_t size, std::vector<uint8_t> &answer) {
  uint32_t kind = 0;
  if (size < sizeof(kind)) return false;
  std::memcpy(&kind, body, sizeof(kind));
  switch (kind) {
    case kGrantTableMessage: {
      TableMessage m{};
      if (size != sizeof(m)) return false;
      std::memcpy(&m, body, sizeof(m));
      if (m.slots != GrantTable::kSlots || m.zero != 0) return false;
      std::string why;
      std::shared_ptr<GrantTable> table = GrantTable::take(owner_, m.fd, why);
      if (!table) {
        log_warning("the peer's (pid " + std::to_string(owner_) + ") grant table cannot be taken (" + why +
                    "); its caches are reached through it");
      }
      answer = table_taken_message(table != nullptr);
      std::lock_guard<std::mutex> lock(mu_);
      if (table_ != nullptr) return false;  // one table a link
      table_ = std::move(table);
      return true;
    }
    case kGrantMessage:
    case kDeviceGrantMessage: {
      GrantMessage m{};
      if (size < sizeof(m)) return false;
      std::memcpy(&m, body, sizeof(m));
      const uint64_t each = sizeof(uint64_t) + (kind == kDeviceGrantMessage ? sizeof(device_exports::DeviceExport) : 0);
      if (m.slot >= GrantTable::kSlots || m.num_tensors == 0 || m.num_tensors > kMaxGrantTensors ||
          size != sizeof(m) + uint64_t{m.num_tensors} * each || m.cache_id <= 0 || m.has_model > 1 ||
          (m.state & 1) != 0 || m.slot_size == 0) {
        return false;
      }
      auto cache = std::make_shared<CacheEntry>();
      cache->id = m.cache_id;
      cache->geometry = Geometry{m.tensor_size, m.slot_size, m.num_slots};
      cache->remote_accessible = true;
      cache->addrs.resize(m.num_tensors);
      const uint8_t *at = body + sizeof(m);
      for (uint32_t t = 0; t < m.num_tensors; ++t, at += sizeof(uint64_t)) {
        uint64_t addr;
        std::memcpy(&addr, at, sizeof(addr));
        uint64_t end;
        if (addr == 0 || __builtin_add_overflow(addr, m.tensor_size, &end)) return false;
        cache->addrs[t] = reinterpret_cast<uint8_t *>(static_cast<uintptr_t>(addr));
      }
      if (m.has_model) cache->blocks_model_id = m.blocks_model_id;
      auto grant = std::make_shared<Grant>();
      if (kind == kDeviceGrantMessage) {
        // Each tensor inside the allocation it names (its size is checked
        // again against what the driver opens).
        grant->exports.resize(m.num_tensors);
        std::memcpy(grant->exports.data(), at, m.num_tensors * sizeof(device_exports::DeviceExport));
        for (uint32_t t = 0; t < m.num_tensors; ++t) {
          const device_exports::DeviceExport &e = grant->exports[t];
          const auto addr = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(cache->addrs[t]));
          if ((e.kind != device_exports::kExportIpc && e.kind != device_exports::kExportFd) || addr < e.base) return false;
        }
      }
      grant->cache = std::move(cache);
      grant->slot = m.slot;
      grant->state = m.state;
      std::lock_guard<std::mutex> lock(mu_);
      forget_revoked_locked();
      by_id_[m.cache_id] = grant;
      if (m.has_model) by_model_[m.blocks_model_id] = m.cache_id;
      return true;
    }
    default:
      return false;
  }
}

std::shared_ptr<const Grant> GrantBook::find(const wire::Target &target) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!table_) return nullptr;
  int64_t id = 0;
  if (!granted_id(target, by_model_, id)) return nullptr;
  auto it = by_id_.find(id);
  if (it == by_id_.end() || !names_model(target, *it->second->cache)) return nullptr;
  return it->second;
}

void GrantBook::drop(const std::shared_ptr<const Grant> &grant) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = by_id_.find(grant->cache->id);
  if (it != by_id_.end() && it->second == grant) by_id_.erase(it);
}

std::shared_ptr<GrantTable> GrantBook::table() const {
  std::lock_guard<std::mutex> lock(mu_);
  return table_;
}

size_t GrantBook::held() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!table_) return 0;
  size_t standing = 0;
  for (const auto &[id, grant] : by_id_) standing += table_->slot(grant->slot).state.load() == grant->state;
  return standing;
}

void GrantBook::forget_revoked_locked() {
  if (!table_) return;
  for (auto it = by_id_.begin(); it != by_id_.end();) {
    it = table_->slot(it->second->slot).state.load() == it->second->state ? std::next(it) : by_id_.erase(it);
  }
}

void GrantBook::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  table_.reset();
  by_id_.clear();
  by_model_.clear();
}

}  // namespace datadist::same_host
