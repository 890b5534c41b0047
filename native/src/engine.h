// Engine: one per LLMDataDist instance. Owns the cache registry, the host
// memory pool, the worker threads and the completion queue; the Python
// binding and the C++ API are thin layers over it.
//
// Threads: every method may be called from any thread.
// Errors: a method that refuses its arguments records why on the calling
// thread (error_detail.h), and clears that record when it starts. finalize() waits for
// calls already inside the engine, fails every request still in flight with
// LLM_ENGINE_FINALIZED, and waits until all of them have settled; later
// calls return LLM_FAILED. An engine is initialised at most once.
#ifndef DATADIST_ENGINE_H_
#define DATADIST_ENGINE_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <shared_mutex>
#include <unordered_map>
#include <vector>

#include "cache_geometry.h"
#include "comm_links.h"
#include "completion_queue.h"
#include "device/cuda_driver.h"
#include "host_pool.h"
#include "local_copy.h"
#include "options.h"
#include "registry.h"
#include "remote_plan.h"
#include "request.h"
#include "transport/link_manager.h"
#include "worker_pool.h"

namespace datadist {

// A cache named by id, or (id < 0) memory unknown to the registry given by
// its description and addresses, as Cache.create_cpu_cache makes.
struct CacheView {
  int64_t cache_id = -1;
  CacheSpec spec;
  std::vector<uintptr_t> addrs;
};

// A cache on a peer: by id, by a key bound to one of its slots, or the
// blocks cache of a model id; `slot` is the batch slot to use (counted from
// the key's slot for a key).
struct RemoteName {
  uint8_t kind = wire::kById;
  int64_t cache_id = -1;
  KeySpec key;
  uint64_t model_id = 0;
  uint64_t slot = 0;
};

// Bytes [src_offset, src_offset + length) of block src_block of a peer's
// blocks cache, paired with [dst_offset, dst_offset + length) of local block
// dst_block (Engine::pull_ranges); with count > 1, `count` such pairs, the
// j-th src_stride and dst_stride bytes further on (each stride >= length):
// a slice of every row of a block, sent as one strided range.
struct BlockRange {
  uint64_t src_block = 0;
  uint64_t src_offset = 0;
  uint64_t dst_block = 0;
  uint64_t dst_offset = 0;
  uint64_t length = 0;
  uint64_t count = 1;
  uint64_t src_stride = 0;
  uint64_t dst_stride = 0;
};

// One layer of a layer-wise transfer to one destination. With no block
// lists the source batch slot moves whole; with both, blocks move to
// blocks; with destination blocks only, the slot is cut into chunks of
// `chunk_size` bytes, chunk j going to destination block j; with `ranges`
// (and no block lists), byte ranges inside blocks, as pull_ranges moves
// them the other way (source: this side's blocks, checked here;
// destination: the peer's, checked by the peer). The destination
// is `dst`, or, when `dst_addrs` is not empty, one raw address per tensor
// of the layer that the peer checks against its registered memory.
struct TransferStep {
  uint32_t src_layer = 0;
  uint32_t dst_layer = 0;
  uint32_t per_layer = 2;
  uint64_t src_slot = 0;
  std::vector<uint64_t> src_blocks;
  std::vector<uint64_t> dst_blocks;
  uint64_t chunk_size = 0;
  RemoteName dst;
  std::vector<uint64_t> dst_addrs;
  std::vector<BlockRange> ranges;
  // Steps sharing a non-zero group go out in order on one connection, each
  // as one frame (refused or written whole); after a refusal the peer
  // refuses the group's later steps.
  uint64_t group = 0;
};

struct LinkTarget {
  uint64_t peer_id = 0;
  std::string remote_ip;
  uint16_t remote_port = 0;
  std::string local_ip;
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
  // Keeps the memory of an allocated cache mapped and out of the pool for as
  // long as the returned pointer lives, even past deallocate_cache() and
  // finalize(); null for an unknown or registered (caller-owned) cache.
  std::shared_ptr<const void> pin_memory(int64_t cache_id) const;
  // Tensor count of a cache of this engine, 0 if there is none with that id.
  uint32_t cache_tensors(int64_t cache_id) const;

