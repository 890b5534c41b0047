#include "engine.h"

#include <mutex>
#include <system_error>

namespace datadist {

using llm_datadist::LLM_ENGINE_FINALIZED;
using llm_datadist::LLM_FAILED;
using llm_datadist::LLM_FEATURE_NOT_ENABLED;
using llm_datadist::LLM_KV_CACHE_NOT_EXIST;
using llm_datadist::LLM_OUT_OF_MEMORY;
using llm_datadist::LLM_PARAM_INVALID;
using llm_datadist::LLM_SUCCESS;

namespace {
constexpr uint64_t kTensorAlign = 64;
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
  options_ = parsed;
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

}  // namespace datadist
