// llm_datadist::LlmDataDist: the C++ API as a thin layer over the engine.
// Every call checks the upstream argument rules, hands the work to the
// engine and, for transfers, waits for the engine's request.
#include "llm_datadist/llm_datadist.h"

#include <arpa/inet.h>

#include <optional>

#include "engine.h"
#include "error_detail.h"

namespace llm_datadist {

namespace {

using datadist::Engine;
using datadist::LayerSpan;
using datadist::RemoteName;
using datadist::refuse;
using datadist::words;

Status not_initialized() { return refuse(LLM_FAILED, "Initialize has not succeeded (or Finalize was called)"); }

const char *role_name(LlmRole role) {
  switch (role) {
    case LlmRole::kPrompt:
      return "Prompt";
    case LlmRole::kDecoder:
      return "Decoder";
    case LlmRole::kMix:
      return "Mix";
    default:
      return nullptr;
  }
}

bool is_ipv4(const std::string &ip) {
  in_addr addr;
  return !ip.empty() && ::inet_pton(AF_INET, ip.c_str(), &addr) == 1;
}

// "ip:port" (IPv4; the bracketed IPv6 form is refused: no IPv6 transport).
Status parse_listen(const std::string &text, std::string &ip, uint16_t &port) {
  const size_t colon = text.rfind(':');
  const Status bad = refuse(LLM_PARAM_INVALID, "listen address '" + text + "' must be 'IPv4:port'");
  if (colon == std::string::npos || colon + 1 == text.size() || text.size() - colon > 6) return bad;
  ip = text.substr(0, colon);
  uint32_t value = 0;
  for (char c : text.substr(colon + 1)) {
    if (c < '0' || c > '9') return bad;
    value = value * 10 + static_cast<uint32_t>(c - '0');
  }
  if (value > UINT16_MAX || !is_ipv4(ip)) return bad;
  datadist::clear_error_detail();
  port = static_cast<uint16_t>(value);
  return LLM_SUCCESS;
}

const std::string *find(const std::map<AscendString, AscendString> &options, const char *key) {
  auto it = options.find(AscendString(key));
  return it == options.end() ? nullptr : &it->second.str();
}

// Waits for the request; its first failure, with the reason given for it.
Status wait(const std::shared_ptr<datadist::Request> &request) {
  request->wait(-1);
  const std::vector<Status> results = request->results();
  const std::vector<std::string> messages = request->messages();
  for (size_t i = 0; i < results.size(); ++i) {
    if (results[i] != LLM_SUCCESS) {
      return refuse(results[i], messages[i].empty() ? "the transfer failed with " + datadist::status_name(results[i])
                                                     : messages[i]);
    }
  }
  return LLM_SUCCESS;
}

bool range_ok(const std::pair<int32_t, int32_t> &r) {
  if (r.first == -1 || r.second == -1) return r.first == -1 && r.second == -1;
  return r.first >= 0 && r.first <= r.second;
}

// The layers a transfer moves, from closed ranges where (-1, -1) means every
// layer of the local cache; a range given on one side only serves both.
Status layer_span(const KvCacheExtParam &ext, uint32_t local_tensors, bool local_is_src, LayerSpan &out) {
  if (ext.tensor_num_per_layer == 0) return refuse(LLM_PARAM_INVALID, "tensor_num_per_layer is 0");
  if (!range_ok(ext.src_layer_range) || !range_ok(ext.dst_layer_range)) {
    const auto &r = range_ok(ext.src_layer_range) ? ext.dst_layer_range : ext.src_layer_range;
    return refuse(LLM_PARAM_INVALID, words(range_ok(ext.src_layer_range) ? "dst" : "src", "_layer_range (",
                                           r.first, ", ", r.second,
                                           ") must be (-1, -1) or closed with 0 <= first <= second"));
  }
  const uint32_t per_layer = ext.tensor_num_per_layer;
  if (local_tensors == 0) return refuse(LLM_KV_CACHE_NOT_EXIST, "the local cache is not registered here");
  if (local_tensors % per_layer != 0) {
    return refuse(LLM_PARAM_INVALID, words("the local cache's ", local_tensors,
                                           " tensors do not split into layers of ", per_layer));
  }
  auto local = local_is_src ? ext.src_layer_range : ext.dst_layer_range;
  auto remote = local_is_src ? ext.dst_layer_range : ext.src_layer_range;
  if (local.first < 0 && remote.first < 0) {
    local = remote = {0, static_cast<int32_t>(local_tensors / per_layer) - 1};
  } else if (remote.first < 0) {
    remote = local;
  } else if (local.first < 0) {
    local = remote;
  }
  if (local.second - local.first != remote.second - remote.first || local.second < local.first) {
    return refuse(LLM_PARAM_INVALID, words("src and dst layer ranges differ in length: ",
                                           ext.src_layer_range.second - ext.src_layer_range.first + 1, " != ",
                                           ext.dst_layer_range.second - ext.dst_layer_range.first + 1));
  }
  out.local_first = static_cast<uint32_t>(local.first);
  out.remote_first = static_cast<uint32_t>(remote.first);
  out.count = static_cast<uint32_t>(local.second - local.first + 1);
  out.per_layer = per_layer;
  return LLM_SUCCESS;
}

RemoteName by_id(const CacheIndex &index) {
  RemoteName name;
  name.cache_id = index.cache_id;
  name.slot = index.batch_index;
  return name;
}

datadist::CacheSpec spec_of(const CacheDesc &desc) {
  datadist::CacheSpec spec;
  spec.num_tensors = desc.num_tensors;
  spec.shape = desc.shape;
  spec.data_type = desc.data_type;
  spec.placement = desc.placement == CachePlacement::kHost ? datadist::Placement::kHost : datadist::Placement::kDevice;
  return spec;
}

}  // namespace

class LlmDataDist::Impl {
 public:
  Impl(uint64_t cluster_id, LlmRole role) : cluster_id(cluster_id), role(role) {}

