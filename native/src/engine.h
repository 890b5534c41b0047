// Engine: one per LLMDataDist instance. Owns the cache registry, the host
// memory pool, the worker threads and the completion queue; the Python
// binding and the C++ API are thin layers over it.
//
// Threads: every method may be called from any thread. finalize() waits for
// calls already inside the engine, fails every request still in flight with
// LLM_ENGINE_FINALIZED, and waits until all of them have settled; later
// calls return LLM_FAILED. An engine is initialised at most once.
#ifndef DATADIST_ENGINE_H_
#define DATADIST_ENGINE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <shared_mutex>
#include <vector>

#include "cache_geometry.h"
#include "completion_queue.h"
#include "host_pool.h"
#include "local_copy.h"
#include "options.h"
#include "registry.h"
#include "request.h"
#include "worker_pool.h"

namespace datadist {

// A cache named by id, or (id < 0) memory unknown to the registry given by
// its description and addresses, as Cache.create_cpu_cache makes.
struct CacheView {
  int64_t cache_id = -1;
  CacheSpec spec;
  std::vector<uintptr_t> addrs;
};

class Engine {
 public:
  explicit Engine(uint64_t cluster_id);
  ~Engine();
  Engine(const Engine &) = delete;
  Engine &operator=(const Engine &) = delete;

  Status initialize(const OptionMap &options);
  void finalize();
  bool initialized() const;
  uint64_t cluster_id() const { return cluster_id_; }
  const EngineOptions &options() const { return options_; }
  const std::shared_ptr<CompletionQueue> &completions() const { return completions_; }
  size_t requests_in_flight() const { return tracker_->in_flight(); }

  Status register_cache(const CacheSpec &spec, const std::vector<uintptr_t> &addrs,
                        const std::vector<KeySpec> &keys, std::optional<uint64_t> blocks_model_id,
                        bool remote_accessible, int64_t &cache_id);
  Status allocate_cache(const CacheSpec &spec, const std::vector<KeySpec> &keys,
                        std::optional<uint64_t> blocks_model_id, int64_t &cache_id,
                        std::vector<uintptr_t> &addrs);
  Status deallocate_cache(int64_t cache_id);
  Status unregister_cache(int64_t cache_id);
  Status remove_cache_key(const KeySpec &key);

  // Data movement. On LLM_SUCCESS `out` is a request already under way;
  // any other status means nothing was started.
  Status copy_cache(int64_t dst_id, int64_t src_id, uint64_t dst_slot, uint64_t src_slot, uint64_t offset,
                    int64_t size, std::shared_ptr<Request> &out);
  Status copy_blocks(const CacheView &dst, const CacheView &src, const BlockPairs &pairs,
                     std::shared_ptr<Request> &out);

 private:
  enum class State { kCreated, kReady, kFinalized };

  Status resolve(const CacheView &view, std::shared_ptr<CacheEntry> &out) const;
  Status start_copy(std::vector<CopySegment> segments, std::vector<std::shared_ptr<CacheEntry>> pins,
                    std::shared_ptr<Request> &out);

  const uint64_t cluster_id_;
  std::shared_ptr<CompletionQueue> completions_;
  std::shared_ptr<RequestTracker> tracker_;
  Registry registry_;
  EngineOptions options_;
  std::shared_ptr<HostPool> host_pool_;
  std::unique_ptr<WorkerPool> workers_;

  mutable std::shared_mutex state_mu_;  // shared by calls, exclusive for init/finalize
  State state_ = State::kCreated;
};

}  // namespace datadist

#endif  // DATADIST_ENGINE_H_
