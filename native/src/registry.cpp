#include "registry.h"

#include <set>

#include "device/cuda_driver.h"
#include "error_detail.h"

namespace datadist {

using llm_datadist::LLM_PARAM_INVALID;
using llm_datadist::LLM_SUCCESS;

namespace {
constexpr uint8_t kRequestKeys = 0;
constexpr uint8_t kPrefixKeys = 1;
constexpr uint8_t kBlocksKeys = 2;
}  // namespace

CacheEntry::~CacheEntry() {
  attached_.clear();  // each path lets go of the memory while it is there
  if (pool) pool->free(pool_block);
  if (device_allocated) device->free(addrs);
}

bool CacheEntry::wait_unused(std::chrono::milliseconds patience, std::chrono::milliseconds after_cut) {
  std::unique_lock<std::mutex> lock(uses_mu_);
  if (uses_cv_.wait_for(lock, patience, [this] { return uses_.empty(); })) return true;
  const std::vector<std::function<void()>> cuts(uses_.begin(), uses_.end());
  lock.unlock();
  for (const auto &cut : cuts) cut();
  lock.lock();
  return uses_cv_.wait_for(lock, after_cut, [this] { return uses_.empty(); });
}

std::shared_ptr<MemoryUse> MemoryUse::take(std::shared_ptr<CacheEntry> entry, std::function<void()> cut) {
  std::shared_ptr<MemoryUse> use(new MemoryUse());
  std::lock_guard<std::mutex> lock(entry->uses_mu_);
  // Withdrawn is set before a waiter takes the lock: either the waiter
  // finds this use, or this finds the cache withdrawn.
  if (entry->withdrawn.load()) return nullptr;
  use->at_ = entry->uses_.insert(entry->uses_.end(), std::move(cut));
  use->entry_ = std::move(entry);
  return use;
}

MemoryUse::~MemoryUse() {
  if (!entry_) return;
  {
    std::lock_guard<std::mutex> lock(entry_->uses_mu_);
    entry_->uses_.erase(at_);
  }
  entry_->uses_cv_.notify_all();
}

Registry::KeyId Registry::key_id(const KeySpec &key) {
  if (key.prefix_id != kInvalidId) return KeyId{kPrefixKeys, key.prefix_id, key.model_id};
  return KeyId{kRequestKeys, key.req_id, key.model_id};
}

Status Registry::add(std::shared_ptr<CacheEntry> entry, const std::vector<KeySpec> &keys,
                     std::optional<uint64_t> blocks_model_id, bool check_keys, int64_t &cache_id) {
  Status st = insert(entry, keys, blocks_model_id, check_keys, cache_id);
  if (st == LLM_SUCCESS) tell_added(entry);
  return st;
}

Status Registry::insert(const std::shared_ptr<CacheEntry> &entry, const std::vector<KeySpec> &keys,
                        std::optional<uint64_t> blocks_model_id, bool check_keys, int64_t &cache_id) {
  std::lock_guard<std::mutex> lock(mu_);
  if (check_keys) {
    if (keys.size() > entry->geometry.num_slots) {
      return refuse(LLM_PARAM_INVALID, words(keys.size(), " cache keys for ", entry->geometry.num_slots,
                                             " batch slots (shape[0])"));
    }
    std::set<KeyId> seen;
    for (size_t k = 0; k < keys.size(); ++k) {
      const KeySpec &key = keys[k];
      if (key.is_placeholder()) continue;
      const KeyId id = key_id(key);
      if (by_key_.count(id) != 0) {
        return refuse(LLM_PARAM_INVALID, words("cache_keys[", k, "] is already bound to another cache"));
      }
      if (!seen.insert(id).second) {
        return refuse(LLM_PARAM_INVALID, words("cache_keys[", k, "] repeats an earlier key of the same call"));
      }
    }
    if (blocks_model_id && by_key_.count(KeyId{kBlocksKeys, *blocks_model_id, 0}) != 0) {
      return refuse(LLM_PARAM_INVALID,
                    words("a blocks cache is already bound to model_id ", *blocks_model_id));
    }
  }
  entry->id = next_id_++;
  by_id_.emplace(entry->id, entry);
  for (size_t slot = 0; slot < keys.size(); ++slot) {
    if (keys[slot].is_placeholder()) continue;
    by_key_.emplace(key_id(keys[slot]), CacheRef{entry, slot});  // keeps an existing binding
  }
  if (blocks_model_id) {
    by_key_[KeyId{kBlocksKeys, *blocks_model_id, 0}] = CacheRef{entry, 0};
    entry->blocks_model_id = blocks_model_id;
  }
  cache_id = entry->id;
  return LLM_SUCCESS;
}

std::shared_ptr<CacheEntry> Registry::find(int64_t cache_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = by_id_.find(cache_id);
  return it == by_id_.end() ? nullptr : it->second;
}

CacheRef Registry::find_by_key(const KeySpec &key) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = by_key_.find(key_id(key));
  return it == by_key_.end() ? CacheRef{} : it->second;
}

std::shared_ptr<CacheEntry> Registry::find_blocks(uint64_t model_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = by_key_.find(KeyId{kBlocksKeys, model_id, 0});
  return it == by_key_.end() ? nullptr : it->second.entry;
}

