// Registry: every cache this process owns or registered, by cache id and by
// the keys bound to it.
//
// Ownership: entries are shared. The registry, every key binding and every
// operation in flight hold a reference, so memory returns to the pool only
// when the cache is deallocated, none of its keys is bound any more and no
// transfer touches it.
// Threads: every method may be called from any thread.
#ifndef DATADIST_REGISTRY_H_
#define DATADIST_REGISTRY_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "cache_geometry.h"
#include "host_pool.h"

namespace datadist {

constexpr uint64_t kInvalidId = UINT64_MAX;

namespace cuda {
class Device;
}

// State a data path keeps for one cache (its mappings of the cache's
// memory, say): attached on the path's first use, released before the
// memory is.
class CacheAttachment {
 public:
  virtual ~CacheAttachment() = default;
};

class MemoryUse;

struct CacheEntry {
  CacheEntry() = default;
  ~CacheEntry();
  CacheEntry(const CacheEntry &) = delete;
  CacheEntry &operator=(const CacheEntry &) = delete;

  int64_t id = -1;
  CacheSpec spec;
  Geometry geometry;
  std::vector<uint8_t *> addrs;
  bool remote_accessible = false;
  // Set for allocated caches: the pool their memory returns to.
  std::shared_ptr<HostPool> pool;
  uint8_t *pool_block = nullptr;
  // Set for caches in CUDA device memory (Placement DEVICE): `addrs` are
  // device addresses, which the engine never dereferences.
  std::shared_ptr<cuda::Device> device;
  bool device_allocated = false;  // the engine allocated `addrs` and frees them
  // The model id the registry binds to the whole cache (a blocks cache's).
  std::optional<uint64_t> blocks_model_id;
  // Set once the cache left the registry (deallocated, unregistered,
  // cleared), before the registry's watchers hear of it.
  std::atomic<bool> withdrawn{false};

  // Whether the memory is the caller's (registered), not the engine's: the
  // caller may free it once the cache is unregistered.
  bool caller_owned() const { return !pool && !device_allocated; }

  // Waits until no owner-served operation can touch the memory any more
  // (no MemoryUse of it is left), after the cache was withdrawn. Uses left
  // after `patience` are cut (each fails the link its operation came by),
  // then waited for `after_cut` more. False if some are still left then.
  bool wait_unused(std::chrono::milliseconds patience, std::chrono::milliseconds after_cut);

  // The tensor whose memory holds all of [addr, addr + length), trying
  // `hint` first; addrs.size() when none does.
  size_t tensor_holding(uintptr_t addr, uint64_t length, size_t hint = 0) const;

  // The attachment of `owner` (a path's own tag), made by `make` on the
  // first call; `make` runs under the entry's lock and returns a
  // std::shared_ptr to a CacheAttachment of type T.
  template <class T, class Make>
  std::shared_ptr<T> attachment(const void *owner, Make make) {
    std::lock_guard<std::mutex> lock(attached_mu_);
    for (const auto &a : attached_) {
      if (a.first == owner) return std::static_pointer_cast<T>(a.second);
    }
    std::shared_ptr<T> made = make();
    attached_.emplace_back(owner, made);
    return made;
  }

 private:
  friend class MemoryUse;
  std::mutex attached_mu_;
  std::vector<std::pair<const void *, std::shared_ptr<CacheAttachment>>> attached_;
  // Each MemoryUse of the cache, as the call that cuts it.
  std::mutex uses_mu_;
  std::condition_variable uses_cv_;
  std::list<std::function<void()>> uses_;
};

// An owner-served operation's hold on a registered cache's memory: taken
// once the peer's ranges are resolved, let go when no byte of the operation
// can touch the memory any more (a write's data are in, a read's answer is
// sent or dropped). Registered memory is the caller's again when
// unregister_cache returns, so that waits for the cache's uses
// (CacheEntry::wait_unused).
class MemoryUse {
 public:
  // Null when the cache was withdrawn already: the operation is refused.
  // `cut` ends the operation if it outlasts the wait: it fails the link.
  static std::shared_ptr<MemoryUse> take(std::shared_ptr<CacheEntry> entry, std::function<void()> cut);
  ~MemoryUse();
  MemoryUse(const MemoryUse &) = delete;
  MemoryUse &operator=(const MemoryUse &) = delete;

