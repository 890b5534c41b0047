#include "engine.h"

#include <atomic>
#include <mutex>
#include <system_error>
#include <thread>
#include <unordered_set>

#include "log.h"
#include "transport/auth.h"

namespace datadist {

using llm_datadist::LLM_ENGINE_FINALIZED;
using llm_datadist::LLM_EXIST_LINK;
using llm_datadist::LLM_NOT_YET_LINK;
using llm_datadist::LLM_FAILED;
using llm_datadist::LLM_FEATURE_NOT_ENABLED;
using llm_datadist::LLM_KV_CACHE_NOT_EXIST;
using llm_datadist::LLM_OUT_OF_MEMORY;
using llm_datadist::LLM_PARAM_INVALID;
using llm_datadist::LLM_SUCCESS;

namespace {
constexpr uint64_t kTensorAlign = 64;
constexpr int kCommUnlinkTimeoutMs = 3000;
}  // namespace

Engine::Engine(uint64_t cluster_id)
    : cluster_id_(cluster_id),
      completions_(std::make_shared<CompletionQueue>()),
      tracker_(std::make_shared<RequestTracker>(completions_)) {}

Engine::~Engine() { finalize(); }

Status Engine::initialize(const OptionMap &options) {
  std::unique_lock<std::shared_mutex> lock(state_mu_);
  if (state_ == State::kReady) return LLM_SUCCESS;
  if (state_ == State::kFinalized) return LLM_FAILED;
  EngineOptions parsed;
  Status st = parse_options(options, parsed);
  if (st != LLM_SUCCESS) return st;
  try {
    if (parsed.host_pool) host_pool_ = std::make_shared<HostPool>(*parsed.host_pool);
  } catch (const std::system_error &) {
    return LLM_OUT_OF_MEMORY;
  }
  TransportOptions transport_options;
  transport_options.connections_per_peer = parsed.tcp_connections_per_peer;
  transport_options.same_host = parsed.same_host;
  transport_options.auth_key = parsed.auth_key;
  if (!parsed.auth_key.empty()) {
    const std::string why = auth::unavailable();
    if (!why.empty()) {
      log_warning("a link secret is set, but " + why + "; install OpenSSL (libssl3) to authenticate links");
      return llm_datadist::LLM_FEATURE_NOT_ENABLED;
    }
  } else {
    static std::atomic<bool> warned{false};
    if (!warned.exchange(true)) {
      log_warning("links are not authenticated: any process that reaches this engine's port may link, read and "
                  "write its remote-accessible caches; set LLMConfig.auth_key (llm.AuthKey) or " +
                  std::string(kAuthKeyEnv) + " on every peer");
    }
  }
  auto transport = std::make_unique<TcpTransport>(cluster_id_, role_code(parsed.role), registry_, transport_options);
  if (parsed.listen_ip) {
    st = transport->listen(*parsed.listen_ip, parsed.listen_port);
    if (st != LLM_SUCCESS) return st;
  }
  options_ = parsed;
  transport_ = std::move(transport);
  comms_ = std::make_unique<CommLinks>(cluster_id_, *transport_);
  workers_ = std::make_unique<WorkerPool>(options_.engine_threads);
  state_ = State::kReady;
  return LLM_SUCCESS;
}

bool Engine::initialized() const {
  std::shared_lock<std::shared_mutex> lock(state_mu_);
  return state_ == State::kReady;
}

void Engine::finalize() {
  std::unique_lock<std::shared_mutex> lock(state_mu_);
  if (state_ != State::kReady) {
    state_ = State::kFinalized;
    return;
  }
  state_ = State::kFinalized;
  tracker_->cancel_all(LLM_ENGINE_FINALIZED);
  comms_->shutdown();  // no comm links any more
  transport_->shutdown(LLM_ENGINE_FINALIZED);  // settles every operation with a peer
  workers_->shutdown();  // runs what is queued; cancelled work is skipped
  tracker_->wait_idle(-1);
  registry_.clear();
  host_pool_.reset();  // caches still pinned by a caller keep the pool alive
}

Status Engine::register_cache(const CacheSpec &spec, const std::vector<uintptr_t> &addrs,
                              const std::vector<KeySpec> &keys, std::optional<uint64_t> blocks_model_id,
                              bool remote_accessible, int64_t &cache_id) {
  std::shared_lock<std::shared_mutex> lock(state_mu_);
  if (state_ != State::kReady) return LLM_FAILED;
  if (spec.placement == Placement::kDevice) return LLM_FEATURE_NOT_ENABLED;
  auto entry = std::make_shared<CacheEntry>();
  entry->spec = spec;
  Status st = compute_geometry(spec, entry->geometry);
  if (st != LLM_SUCCESS) return st;
  if (addrs.size() != spec.num_tensors) return LLM_PARAM_INVALID;
  for (uintptr_t addr : addrs) {
    if (addr == 0) return LLM_PARAM_INVALID;
    entry->addrs.push_back(reinterpret_cast<uint8_t *>(addr));
  }
  entry->remote_accessible = remote_accessible;
  return registry_.add(std::move(entry), keys, blocks_model_id, false, cache_id);
}

Status Engine::allocate_cache(const CacheSpec &spec, const std::vector<KeySpec> &keys,
                              std::optional<uint64_t> blocks_model_id, int64_t &cache_id,
                              std::vector<uintptr_t> &addrs) {
  std::shared_lock<std::shared_mutex> lock(state_mu_);
  if (state_ != State::kReady) return LLM_FAILED;
  if (spec.placement == Placement::kDevice || !host_pool_) return LLM_FEATURE_NOT_ENABLED;
  auto entry = std::make_shared<CacheEntry>();
  entry->spec = spec;
  Status st = compute_geometry(spec, entry->geometry);
  if (st != LLM_SUCCESS) return st;
  const uint64_t step = (entry->geometry.tensor_size + kTensorAlign - 1) / kTensorAlign * kTensorAlign;
  uint64_t total;
  if (__builtin_mul_overflow(step, static_cast<uint64_t>(spec.num_tensors), &total)) return LLM_OUT_OF_MEMORY;
  uint8_t *block = host_pool_->allocate(total);
  if (block == nullptr) return LLM_OUT_OF_MEMORY;
  entry->pool = host_pool_;
  entry->pool_block = block;
  entry->remote_accessible = true;
  for (uint32_t t = 0; t < spec.num_tensors; ++t) entry->addrs.push_back(block + t * step);
  std::vector<uintptr_t> out_addrs;
  for (uint8_t *addr : entry->addrs) out_addrs.push_back(reinterpret_cast<uintptr_t>(addr));
  st = registry_.add(std::move(entry), keys, blocks_model_id, true, cache_id);
  if (st == LLM_SUCCESS) addrs = std::move(out_addrs);
  return st;  // on failure the entry's destructor returns the memory
}

std::shared_ptr<const void> Engine::pin_memory(int64_t cache_id) const {
  std::shared_lock<std::shared_mutex> lock(state_mu_);
  if (state_ != State::kReady) return nullptr;
  std::shared_ptr<CacheEntry> entry = registry_.find(cache_id);
  return entry && entry->pool ? entry : nullptr;
}

Status Engine::deallocate_cache(int64_t cache_id) {
  std::shared_lock<std::shared_mutex> lock(state_mu_);
  if (state_ != State::kReady) return LLM_FAILED;
  registry_.deallocate(cache_id);
  return LLM_SUCCESS;
}

Status Engine::unregister_cache(int64_t cache_id) {
  std::shared_lock<std::shared_mutex> lock(state_mu_);
  if (state_ != State::kReady) return LLM_FAILED;
  registry_.unregister(cache_id);
  return LLM_SUCCESS;
}

Status Engine::remove_cache_key(const KeySpec &key) {
  std::shared_lock<std::shared_mutex> lock(state_mu_);
  if (state_ != State::kReady) return LLM_FAILED;
  registry_.remove_key(key);
  return LLM_SUCCESS;
}

uint32_t Engine::cache_tensors(int64_t cache_id) const {
  auto entry = registry_.find(cache_id);
  return entry ? entry->spec.num_tensors : 0;
}

Status Engine::resolve(const CacheView &view, std::shared_ptr<CacheEntry> &out) const {
  if (view.cache_id >= 0) {
    out = registry_.find(view.cache_id);
    return out ? LLM_SUCCESS : LLM_KV_CACHE_NOT_EXIST;
  }
  if (view.spec.placement == Placement::kDevice) return LLM_FEATURE_NOT_ENABLED;
  auto entry = std::make_shared<CacheEntry>();
  entry->spec = view.spec;
  Status st = compute_geometry(view.spec, entry->geometry);
  if (st != LLM_SUCCESS) return st;
  if (view.addrs.size() != view.spec.num_tensors) return LLM_PARAM_INVALID;
  for (uintptr_t addr : view.addrs) {
    if (addr == 0) return LLM_PARAM_INVALID;
    entry->addrs.push_back(reinterpret_cast<uint8_t *>(addr));
  }
  out = std::move(entry);
  return LLM_SUCCESS;
}

Status Engine::start_copy(std::vector<CopySegment> segments, std::vector<std::shared_ptr<CacheEntry>> pins,
                          std::shared_ptr<Request> &out) {
  out = tracker_->create(1);
  run_local_copy(*workers_, out, std::move(segments), std::move(pins));
  return LLM_SUCCESS;
}

Status Engine::copy_cache(int64_t dst_id, int64_t src_id, uint64_t dst_slot, uint64_t src_slot,
                          uint64_t offset, int64_t size, std::shared_ptr<Request> &out) {
  std::shared_lock<std::shared_mutex> lock(state_mu_);
  if (state_ != State::kReady) return LLM_FAILED;
  auto dst = registry_.find(dst_id);
  auto src = registry_.find(src_id);
  if (!dst || !src) return LLM_KV_CACHE_NOT_EXIST;
  std::vector<CopySegment> segments;
  Status st = plan_copy_cache(*dst, *src, dst_slot, src_slot, offset, size, segments);
  if (st != LLM_SUCCESS) return st;
  return start_copy(std::move(segments), {dst, src}, out);
}

Status Engine::copy_blocks(const CacheView &dst_view, const CacheView &src_view, const BlockPairs &pairs,
                           std::shared_ptr<Request> &out) {
  std::shared_lock<std::shared_mutex> lock(state_mu_);
  if (state_ != State::kReady) return LLM_FAILED;
  std::shared_ptr<CacheEntry> dst, src;
  Status st = resolve(dst_view, dst);
  if (st == LLM_SUCCESS) st = resolve(src_view, src);
  if (st != LLM_SUCCESS) return st;
  if (dst_view.cache_id >= 0 && dst_view.cache_id == src_view.cache_id) src = dst;
  std::vector<CopySegment> segments;
  st = plan_copy_blocks(*dst, *src, pairs, segments);
  if (st != LLM_SUCCESS) return st;
  return start_copy(std::move(segments), {dst, src}, out);
}

uint16_t Engine::listen_port() const {
  std::shared_lock<std::shared_mutex> lock(state_mu_);
  return state_ == State::kReady ? transport_->listen_port() : 0;
}

Status Engine::link_transport(uint64_t peer, std::string &out) const {
  std::shared_lock<std::shared_mutex> lock(state_mu_);
  if (state_ != State::kReady) return LLM_FAILED;
  const char *name = transport_->link_transport(peer);
  if (name == nullptr) return llm_datadist::LLM_NOT_YET_LINK;
  out = name;
  return LLM_SUCCESS;
}

Status Engine::link_clusters(const std::vector<LinkTarget> &targets, int timeout_ms, std::vector<Status> &rets) {
  std::shared_lock<std::shared_mutex> lock(state_mu_);
  if (state_ != State::kReady) return LLM_FAILED;
  if (targets.empty() || timeout_ms <= 0) return LLM_PARAM_INVALID;
  constexpr size_t kParallel = 16;
  rets.assign(targets.size(), LLM_SUCCESS);
  for (size_t first = 0; first < targets.size(); first += kParallel) {
    std::vector<std::thread> threads;
    for (size_t i = first; i < std::min(targets.size(), first + kParallel); ++i) {
      threads.emplace_back([this, &targets, &rets, timeout_ms, i] {
        const LinkTarget &t = targets[i];
        rets[i] = t.peer_id == cluster_id_
                      ? LLM_PARAM_INVALID
                      : transport_->link(t.peer_id, t.remote_ip, t.remote_port, t.local_ip, timeout_ms);
      });
    }
    for (auto &thread : threads) thread.join();
  }
  for (Status st : rets) {
    if (st != LLM_SUCCESS) return st;
  }
  return LLM_SUCCESS;
}

Status Engine::unlink_clusters(const std::vector<uint64_t> &peers, bool force, int timeout_ms,
                               std::vector<Status> &rets) {
  std::shared_lock<std::shared_mutex> lock(state_mu_);
  if (state_ != State::kReady) return LLM_FAILED;
  if (peers.empty()) return LLM_PARAM_INVALID;
  rets.clear();
  Status first = LLM_SUCCESS;
  for (uint64_t peer : peers) {
    rets.push_back(transport_->unlink(peer, force, timeout_ms));
    if (first == LLM_SUCCESS) first = rets.back();
  }
  return first;
}

Status Engine::switch_role(const std::string &role, const std::optional<std::string> &listen_ip,
                           uint16_t listen_port) {
  std::shared_lock<std::shared_mutex> lock(state_mu_);
  if (state_ != State::kReady) return LLM_FAILED;
  const uint32_t code = role_code(role);
  if (code == 0) return LLM_PARAM_INVALID;
  if (transport_->link_count() != 0) return LLM_EXIST_LINK;
  const bool same = listen_ip && transport_->listen_port() != 0 && *listen_ip == transport_->listen_ip() &&
                    (listen_port == 0 || listen_port == transport_->listen_port());
  if (!same) {
    transport_->stop_listening();
    if (listen_ip) {
      Status st = transport_->listen(*listen_ip, listen_port);
      if (st != LLM_SUCCESS) return st;
    }
  }
  transport_->set_role(code);
  options_.role = role;
  return LLM_SUCCESS;
}

Status Engine::link_comm(const std::string &name, const std::vector<CommMember> &members, uint64_t &comm_id) {
  std::shared_lock<std::shared_mutex> lock(state_mu_);
  if (state_ != State::kReady) return LLM_FAILED;
  CommSpec spec;
  spec.name = name;
  spec.members = members;
  spec.total_time_ms = static_cast<uint32_t>(
      std::min<uint64_t>(uint64_t{options_.link_total_time_s} * 1000, UINT32_MAX));
  spec.retry_count = options_.link_retry_count;
  return comms_->link(spec, comm_id);
}

Status Engine::unlink_comm(uint64_t comm_id) {
  std::shared_lock<std::shared_mutex> lock(state_mu_);
  if (state_ != State::kReady) return LLM_FAILED;
  return comms_->unlink(comm_id, kCommUnlinkTimeoutMs);
}

Status Engine::comm_state(uint64_t comm_id, CommState &out) const {
  std::shared_lock<std::shared_mutex> lock(state_mu_);
  if (state_ != State::kReady) return LLM_FAILED;
  return comms_->state(comm_id, out);
}

namespace {

wire::Target name_target(const RemoteName &name) {
  wire::Target t{};
  t.kind = name.kind;
  t.cache_id = name.cache_id;
  t.req_id = name.key.req_id;
  t.model_id = name.kind == wire::kBlocksOfModel ? name.model_id : name.key.model_id;
  t.prefix_id = name.key.prefix_id;
  return t;
}

// Every (local tensor, remote tensor) pair of a layer span, layer-major.
template <typename Fn>
void for_each_tensor(const LayerSpan &span, Fn &&fn) {
  for (uint32_t l = 0; l < span.count; ++l) {
    for (uint32_t i = 0; i < span.per_layer; ++i) {
      fn((span.local_first + l) * span.per_layer + i, (span.remote_first + l) * span.per_layer + i);
    }
  }
}

bool all_below(const std::vector<uint64_t> &blocks, uint64_t limit) {
  for (uint64_t b : blocks) {
    if (b >= limit) return false;
  }
  return true;
}

bool all_distinct(const std::vector<uint64_t> &blocks) {
  return std::unordered_set<uint64_t>(blocks.begin(), blocks.end()).size() == blocks.size();
}

// Pairs first[k] with second[k]; LLM_PARAM_INVALID unless both lists have
// the same length, the local list stays below `local_blocks` and no
// destination (second) is named twice.
Status pair_blocks(const std::vector<uint64_t> &first, const std::vector<uint64_t> &second, bool local_is_first,
                   uint64_t local_blocks, BlockPairs &pairs) {
  if (first.size() != second.size() || !all_below(local_is_first ? first : second, local_blocks) ||
      !all_distinct(second)) {
    return LLM_PARAM_INVALID;
  }
  pairs.clear();
  pairs.reserve(first.size());
  for (size_t k = 0; k < first.size(); ++k) pairs.emplace_back(first[k], second[k]);
  return LLM_SUCCESS;
}

// Adds every run of (first, second) block pairs for every tensor of `span`:
// a pair's first block is the local one for a push, the remote one for a pull.
void add_block_runs(FramePlanner &planner, const CacheEntry &local, const LayerSpan &span, const BlockPairs &pairs,
                    bool local_is_first) {
  const uint64_t block = local.geometry.slot_size;
  const std::vector<BlockRun> runs = merge_block_runs(pairs);
  for_each_tensor(span, [&](uint32_t local_tensor, uint32_t remote_tensor) {
    for (const BlockRun &run : runs) {
      const uint64_t local_block = local_is_first ? run.src : run.dst;
      const uint64_t remote_block = local_is_first ? run.dst : run.src;
      planner.add(local.addrs[local_tensor] + local_block * block, remote_tensor, remote_block, 0, run.count * block);
    }
  });
}

// A pull through a key releases it on the owner once every tensor was read.
uint8_t release_flag(const RemoteName &src) { return src.kind == wire::kByKey ? wire::kReleaseKey : 0; }

}  // namespace

Status Engine::prepare_remote(int64_t local_id, uint64_t peer, const LayerSpan &span,
                              std::shared_ptr<CacheEntry> &entry, std::shared_ptr<Link> &link) const {
  if (state_ != State::kReady) return LLM_FAILED;
  entry = registry_.find(local_id);
  if (!entry) return LLM_KV_CACHE_NOT_EXIST;
  if (peer == cluster_id_) return LLM_PARAM_INVALID;
  link = transport_->find(peer);
  if (!link) return LLM_NOT_YET_LINK;
  if (options_.remote_cache_accessible && !entry->remote_accessible) return LLM_PARAM_INVALID;
  const uint32_t tensors = entry->spec.num_tensors;
  if (span.per_layer == 0 || tensors % span.per_layer != 0) return LLM_PARAM_INVALID;
  if (uint64_t{span.local_first} + span.count > tensors / span.per_layer) return LLM_PARAM_INVALID;
  if ((uint64_t{span.remote_first} + span.count) * span.per_layer > UINT32_MAX) return LLM_PARAM_INVALID;
  return LLM_SUCCESS;
}

Status Engine::start_remote(const std::shared_ptr<Link> &link, bool write, FramePlanner &planner,
                            std::shared_ptr<CacheEntry> pin, std::shared_ptr<Request> &out,
                            const std::shared_ptr<Request> &into, size_t result_index) {
  out = into ? into : tracker_->create(1);
  auto frames = planner.take();
  if (!frames.empty()) {
    const Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(options_.sync_kv_timeout_ms);
    link->submit(write, std::move(frames), out, result_index, deadline, std::move(pin));
    transport_->operations_started();
  }
  if (!into) out->release(0, LLM_SUCCESS);
  return LLM_SUCCESS;
}

Status Engine::push_cache(int64_t src_id, uint64_t src_slot, uint64_t peer, int64_t dst_cache_id, uint64_t dst_slot,
                          const LayerSpan &span, std::shared_ptr<Request> &out) {
  std::shared_lock<std::shared_mutex> lock(state_mu_);
  std::shared_ptr<CacheEntry> src;
  std::shared_ptr<Link> link;
  Status st = prepare_remote(src_id, peer, span, src, link);
  if (st != LLM_SUCCESS) return st;
  const uint64_t slot = src->geometry.slot_size;
  if (src_slot >= src->geometry.num_slots) return LLM_PARAM_INVALID;
  if (dst_cache_id <= 0) return LLM_KV_CACHE_NOT_EXIST;
  RemoteName name;
  name.cache_id = dst_cache_id;
  wire::Target target = name_target(name);
  target.flags = wire::kWithinSlot;
  target.expected_slot_size = slot;
  FramePlanner planner(target);
  for_each_tensor(span, [&](uint32_t local, uint32_t remote) {
    planner.add(src->addrs[local] + src_slot * slot, remote, dst_slot, 0, slot);
  });
  return start_remote(link, true, planner, src, out);
}

Status Engine::push_blocks(int64_t src_id, uint64_t peer, const RemoteName &dst,
                           const std::vector<uint64_t> &src_blocks, const std::vector<uint64_t> &dst_blocks,
                           const LayerSpan &span, std::shared_ptr<Request> &out) {
  std::shared_lock<std::shared_mutex> lock(state_mu_);
  std::shared_ptr<CacheEntry> src;
  std::shared_ptr<Link> link;
  Status st = prepare_remote(src_id, peer, span, src, link);
  if (st != LLM_SUCCESS) return st;
  if (src_blocks.empty()) return LLM_PARAM_INVALID;
  BlockPairs pairs;
  st = pair_blocks(src_blocks, dst_blocks, true, src->geometry.num_slots, pairs);
  if (st != LLM_SUCCESS) return st;
  wire::Target target = name_target(dst);
  target.expected_slot_size = src->geometry.slot_size;
  FramePlanner planner(target);
  add_block_runs(planner, *src, span, pairs, true);
  return start_remote(link, true, planner, src, out);
}

Status Engine::pull_cache(int64_t dst_id, uint64_t dst_slot, uint64_t peer, const RemoteName &src_name,
                          int64_t size, const LayerSpan &span, std::shared_ptr<Request> &out) {
  std::shared_lock<std::shared_mutex> lock(state_mu_);
  std::shared_ptr<CacheEntry> dst;
  std::shared_ptr<Link> link;
  Status st = prepare_remote(dst_id, peer, span, dst, link);
  if (st != LLM_SUCCESS) return st;
  const uint64_t slot = dst->geometry.slot_size;
  if (dst_slot >= dst->geometry.num_slots) return LLM_PARAM_INVALID;
  if (size == 0 || size < -1 || (size > 0 && static_cast<uint64_t>(size) > slot)) return LLM_PARAM_INVALID;
  const uint64_t length = size < 0 ? slot : static_cast<uint64_t>(size);
  wire::Target target = name_target(src_name);
  target.flags = wire::kWithinSlot | release_flag(src_name);
  target.expected_slot_size = size < 0 ? slot : 0;
  FramePlanner planner(target);
  for_each_tensor(span, [&](uint32_t local, uint32_t remote) {
    planner.add(dst->addrs[local] + dst_slot * slot, remote, src_name.slot, 0, length);
  });
  return start_remote(link, false, planner, dst, out);
}

Status Engine::pull_blocks(int64_t dst_id, uint64_t peer, const RemoteName &src_name,
                           const std::vector<uint64_t> &src_blocks, const std::vector<uint64_t> &dst_blocks,
                           const LayerSpan &span, std::shared_ptr<Request> &out) {
  std::shared_lock<std::shared_mutex> lock(state_mu_);
  std::shared_ptr<CacheEntry> dst;
  std::shared_ptr<Link> link;
  Status st = prepare_remote(dst_id, peer, span, dst, link);
  if (st != LLM_SUCCESS) return st;
  if (dst_blocks.empty() || !all_below(dst_blocks, dst->geometry.num_slots)) return LLM_PARAM_INVALID;
  const uint64_t block = dst->geometry.slot_size;
  wire::Target target = name_target(src_name);
  if (!src_blocks.empty()) {
    BlockPairs pairs;
    st = pair_blocks(src_blocks, dst_blocks, false, dst->geometry.num_slots, pairs);
    if (st != LLM_SUCCESS) return st;
    target.expected_slot_size = block;
    FramePlanner planner(target);
    add_block_runs(planner, *dst, span, pairs, false);
    return start_remote(link, false, planner, dst, out);
  }
  // A contiguous slot of the peer, cut into this cache's blocks.
  if (!all_distinct(dst_blocks)) return LLM_PARAM_INVALID;
  wire::LookupReply remote;
  st = link->lookup(target, remote, static_cast<int>(options_.sync_kv_timeout_ms));
  if (st != LLM_SUCCESS) return st;
  const uint64_t chunks = (remote.slot_size + block - 1) / block;
  if (dst_blocks.size() > chunks) return LLM_PARAM_INVALID;
  target.flags = wire::kWithinSlot | release_flag(src_name);
  FramePlanner planner(target);
  for_each_tensor(span, [&](uint32_t local, uint32_t remote_tensor) {
    for (size_t j = 0; j < dst_blocks.size(); ++j) {
      const uint64_t offset = j * block;
      planner.add(dst->addrs[local] + dst_blocks[j] * block, remote_tensor, src_name.slot, offset,
                  std::min(block, remote.slot_size - offset));
    }
  });
  return start_remote(link, false, planner, dst, out);
}

std::shared_ptr<Request> Engine::create_request(size_t num_results) { return tracker_->create(num_results); }

Status Engine::transfer_step(const std::shared_ptr<Request> &into, size_t result_index, int64_t src_id,
                             uint64_t peer, const TransferStep &step) {
  std::shared_lock<std::shared_mutex> lock(state_mu_);
  std::shared_ptr<CacheEntry> src;
  std::shared_ptr<Link> link;
  const LayerSpan span{step.src_layer, step.dst_layer, 1, step.per_layer};
  Status st = prepare_remote(src_id, peer, span, src, link);
  if (st != LLM_SUCCESS) return st;
  const uint64_t slot = src->geometry.slot_size;
  const bool raw = !step.dst_addrs.empty();
  const bool blocks_to_blocks = !step.src_blocks.empty();
  const bool slot_to_blocks = !blocks_to_blocks && !step.dst_blocks.empty();
  if (raw && step.dst_addrs.size() != step.per_layer) return LLM_PARAM_INVALID;
  uint64_t chunk = slot;
  std::vector<BlockRun> runs;
  if (blocks_to_blocks) {
    if (step.chunk_size != 0 && step.chunk_size != slot) return LLM_PARAM_INVALID;
    BlockPairs pairs;
    st = pair_blocks(step.src_blocks, step.dst_blocks, true, src->geometry.num_slots, pairs);
    if (st != LLM_SUCCESS) return st;
    runs = merge_block_runs(pairs);
  } else {
    if (step.src_slot >= src->geometry.num_slots) return LLM_PARAM_INVALID;
    if (slot_to_blocks) {
      chunk = step.chunk_size;
      if (chunk == 0 || chunk > slot || (slot + chunk - 1) / chunk < step.dst_blocks.size()) return LLM_PARAM_INVALID;
      if (!all_distinct(step.dst_blocks)) return LLM_PARAM_INVALID;
    }
  }
  wire::Target target{};
  if (raw) {
    target.kind = wire::kRawAddress;
  } else {
    target = name_target(step.dst);
    target.expected_slot_size = chunk;
    if (!blocks_to_blocks && !slot_to_blocks) target.flags = wire::kWithinSlot;
  }
  target.group = step.group;
  FramePlanner planner = step.group != 0 ? FramePlanner(target, wire::kMaxFrameData, wire::kMaxRanges)
                                         : FramePlanner(target);
  // Where `length` bytes for remote tensor `remote` (index `i` in the layer)
  // land: a slot of the named cache, or an address of the peer's.
  auto add = [&](uint8_t *local, uint32_t i, uint32_t remote, uint64_t slot_index, uint64_t length) {
    if (raw) {
      planner.add(local, 0, 0, step.dst_addrs[i] + slot_index * chunk, length);
    } else {
      planner.add(local, remote, slot_index, 0, length);
    }
  };
  for (uint32_t i = 0; i < step.per_layer; ++i) {
    uint8_t *base = src->addrs[step.src_layer * step.per_layer + i];
    const uint32_t remote = step.dst_layer * step.per_layer + i;
    if (blocks_to_blocks) {
      for (const BlockRun &run : runs) add(base + run.src * slot, i, remote, run.dst, run.count * slot);
    } else if (slot_to_blocks) {
      for (size_t j = 0; j < step.dst_blocks.size(); ++j) {
        add(base + step.src_slot * slot + j * chunk, i, remote, step.dst_blocks[j], std::min(chunk, slot - j * chunk));
      }
    } else {
      add(base + step.src_slot * slot, i, remote, raw ? 0 : step.dst.slot, slot);
    }
  }
  std::shared_ptr<Request> out;
  return start_remote(link, true, planner, src, out, into, result_index);
}

}  // namespace datadist