  // The engine, or null before Initialize / after Finalize.
  Engine *ready() const { return engine && engine->initialized() ? engine.get() : nullptr; }

  const uint64_t cluster_id;
  LlmRole role;
  std::unique_ptr<Engine> engine;
};

LlmDataDist::LlmDataDist(uint64_t cluster_id, LlmRole role) : impl_(std::make_unique<Impl>(cluster_id, role)) {}

LlmDataDist::~LlmDataDist() { Finalize(); }

Status LlmDataDist::Initialize(const std::map<AscendString, AscendString> &options) {
  if (impl_->ready() != nullptr) return LLM_SUCCESS;
  datadist::clear_error_detail();
  const char *role = role_name(impl_->role);
  if (role == nullptr) return refuse(LLM_PARAM_INVALID, "unknown role");
  datadist::OptionMap engine_options;
  for (const auto &[key, value] : options) engine_options[key.str()] = value.str();
  engine_options[datadist::kOptRole] = role;
  engine_options[datadist::kOptRemoteCacheAccessible] = "1";
  if (const std::string *listen = find(options, OPTION_LISTEN_IP_INFO)) {
    std::string ip;
    uint16_t port = 0;
    if (parse_listen(*listen, ip, port) != LLM_SUCCESS) return LLM_PARAM_INVALID;
    engine_options[datadist::kOptListenIp] = ip;
    engine_options[datadist::kOptListenPort] = std::to_string(port);
  }
  auto engine = std::make_unique<Engine>(impl_->cluster_id);
  const Status st = engine->initialize(engine_options);
  if (st != LLM_SUCCESS) return st;
  impl_->engine = std::move(engine);
  return LLM_SUCCESS;
}

void LlmDataDist::Finalize() {
  if (impl_->engine) impl_->engine->finalize();
  impl_->engine.reset();
}

Status LlmDataDist::SetRole(LlmRole role, const std::map<AscendString, AscendString> &options) {
  datadist::clear_error_detail();
  Engine *engine = impl_->ready();
  if (engine == nullptr) return not_initialized();
  const char *name = role_name(role);
  if (name == nullptr) return refuse(LLM_PARAM_INVALID, "unknown role");
  std::optional<std::string> ip;
  uint16_t port = 0;
  if (const std::string *listen = find(options, OPTION_LISTEN_IP_INFO)) {
    std::string parsed;
    if (parse_listen(*listen, parsed, port) != LLM_SUCCESS) return LLM_PARAM_INVALID;
    ip = parsed;
  }
  const Status st = engine->switch_role(name, ip, port);
  if (st == LLM_SUCCESS) impl_->role = role;
  return st;
}

Status LlmDataDist::LinkLlmClusters(const std::vector<ClusterInfo> &clusters, std::vector<Status> &rets,
                                    int32_t timeout_in_millis) {
  datadist::clear_error_detail();
  Engine *engine = impl_->ready();
  if (engine == nullptr) return not_initialized();
  if (clusters.empty()) return refuse(LLM_PARAM_INVALID, "clusters is empty");
  if (timeout_in_millis <= 0) {
    return refuse(LLM_PARAM_INVALID, words("timeout_in_millis ", timeout_in_millis, " must be > 0"));
  }
  rets.assign(clusters.size(), LLM_PARAM_INVALID);
  std::string refused;
  std::vector<datadist::LinkTarget> targets;
  std::vector<size_t> where;
  for (size_t i = 0; i < clusters.size(); ++i) {
    const ClusterInfo &c = clusters[i];
    if (c.remote_ip_infos.size() != 1 || c.local_ip_infos.size() != 1) {
      if (refused.empty()) refused = words("clusters[", i, "] needs exactly one local and one remote IpInfo");
      continue;
    }
    const std::string &remote = c.remote_ip_infos[0].ip.str();
    const std::string &local = c.local_ip_infos[0].ip.str();
    if (!is_ipv4(remote) || !is_ipv4(local)) {
      if (refused.empty()) refused = words("clusters[", i, "]: '", remote, "' or '", local, "' is not IPv4");
      continue;
    }
    targets.push_back({c.remote_cluster_id, remote, c.remote_ip_infos[0].port, local});
    where.push_back(i);
  }
  if (!targets.empty()) {
    std::vector<Status> linked;
    engine->link_clusters(targets, timeout_in_millis, linked);
    for (size_t k = 0; k < where.size(); ++k) rets[where[k]] = linked[k];
  }
  if (!refused.empty() && datadist::error_detail().empty()) datadist::set_error_detail(refused);
  for (Status st : rets) {
    if (st != LLM_SUCCESS) return st;
  }
  return LLM_SUCCESS;
}

Status LlmDataDist::GetLinkTransport(uint64_t remote_cluster_id, std::string &transport) const {
  Engine *engine = impl_->ready();
  if (engine == nullptr) return LLM_FAILED;
  return engine->link_transport(remote_cluster_id, transport);
}

Status LlmDataDist::GetLinkTransport(uint64_t remote_cluster_id, LinkTransportInfo &info) const {
  Engine *engine = impl_->ready();
  if (engine == nullptr) return LLM_FAILED;
  return engine->link_security(remote_cluster_id, info.transport, info.encrypted, info.cipher, info.kernel_tls);
}

Status LlmDataDist::UnlinkLlmClusters(const std::vector<ClusterInfo> &clusters, std::vector<Status> &rets,
                                      int32_t timeout_in_millis, bool force_flag) {
  datadist::clear_error_detail();
  Engine *engine = impl_->ready();
  if (engine == nullptr) return not_initialized();
  if (clusters.empty()) return refuse(LLM_PARAM_INVALID, "clusters is empty");
  if (timeout_in_millis <= 0) {
    return refuse(LLM_PARAM_INVALID, words("timeout_in_millis ", timeout_in_millis, " must be > 0"));
  }
  rets.assign(clusters.size(), LLM_PARAM_INVALID);
  for (size_t i = 0; i < clusters.size(); ++i) {
    if (!force_flag && clusters[i].remote_ip_infos.size() != 1) continue;
    std::vector<Status> one;
    engine->unlink_clusters({clusters[i].remote_cluster_id}, force_flag, timeout_in_millis, one);
    rets[i] = one.empty() ? LLM_FAILED : one[0];
  }
  for (Status st : rets) {
    if (st != LLM_SUCCESS) return st;
  }
  return LLM_SUCCESS;
}

Status LlmDataDist::RegisterKvCache(const CacheDesc &cache_desc, const std::vector<uint64_t> &addrs,
                                    const RegisterCfg &, int64_t &cache_id) {
  datadist::clear_error_detail();
  Engine *engine = impl_->ready();
  if (engine == nullptr) return not_initialized();
  if (addrs.empty() || addrs.size() != cache_desc.num_tensors) {
    return refuse(LLM_PARAM_INVALID, words(addrs.size() < cache_desc.num_tensors ? "too few" : "too many",
                                           " addresses: ", addrs.size(), " given, num_tensors is ",
                                           cache_desc.num_tensors));
  }
  if (addrs.size() > kMaxRegisterAddrs) {
    return refuse(LLM_PARAM_INVALID, words(addrs.size(), " addresses, more than the limit of ", kMaxRegisterAddrs));
  }
  std::vector<uintptr_t> raw(addrs.begin(), addrs.end());
  return engine->register_cache(spec_of(cache_desc), raw, {}, std::nullopt, true, cache_id);
}

Status LlmDataDist::UnregisterKvCache(int64_t cache_id) {
  datadist::clear_error_detail();
  Engine *engine = impl_->ready();
  if (engine == nullptr) return not_initialized();
  return engine->unregister_cache(cache_id);
}

Status LlmDataDist::AllocateCache(const CacheDesc &cache_desc, Cache &cache) {
  datadist::clear_error_detail();
  Engine *engine = impl_->ready();
  if (engine == nullptr) return not_initialized();
  int64_t cache_id = -1;
  std::vector<uintptr_t> addrs;
  const Status st = engine->allocate_cache(spec_of(cache_desc), {}, std::nullopt, cache_id, addrs);
  if (st != LLM_SUCCESS) return st;
  cache.cache_id = cache_id;
  cache.tensor_addrs = std::move(addrs);
  cache.cache_desc = cache_desc;
  return LLM_SUCCESS;
}

Status LlmDataDist::DeallocateCache(int64_t cache_id) {
  datadist::clear_error_detail();
  Engine *engine = impl_->ready();
  if (engine == nullptr) return not_initialized();
  return engine->deallocate_cache(cache_id);
}

Status LlmDataDist::PullKvCache(const CacheIndex &src_cache_index, const Cache &dst_cache, uint32_t batch_index,
                                int64_t size, const KvCacheExtParam &ext_param) {
  datadist::clear_error_detail();
  Engine *engine = impl_->ready();
  if (engine == nullptr) return not_initialized();
  if (size != -1 && size <= 0) return refuse(LLM_PARAM_INVALID, words("size ", size, " must be -1 or > 0"));
  LayerSpan span;
  Status st = layer_span(ext_param, engine->cache_tensors(dst_cache.cache_id), false, span);
  if (st != LLM_SUCCESS) return st;
  std::shared_ptr<datadist::Request> request;
  st = engine->pull_cache(dst_cache.cache_id, batch_index, src_cache_index.cluster_id, by_id(src_cache_index), size,
                          span, request);
  return st == LLM_SUCCESS ? wait(request) : st;
}

Status LlmDataDist::PullKvBlocks(const CacheIndex &src_cache_index, const Cache &dst_cache,
                                 const std::vector<uint64_t> &src_blocks, const std::vector<uint64_t> &dst_blocks,
                                 const KvCacheExtParam &ext_param) {
  datadist::clear_error_detail();
  Engine *engine = impl_->ready();
  if (engine == nullptr) return not_initialized();
  if (src_cache_index.batch_index != 0) {
    return refuse(LLM_PARAM_INVALID, words("src_cache_index.batch_index ", src_cache_index.batch_index, " must be 0"));
  }
  if (src_blocks.empty()) return refuse(LLM_PARAM_INVALID, "src_blocks is empty");
  if (src_blocks.size() != dst_blocks.size()) {
    return refuse(LLM_PARAM_INVALID, words("src_blocks and dst_blocks differ in length: ", src_blocks.size(),
                                           " != ", dst_blocks.size()));
  }
  LayerSpan span;
  Status st = layer_span(ext_param, engine->cache_tensors(dst_cache.cache_id), false, span);
  if (st != LLM_SUCCESS) return st;
  std::shared_ptr<datadist::Request> request;
  st = engine->pull_blocks(dst_cache.cache_id, src_cache_index.cluster_id, by_id(src_cache_index), src_blocks,
                           dst_blocks, span, request);
  return st == LLM_SUCCESS ? wait(request) : st;
}

Status LlmDataDist::PushKvCache(const Cache &src_cache, const CacheIndex &dst_cache_index, uint32_t src_batch_index,
                                int64_t size, const KvCacheExtParam &ext_param) {
  datadist::clear_error_detail();
  Engine *engine = impl_->ready();
  if (engine == nullptr) return not_initialized();
  if (size != -1) return refuse(LLM_PARAM_INVALID, words("size ", size, " must be -1 (whole slots)"));
  LayerSpan span;
  Status st = layer_span(ext_param, engine->cache_tensors(src_cache.cache_id), true, span);
  if (st != LLM_SUCCESS) return st;
  std::shared_ptr<datadist::Request> request;
  st = engine->push_cache(src_cache.cache_id, src_batch_index, dst_cache_index.cluster_id, dst_cache_index.cache_id,
                          dst_cache_index.batch_index, span, request);
  return st == LLM_SUCCESS ? wait(request) : st;
}

Status LlmDataDist::PushKvBlocks(const Cache &src_cache, const CacheIndex &dst_cache_index,
                                 const std::vector<uint64_t> &src_blocks, const std::vector<uint64_t> &dst_blocks,
                                 const KvCacheExtParam &ext_param) {
  datadist::clear_error_detail();
  Engine *engine = impl_->ready();
  if (engine == nullptr) return not_initialized();
  if (src_blocks.empty()) return refuse(LLM_PARAM_INVALID, "src_blocks is empty");
  if (src_blocks.size() != dst_blocks.size()) {
    return refuse(LLM_PARAM_INVALID, words("src_blocks and dst_blocks differ in length: ", src_blocks.size(),
                                           " != ", dst_blocks.size()));
  }
  if (dst_cache_index.batch_index != 0) {
    return refuse(LLM_PARAM_INVALID, words("dst_cache_index.batch_index ", dst_cache_index.batch_index, " must be 0"));
  }
  LayerSpan span;
  Status st = layer_span(ext_param, engine->cache_tensors(src_cache.cache_id), true, span);
  if (st != LLM_SUCCESS) return st;
  if (dst_cache_index.cache_id <= 0) {
    return refuse(LLM_KV_CACHE_NOT_EXIST, words("dst_cache_index.cache_id ", dst_cache_index.cache_id, " must be > 0"));
  }
  std::shared_ptr<datadist::Request> request;
  st = engine->push_blocks(src_cache.cache_id, dst_cache_index.cluster_id, by_id(dst_cache_index), src_blocks,
                           dst_blocks, span, request);
  return st == LLM_SUCCESS ? wait(request) : st;
}

Status LlmDataDist::CopyKvCache(const Cache &src_cache, const Cache &dst_cache, uint32_t src_batch_index,
                                uint32_t dst_batch_index, uint64_t offset, int64_t size) {
  datadist::clear_error_detail();
  Engine *engine = impl_->ready();
  if (engine == nullptr) return not_initialized();
  if (size != -1 && size <= 0) return refuse(LLM_PARAM_INVALID, words("size ", size, " must be -1 or > 0"));
  std::shared_ptr<datadist::Request> request;
  const Status st = engine->copy_cache(dst_cache.cache_id, src_cache.cache_id, dst_batch_index, src_batch_index,
                                       offset, size, request);
  return st == LLM_SUCCESS ? wait(request) : st;
}

Status LlmDataDist::CopyKvBlocks(const Cache &src_cache, const Cache &dst_cache,
                                 const std::vector<uint64_t> &src_blocks,
                                 const std::vector<std::vector<uint64_t>> &dst_blocks_list) {
  datadist::clear_error_detail();
  Engine *engine = impl_->ready();
  if (engine == nullptr) return not_initialized();
  if (src_blocks.empty()) return refuse(LLM_PARAM_INVALID, "src_blocks is empty");
  if (src_blocks.size() != dst_blocks_list.size()) {
    return refuse(LLM_PARAM_INVALID, words("src_blocks and dst_blocks_list differ in length: ", src_blocks.size(),
                                           " != ", dst_blocks_list.size()));
  }
  datadist::BlockPairs pairs;
  for (size_t i = 0; i < src_blocks.size(); ++i) {
    for (uint64_t dst : dst_blocks_list[i]) pairs.emplace_back(src_blocks[i], dst);
  }
  datadist::CacheView src, dst;
  src.cache_id = src_cache.cache_id;
  dst.cache_id = dst_cache.cache_id;
  if (src.cache_id < 0 || dst.cache_id < 0) {
    return refuse(LLM_KV_CACHE_NOT_EXIST, "both caches must be registered or allocated here (cache_id >= 0)");
  }
  std::shared_ptr<datadist::Request> request;
  const Status st = engine->copy_blocks(dst, src, pairs, request);
  return st == LLM_SUCCESS ? wait(request) : st;
}

std::string LlmDataDist::GetLastErrorMessage() const { return datadist::error_detail(); }

std::map<std::string, uint64_t> LlmDataDist::GetAnswerCounts() const {
  Engine *engine = impl_->ready();
  if (engine == nullptr) return {};
  return engine->answer_counts();
}

}  // namespace llm_datadist