 private:
  MemoryUse() = default;
  std::shared_ptr<CacheEntry> entry_;
  std::list<std::function<void()>>::iterator at_;
};

// A key as the user spells it: `req_id` (or `prefix_id` when it is not the
// invalid id) together with `model_id`.
struct KeySpec {
  uint64_t req_id = kInvalidId;
  uint64_t model_id = 0;
  uint64_t prefix_id = kInvalidId;
  bool is_placeholder() const { return req_id == kInvalidId && prefix_id == kInvalidId; }
};

// Told when caches come and go, on no lock of the registry's: added() once
// a cache is in the registry, removed() once it has left it (withdrawn is
// set first). A watcher may hear of a cache it saw in entries() again.
class RegistryWatcher {
 public:
  virtual ~RegistryWatcher() = default;
  virtual void added(const std::shared_ptr<CacheEntry> &entry) = 0;
  virtual void removed(const std::shared_ptr<CacheEntry> &entry) = 0;
};

struct CacheRef {
  std::shared_ptr<CacheEntry> entry;
  uint64_t slot = 0;
};

class Registry {
 public:
  // Adds a cache, binds `keys[i]` to slot i (placeholders skip a slot) and,
  // when given, binds `blocks_model_id` to the whole cache. With
  // `check_keys`, more keys than slots, a key bound already or a key given
  // twice is LLM_PARAM_INVALID and nothing is added.
  Status add(std::shared_ptr<CacheEntry> entry, const std::vector<KeySpec> &keys,
             std::optional<uint64_t> blocks_model_id, bool check_keys, int64_t &cache_id);

  std::shared_ptr<CacheEntry> find(int64_t cache_id) const;
  CacheRef find_by_key(const KeySpec &key) const;
  std::shared_ptr<CacheEntry> find_blocks(uint64_t model_id) const;
  // The registered cache with a tensor holding all of [addr, addr + length);
  // `tensor`, when given, gets that tensor's index.
  std::shared_ptr<CacheEntry> find_by_address(uintptr_t addr, uint64_t length, size_t *tensor = nullptr) const;

  // Deallocation of an allocated cache: it leaves the id table and, for a
  // blocks cache, its blocks key; bound contiguous keys keep it alive until
  // they are removed. Registered caches are left alone.
  void deallocate(int64_t cache_id);
  // Forgets a cache and every key bound to it; the cache it withdrew
  // (none for an unknown id).
  std::shared_ptr<CacheEntry> unregister(int64_t cache_id);
  void remove_key(const KeySpec &key);
  // A peer read `tensors` of the slot bound to `key`; once every tensor was
  // read, the key is released (allocated caches only, as remove_key).
  void note_pulled(const KeySpec &key, const std::vector<uint32_t> &tensors);
  void clear();
  size_t size() const;
  // Every cache in the registry now.
  std::vector<std::shared_ptr<CacheEntry>> entries() const;
  // Adds a watcher, held weakly (one that is gone is forgotten).
  void watch(std::weak_ptr<RegistryWatcher> watcher);

 private:
  using KeyId = std::tuple<uint8_t, uint64_t, uint64_t>;  // namespace, id, model id
  static KeyId key_id(const KeySpec &key);
  void drop_keys_locked(const CacheEntry *entry);
  // add()'s part under the registry's lock (taken here), before the watchers hear of it.
  Status insert(const std::shared_ptr<CacheEntry> &entry, const std::vector<KeySpec> &keys,
                std::optional<uint64_t> blocks_model_id, bool check_keys, int64_t &cache_id);
  // Tells the watchers (no lock of the registry's held).
  void tell_added(const std::shared_ptr<CacheEntry> &entry);
  void tell_removed(const std::vector<std::shared_ptr<CacheEntry>> &entries);
  std::vector<std::shared_ptr<RegistryWatcher>> watchers();

  mutable std::mutex mu_;
  int64_t next_id_ = 1;
  std::map<int64_t, std::shared_ptr<CacheEntry>> by_id_;
  std::map<KeyId, CacheRef> by_key_;
  std::map<KeyId, std::vector<bool>> pulled_;  // tensors read so far, per key
  std::mutex watchers_mu_;
  std::vector<std::weak_ptr<RegistryWatcher>> watchers_;
};

}  // namespace datadist

#endif  // DATADIST_REGISTRY_H_