size_t CacheEntry::tensor_holding(uintptr_t addr, uint64_t length, size_t hint) const {
  uintptr_t end;
  if (__builtin_add_overflow(addr, length, &end)) return addrs.size();
  const uint64_t size = geometry.tensor_size;
  auto holds = [&](size_t t) {
    const auto start = reinterpret_cast<uintptr_t>(addrs[t]);
    return addr >= start && end <= start + size;
  };
  if (hint < addrs.size() && holds(hint)) return hint;
  for (size_t t = 0; t < addrs.size(); ++t) {
    if (holds(t)) return t;
  }
  return addrs.size();
}

std::shared_ptr<CacheEntry> Registry::find_by_address(uintptr_t addr, uint64_t length, size_t *tensor) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto &entry : by_id_) {
    // Device caches too: with CUDA's unified addressing (every 64-bit
    // platform the driver supports) no device range overlaps a host one.
    const size_t t = entry.second->tensor_holding(addr, length);
    if (t < entry.second->addrs.size()) {
      if (tensor != nullptr) *tensor = t;
      return entry.second;
    }
  }
  return nullptr;
}

void Registry::drop_keys_locked(const CacheEntry *entry) {
  for (auto it = by_key_.begin(); it != by_key_.end();) {
    if (it->second.entry.get() != entry) {
      ++it;
      continue;
    }
    pulled_.erase(it->first);
    it = by_key_.erase(it);
  }
}

void Registry::deallocate(int64_t cache_id) {
  std::shared_ptr<CacheEntry> doomed;  // released after the lock
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = by_id_.find(cache_id);
    if (it == by_id_.end() || !(it->second->pool || it->second->device_allocated)) return;
    doomed = it->second;
    by_id_.erase(it);
    for (auto key = by_key_.begin(); key != by_key_.end();) {
      const bool blocks_key = std::get<0>(key->first) == kBlocksKeys;
      key = (blocks_key && key->second.entry == doomed) ? by_key_.erase(key) : std::next(key);
    }
    doomed->withdrawn.store(true);
  }
  tell_removed({doomed});
}

std::shared_ptr<CacheEntry> Registry::unregister(int64_t cache_id) {
  std::shared_ptr<CacheEntry> doomed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = by_id_.find(cache_id);
    if (it == by_id_.end()) return nullptr;
    doomed = it->second;
    by_id_.erase(it);
    drop_keys_locked(doomed.get());
    doomed->withdrawn.store(true);
  }
  tell_removed({doomed});
  return doomed;
}

void Registry::remove_key(const KeySpec &key) {
  CacheRef doomed;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = by_key_.find(key_id(key));
  if (it == by_key_.end() || !it->second.entry->pool) return;  // registered caches keep their keys
  doomed = it->second;
  pulled_.erase(it->first);
  by_key_.erase(it);
}

void Registry::note_pulled(const KeySpec &key, const std::vector<uint32_t> &tensors) {
  CacheRef released;
  std::lock_guard<std::mutex> lock(mu_);
  const KeyId id = key_id(key);
  auto it = by_key_.find(id);
  if (it == by_key_.end() || !it->second.entry->pool) return;
  std::vector<bool> &seen = pulled_[id];
  seen.resize(it->second.entry->addrs.size(), false);
  for (uint32_t t : tensors) {
    if (t < seen.size()) seen[t] = true;
  }
  for (bool read : seen) {
    if (!read) return;
  }
  released = it->second;
  by_key_.erase(it);
  pulled_.erase(id);
}

void Registry::clear() {
  std::map<int64_t, std::shared_ptr<CacheEntry>> ids;
  std::map<KeyId, CacheRef> keys;
  std::vector<std::shared_ptr<CacheEntry>> doomed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ids.swap(by_id_);
    keys.swap(by_key_);
    pulled_.clear();
    for (auto &[id, entry] : ids) {
      entry->withdrawn.store(true);
      doomed.push_back(entry);
    }
  }
  tell_removed(doomed);
}

std::vector<std::shared_ptr<CacheEntry>> Registry::entries() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::shared_ptr<CacheEntry>> out;
  out.reserve(by_id_.size());
  for (const auto &[id, entry] : by_id_) out.push_back(entry);
  return out;
}

void Registry::watch(std::weak_ptr<RegistryWatcher> watcher) {
  std::lock_guard<std::mutex> lock(watchers_mu_);
  watchers_.push_back(std::move(watcher));
}

std::vector<std::shared_ptr<RegistryWatcher>> Registry::watchers() {
  std::lock_guard<std::mutex> lock(watchers_mu_);
  std::vector<std::shared_ptr<RegistryWatcher>> live;
  for (auto it = watchers_.begin(); it != watchers_.end();) {
    if (auto w = it->lock()) {
      live.push_back(std::move(w));
      ++it;
    } else {
      it = watchers_.erase(it);
    }
  }
  return live;
}

void Registry::tell_added(const std::shared_ptr<CacheEntry> &entry) {
  for (const auto &w : watchers()) w->added(entry);
}

void Registry::tell_removed(const std::vector<std::shared_ptr<CacheEntry>> &entries) {
  if (entries.empty()) return;
  for (const auto &w : watchers()) {
    for (const auto &entry : entries) w->removed(entry);
  }
}

size_t Registry::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return by_id_.size();
}

}  // namespace datadist