  // Data movement. On LLM_SUCCESS `out` is a request already under way;
  // any other status means nothing was started.
  Status copy_cache(int64_t dst_id, int64_t src_id, uint64_t dst_slot, uint64_t src_slot, uint64_t offset,
                    int64_t size, std::shared_ptr<Request> &out);
  Status copy_blocks(const CacheView &dst, const CacheView &src, const BlockPairs &pairs,
                     std::shared_ptr<Request> &out);

  // Links. Statuses per target, in order; the return is LLM_SUCCESS only if
  // every one succeeded.
  uint16_t listen_port() const;
  // How operations started here toward `peer` move their bytes: "same_host"
  // or "tcp"; LLM_NOT_YET_LINK without a link.
  Status link_transport(uint64_t peer, std::string &out) const;
  // The same, and whether the link's connections are in TLS, with which
  // cipher suite, and whether the kernel carries every one's records (kTLS).
  Status link_security(uint64_t peer, std::string &transport, bool &encrypted, std::string &cipher,
                       bool &ktls) const;
  // Whether a link to `peer` is up now.
  bool has_link(uint64_t peer) const;
  // Diagnostics, by name: the listener's counters (empty when it does not
  // listen), and a link's connections, refused ordered transfers and the
  // counters of its paths (Link::path_counters(); empty without a link).
  std::map<std::string, uint64_t> listener_stats() const;
  std::map<std::string, uint64_t> link_stats(uint64_t peer) const;
  // Answers to this end's operations read from same-host links' answer
  // sockets, by who read them (see AnswerHub::answer_counts).
  std::map<std::string, uint64_t> answer_counts() const;
  Status link_clusters(const std::vector<LinkTarget> &targets, int timeout_ms, std::vector<Status> &rets);
  Status unlink_clusters(const std::vector<uint64_t> &peers, bool force, int timeout_ms, std::vector<Status> &rets);
  // New role and listening state: listens on `listen_ip:listen_port` when
  // given (port 0 picks one), else stops listening. LLM_EXIST_LINK while
  // any link exists.
  Status switch_role(const std::string &role, const std::optional<std::string> &listen_ip, uint16_t listen_port);

  // Two-sided links over a rank table (see comm_links.h). The comm's time
  // and attempts come from llm.LinkTotalTime / llm.LinkRetryCount.
  Status link_comm(const std::string &name, const std::vector<CommMember> &members, uint64_t &comm_id);
  Status unlink_comm(uint64_t comm_id);
  Status comm_state(uint64_t comm_id, CommState &out) const;

  // Transfers with a peer. `span.local_first` counts layers of the local
  // cache (the source of a push, the destination of a pull).
  Status push_cache(int64_t src_id, uint64_t src_slot, uint64_t peer, int64_t dst_cache_id, uint64_t dst_slot,
                    const LayerSpan &span, std::shared_ptr<Request> &out);
  Status push_blocks(int64_t src_id, uint64_t peer, const RemoteName &dst, const std::vector<uint64_t> &src_blocks,
                     const std::vector<uint64_t> &dst_blocks, const LayerSpan &span, std::shared_ptr<Request> &out);
  Status pull_cache(int64_t dst_id, uint64_t dst_slot, uint64_t peer, const RemoteName &src, int64_t size,
                    const LayerSpan &span, std::shared_ptr<Request> &out);
  Status pull_blocks(int64_t dst_id, uint64_t peer, const RemoteName &src, const std::vector<uint64_t> &src_blocks,
                     const std::vector<uint64_t> &dst_blocks, const LayerSpan &span, std::shared_ptr<Request> &out);
  // Byte ranges inside blocks: for every tensor of `span`, bytes
  // [src_offset, + length) of the peer's block src_block land at
  // [dst_offset, + length) of local block dst_block. Each range stays inside
  // one block on both sides (the peer checks its own); destination ranges
  // may not overlap. The peer's block size may differ from this cache's.
  Status pull_ranges(int64_t dst_id, uint64_t peer, const RemoteName &src, const std::vector<BlockRange> &ranges,
                     const LayerSpan &span, std::shared_ptr<Request> &out);

  // A request for work its creator adds step by step (one hold, owned by the
  // creator, released when it has added everything).
  std::shared_ptr<Request> create_request(size_t num_results);
  // Starts one layer-wise step; its frames settle `result_index` of `into`.
  // Any status but LLM_SUCCESS means nothing was started.
  Status transfer_step(const std::shared_ptr<Request> &into, size_t result_index, int64_t src_id, uint64_t peer,
                       const TransferStep &step);

  // CUDA events. watch_event: `out` (one result) completes with
  // LLM_SUCCESS once the work `event` (a CUevent of the engine's device,
  // llm.DeviceId) last recorded before the call has completed, through the
  // completion queue like any request, with no thread of the engine's
  // waiting meanwhile (cuda::Device::after_event). LLM_FEATURE_NOT_ENABLED
  // without a driver or device; LLM_PARAM_INVALID, with the driver's words,
  // when the driver refuses the event. unwatch_event settles a watch not yet
  // completed as cancelled (false if there is none); finalize does so for
  // every one.
  Status watch_event(uint64_t event, std::shared_ptr<Request> &out);
  bool unwatch_event(uint64_t request_id);

 private:
  enum class State { kCreated, kReady, kFinalized };

  Status resolve(const CacheView &view, std::shared_ptr<CacheEntry> &out) const;
  // The CUDA device of this engine (llm.DeviceId) for a spec of Placement
  // DEVICE, opened on first use; null for HOST.
  Status open_device(const CacheSpec &spec, std::shared_ptr<cuda::Device> &out) const;
  Status start_copy(std::vector<CopySegment> segments, std::vector<std::shared_ptr<CacheEntry>> pins,
                    std::shared_ptr<Request> &out);
  // Checks shared by every transfer with a peer.
  Status prepare_remote(int64_t local_id, uint64_t peer, const LayerSpan &span,
                        std::shared_ptr<CacheEntry> &entry, std::shared_ptr<Link> &link) const;
  // Submits the planned frames into `into` (result `result_index`) or, when
  // `into` is null, into a new request returned in `out`.
  Status start_remote(const std::shared_ptr<Link> &link, bool write, FramePlanner &planner,
                      std::shared_ptr<CacheEntry> pin, std::shared_ptr<Request> &out,
                      const std::shared_ptr<Request> &into = nullptr, size_t result_index = 0);

  const uint64_t cluster_id_;
  std::shared_ptr<CompletionQueue> completions_;
  std::shared_ptr<RequestTracker> tracker_;
  Registry registry_;
  EngineOptions options_;
  std::shared_ptr<HostPool> host_pool_;
  std::unique_ptr<WorkerPool> workers_;
  std::unique_ptr<LinkManager> transport_;
  std::unique_ptr<CommLinks> comms_;

  mutable std::shared_mutex state_mu_;  // shared by calls, exclusive for init/finalize
  mutable std::mutex device_mu_;
  mutable std::shared_ptr<cuda::Device> device_;  // opened by the first DEVICE cache
  State state_ = State::kCreated;

  // A request of watch_event; settled once, by the event's host function
  // or by unwatch_event / finalize, whichever comes first.
  struct EventWatch {
    std::shared_ptr<Request> request;
    std::atomic<bool> settled{false};
    void settle(Status status, bool skipped);
  };
  std::mutex watches_mu_;
  std::unordered_map<uint64_t, std::shared_ptr<EventWatch>> watches_;  // by request id; settled ones swept
};

}  // namespace datadist

#endif  // DATADIST_ENGINE_H_
