#include "engine.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstdint>
#include <mutex>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "device/cuda_driver.h"
#include "log.h"
#include "transport/auth.h"
#include "transport/tls.h"
#include "error_detail.h"

namespace datadist {

using llm_datadist::LLM_ENGINE_FINALIZED;
using llm_datadist::LLM_EXIST_LINK;
using llm_datadist::LLM_NOT_YET_LINK;
using llm_datadist::LLM_PROCESSING_LINK;
using llm_datadist::LLM_FAILED;
using llm_datadist::LLM_FEATURE_NOT_ENABLED;
using llm_datadist::LLM_KV_CACHE_NOT_EXIST;
using llm_datadist::LLM_OUT_OF_MEMORY;
using llm_datadist::LLM_PARAM_INVALID;
using llm_datadist::LLM_SUCCESS;

namespace {
constexpr uint64_t kTensorAlign = 64;
constexpr int kCommUnlinkTimeoutMs = 3000;
// How long unregister_cache waits for peers' operations on the cache's
// memory before it cuts their links, and then for the cut links to let go.
constexpr std::chrono::milliseconds kServedUsePatience{2000};
constexpr std::chrono::milliseconds kServedUseCut{5000};

Status not_ready(bool finalized) {
  return refuse(LLM_FAILED, finalized ? "the engine is finalized" : "the engine is not initialized");
}

// Checks the addresses given for a cache's tensors (one each, none null).
Status check_addrs(const CacheSpec &spec, const std::vector<uintptr_t> &addrs) {
  if (addrs.size() != spec.num_tensors) {
    return refuse(LLM_PARAM_INVALID, words(addrs.size() < spec.num_tensors ? "too few" : "too many",
                                           " addresses: ", addrs.size(), " given, num_tensors is ",
                                           spec.num_tensors));
  }
  for (size_t i = 0; i < addrs.size(); ++i) {
    if (addrs[i] == 0) return refuse(LLM_PARAM_INVALID, words("addrs[", i, "] is 0"));
  }
  return LLM_SUCCESS;
}

// Fills `entry` (spec and geometry set) with `addrs`; for Placement DEVICE
// each address must be device memory of `device`, a whole tensor long.
Status attach_addrs(CacheEntry &entry, const std::vector<uintptr_t> &addrs, std::shared_ptr<cuda::Device> device) {
  Status st = check_addrs(entry.spec, addrs);
  if (st != LLM_SUCCESS) return st;
  if (device) {
    std::string why;
    if (!device->make_current(why)) return refuse(LLM_FAILED, "Placement DEVICE: " + why);
    for (size_t i = 0; i < addrs.size(); ++i) {
      st = device->check_range(addrs[i], entry.geometry.tensor_size, words("addrs[", i, "]"));
      if (st != LLM_SUCCESS) return st;
    }
    entry.device = std::move(device);
  }
  for (uintptr_t addr : addrs) entry.addrs.push_back(reinterpret_cast<uint8_t *>(addr));
  return LLM_SUCCESS;
}
}  // namespace

Status Engine::open_device(const CacheSpec &spec, std::shared_ptr<cuda::Device> &out) const {
  out.reset();
  if (spec.placement != Placement::kDevice) return LLM_SUCCESS;
  std::lock_guard<std::mutex> lock(device_mu_);
  if (!device_) {
    Status st = cuda::Device::open(options_.device_id, device_);
    if (st != LLM_SUCCESS) return st;
  }
  out = device_;
  return LLM_SUCCESS;
}

Engine::Engine(uint64_t cluster_id)
    : cluster_id_(cluster_id),
      completions_(std::make_shared<CompletionQueue>()),
      tracker_(std::make_shared<RequestTracker>(completions_)) {}

Engine::~Engine() { finalize(); }

Status Engine::initialize(const OptionMap &options) {
  clear_error_detail();
  std::unique_lock<std::shared_mutex> lock(state_mu_);
  if (state_ == State::kReady) return LLM_SUCCESS;
  if (state_ == State::kFinalized) return not_ready(true);
  EngineOptions parsed;
  Status st = parse_options(options, parsed);
  if (st != LLM_SUCCESS) return st;
  try {
    if (parsed.host_pool) host_pool_ = std::make_shared<HostPool>(*parsed.host_pool);
  } catch (const std::system_error &e) {
    return refuse(LLM_OUT_OF_MEMORY, words("the host memory pool of ", parsed.host_pool->memory_size,
                                           " bytes could not be mapped: ", e.what()));
  }
  TransportOptions transport_options;
  transport_options.connections_per_peer = parsed.tcp_connections_per_peer;
  transport_options.io_threads = parsed.io_threads;
  transport_options.paths.same_host = parsed.same_host;
  transport_options.paths.ucx = parsed.ucx;
  // Transport "auto" takes UCX between hosts only where its bytes may go
  // unencrypted.
  transport_options.paths.ucx_auto = parsed.same_host && !parsed.ucx && (!parsed.encrypt || parsed.allow_unencrypted_ucx);
  transport_options.auth_key = parsed.auth_key;
  transport_options.encrypt = parsed.encrypt;
  transport_options.paths.one_sided = parsed.one_sided;
  // For tests: engines of one process move each other's bytes by the test path.
  const char *test_path = std::getenv("DATADIST_AIO_TEST_PATH");
  transport_options.paths.test_path = test_path != nullptr && std::string(test_path) == "1";
  transport_options.handshake_timeout_ms = static_cast<int>(parsed.handshake_timeout_ms);
  transport_options.answers = &completions_->answers();
  completions_->answers().set_sweep_after(std::chrono::milliseconds(parsed.answer_sweep_ms));
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
  const bool certificates =
      !parsed.tls_cert_file.empty() || !parsed.tls_key_file.empty() || !parsed.tls_ca_file.empty();
  if (certificates) {
    std::string missing;
    for (auto [name, file] : {std::pair{"tls_cert_file (llm.TlsCertFile)", &parsed.tls_cert_file},
                              std::pair{"tls_key_file (llm.TlsKeyFile)", &parsed.tls_key_file},
                              std::pair{"tls_ca_file (llm.TlsCaFile)", &parsed.tls_ca_file}}) {
      if (file->empty()) missing += (missing.empty() ? "" : ", ") + std::string(name);
    }
    if (!missing.empty()) {
      return refuse(LLM_PARAM_INVALID, "link certificates need this end's certificate, its key and the CA's, all "
                                       "three; missing: " + missing);
    }
    if (!parsed.encrypt) {
      return refuse(LLM_PARAM_INVALID, "link certificates are set but link encryption is off: set "
                                       "LLMConfig.link_encryption \"tls\" (llm.LinkEncryption)");
    }
  }
  if (parsed.encrypt) {
    if (parsed.auth_key.empty() && !certificates) {
      return refuse(LLM_PARAM_INVALID, std::string("link encryption \"tls\" needs the link secret, from which its keys "
                                                   "come, or certificates: set LLMConfig.auth_key (llm.AuthKey) or ") +
                                           kAuthKeyEnv + " on every peer, or tls_cert_file, tls_key_file and "
                                           "tls_ca_file");
    }
    const std::string why = tls::unavailable();
    if (!why.empty()) {
      log_warning("link encryption is on, but " + why + "; install OpenSSL (libssl3) to encrypt links");
      return refuse(LLM_FEATURE_NOT_ENABLED, "link encryption \"tls\" needs OpenSSL: " + why);
    }
    if (certificates) {
      std::string cert_why;
      transport_options.certs =
          tls::CertContexts::load({parsed.tls_cert_file, parsed.tls_key_file, parsed.tls_ca_file}, cert_why);
      if (!transport_options.certs) return refuse(LLM_PARAM_INVALID, "link certificates: " + cert_why);
    }
    if (parsed.ucx && !parsed.allow_unencrypted_ucx) {
      return refuse(LLM_PARAM_INVALID,
                    "link encryption \"tls\" cannot cover transport \"ucx\": UCX moves the bytes outside the "
                    "link's TLS connections, unencrypted. Set LLMConfig.allow_unencrypted_ucx (llm.AllowUnencryptedUcx) "
                    "to let it, or use transport \"auto\" or \"tcp\"");
    }
    if (parsed.ucx) log_warning("link encryption is on, but UCX moves this engine's bytes unencrypted (allow_unencrypted_ucx)");
    if (parsed.same_host && !parsed.ucx && !parsed.allow_unencrypted_ucx) {
      log_message(LogLevel::kInfo, "link encryption is on: transport \"auto\" takes no UCX between hosts "
                                   "(allow_unencrypted_ucx lets it, unencrypted)");
    }
  }
  auto transport = std::make_unique<LinkManager>(cluster_id_, role_code(parsed.role), registry_, transport_options);
  st = transport->start_paths();
  if (st != LLM_SUCCESS) return st;
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
  {
    std::lock_guard<std::mutex> watches(watches_mu_);
    for (auto &[id, watch] : watches_) watch->settle(kCancelledStatus, true);
    watches_.clear();
  }
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
  clear_error_detail();
  std::shared_lock<std::shared_mutex> lock(state_mu_);
  if (state_ != State::kReady) return not_ready(state_ == State::kFinalized);
  auto entry = std::make_shared<CacheEntry>();
  entry->spec = spec;
  Status st = compute_geometry(spec, entry->geometry);
  if (st != LLM_SUCCESS) return st;
  std::shared_ptr<cuda::Device> device;
  st = open_device(spec, device);
  if (st == LLM_SUCCESS) st = attach_addrs(*entry, addrs, std::move(device));
  if (st != LLM_SUCCESS) return st;
  entry->remote_accessible = remote_accessible;
  return registry_.add(std::move(entry), keys, blocks_model_id, false, cache_id);
}

Status Engine::allocate_cache(const CacheSpec &spec, const std::vector<KeySpec> &keys,
                              std::optional<uint64_t> blocks_model_id, int64_t &cache_id,
                              std::vector<uintptr_t> &addrs) {
  clear_error_detail();
  std::shared_lock<std::shared_mutex> lock(state_mu_);
  if (state_ != State::kReady) return not_ready(state_ == State::kFinalized);
  auto entry = std::make_shared<CacheEntry>();
  entry->spec = spec;
  Status st = compute_geometry(spec, entry->geometry);
  if (st != LLM_SUCCESS) return st;
  if (spec.placement == Placement::kDevice) {
    st = open_device(spec, entry->device);
    if (st == LLM_SUCCESS) st = entry->device->allocate(spec.num_tensors, entry->geometry.tensor_size, entry->addrs);
    if (st != LLM_SUCCESS) return st;
    entry->device_allocated = true;
    entry->remote_accessible = true;
    std::vector<uintptr_t> out_addrs;
    for (uint8_t *addr : entry->addrs) out_addrs.push_back(reinterpret_cast<uintptr_t>(addr));
    st = registry_.add(std::move(entry), keys, blocks_model_id, true, cache_id);
    if (st == LLM_SUCCESS) addrs = std::move(out_addrs);
    return st;  // on failure the entry's destructor frees the memory
  }
  if (!host_pool_) {
    return refuse(LLM_FEATURE_NOT_ENABLED, "allocating a cache needs a host memory pool (llm.HostMemPoolConfig)");
  }
  const uint64_t step = (entry->geometry.tensor_size + kTensorAlign - 1) / kTensorAlign * kTensorAlign;
  uint64_t total;
  if (__builtin_mul_overflow(step, static_cast<uint64_t>(spec.num_tensors), &total)) {
    return refuse(LLM_OUT_OF_MEMORY, "the cache's size overflows 64 bits");
  }
  uint8_t *block = host_pool_->allocate(total);
  if (block == nullptr) {
    const uint64_t free = host_pool_->bytes_free();
    return refuse(LLM_OUT_OF_MEMORY, words("the host pool cannot give the ", total, " bytes requested (",
                                           spec.num_tensors, " tensors of ", entry->geometry.tensor_size,
                                           " bytes): ", free, " of its ", host_pool_->capacity(), " bytes are free",
                                           free >= total ? ", but not in one piece" : ""));
  }
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
  clear_error_detail();
  std::shared_lock<std::shared_mutex> lock(state_mu_);
  if (state_ != State::kReady) return not_ready(state_ == State::kFinalized);
  registry_.deallocate(cache_id);
  return LLM_SUCCESS;
}

Status Engine::unregister_cache(int64_t cache_id) {
  clear_error_detail();
  std::shared_lock<std::shared_mutex> lock(state_mu_);
  if (state_ != State::kReady) return not_ready(state_ == State::kFinalized);
  const std::shared_ptr<CacheEntry> entry = registry_.unregister(cache_id);
  // The memory is the caller's again on return: a peer's operation that was
  // served from it or into it before has ended by then, or its link is cut.
  if (entry && entry->caller_owned() && !entry->wait_unused(kServedUsePatience, kServedUseCut)) {
    log_warning("cache " + std::to_string(cache_id) + " was unregistered while a peer's operation on it outlasted " +
                "the cut of its link; its memory may still be touched");
  }
  return LLM_SUCCESS;
}

Status Engine::remove_cache_key(const KeySpec &key) {
  clear_error_detail();
  std::shared_lock<std::shared_mutex> lock(state_mu_);
  if (state_ != State::kReady) return not_ready(state_ == State::kFinalized);
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
    return out ? LLM_SUCCESS : refuse(LLM_KV_CACHE_NOT_EXIST, words("no cache with id ", view.cache_id));
  }
  auto entry = std::make_shared<CacheEntry>();
  entry->spec = view.spec;
  Status st = compute_geometry(view.spec, entry->geometry);
  if (st != LLM_SUCCESS) return st;
  std::shared_ptr<cuda::Device> device;
  st = open_device(view.spec, device);
  if (st == LLM_SUCCESS) st = attach_addrs(*entry, view.addrs, std::move(device));
  if (st != LLM_SUCCESS) return st;
  out = std::move(entry);
  return LLM_SUCCESS;
}

Status Engine::start_copy(std::vector<CopySegment> segments, std::vector<std::shared_ptr<CacheEntry>> pins,
                          std::shared_ptr<Request> &out) {
  out = tracker_->create(1);
  run_local_copy(*workers_, out, std::move(segments), pins[0], pins[1]);
  return LLM_SUCCESS;
}

Status Engine::copy_cache(int64_t dst_id, int64_t src_id, uint64_t dst_slot, uint64_t src_slot,
                          uint64_t offset, int64_t size, std::shared_ptr<Request> &out) {
  clear_error_detail();
  std::shared_lock<std::shared_mutex> lock(state_mu_);
  if (state_ != State::kReady) return not_ready(state_ == State::kFinalized);
  auto dst = registry_.find(dst_id);
  auto src = registry_.find(src_id);
  if (!dst) return refuse(LLM_KV_CACHE_NOT_EXIST, words("no destination cache with id ", dst_id));
  if (!src) return refuse(LLM_KV_CACHE_NOT_EXIST, words("no source cache with id ", src_id));
  std::vector<CopySegment> segments;
  Status st = plan_copy_cache(*dst, *src, dst_slot, src_slot, offset, size, segments);
  if (st != LLM_SUCCESS) return st;
  return start_copy(std::move(segments), {dst, src}, out);
}

Status Engine::copy_blocks(const CacheView &dst_view, const CacheView &src_view, const BlockPairs &pairs,
                           std::shared_ptr<Request> &out) {
  clear_error_detail();
  std::shared_lock<std::shared_mutex> lock(state_mu_);
  if (state_ != State::kReady) return not_ready(state_ == State::kFinalized);
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

bool Engine::has_link(uint64_t peer) const {
  std::shared_lock<std::shared_mutex> lock(state_mu_);
  return state_ == State::kReady && transport_->find(peer) != nullptr;
}

std::map<std::string, uint64_t> Engine::listener_stats() const {
  std::shared_lock<std::shared_mutex> lock(state_mu_);
  if (state_ != State::kReady || transport_->listen_port() == 0) return {};
  const ListenerStats s = transport_->listener_stats();
  return {{"waiting", s.waiting},   {"forming", s.forming}, {"accepted", s.accepted},
          {"evicted", s.evicted},   {"expired", s.expired}, {"accept_pauses", s.accept_pauses},
          {"links", transport_->link_count()}};
}

std::map<std::string, uint64_t> Engine::link_stats(uint64_t peer) const {
  std::shared_lock<std::shared_mutex> lock(state_mu_);
  LinkManager::LinkStats stats;
  if (state_ != State::kReady || !transport_->link_stats(peer, stats)) return {};
  std::map<std::string, uint64_t> out = std::move(stats.paths);
  out["connections"] = stats.connections;
  out["refused_groups"] = stats.refused_groups;
  out["local_sockets"] = stats.local_sockets;
  out["answer_socket"] = stats.answer_socket ? 1u : 0u;
  out["encrypted"] = stats.security.encrypted;  // connections in TLS
  out["ktls"] = stats.security.ktls;            // of those, the ones whose records the kernel carries
  return out;
}

std::map<std::string, uint64_t> Engine::answer_counts() const { return completions_->answers().answer_counts(); }

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

Status Engine::link_security(uint64_t peer, std::string &transport, bool &encrypted, std::string &cipher,
                             bool &ktls) const {
  std::shared_lock<std::shared_mutex> lock(state_mu_);
  if (state_ != State::kReady) return LLM_FAILED;
  Link::Security security;
  if (!transport_->link_security(peer, transport, security)) return llm_datadist::LLM_NOT_YET_LINK;
  encrypted = security.encrypted > 0;
  cipher = security.cipher;
  ktls = encrypted && security.ktls == security.encrypted;
  return LLM_SUCCESS;
}

Status Engine::link_clusters(const std::vector<LinkTarget> &targets, int timeout_ms, std::vector<Status> &rets) {
  clear_error_detail();
  std::shared_lock<std::shared_mutex> lock(state_mu_);
  if (state_ != State::kReady) return not_ready(state_ == State::kFinalized);
  if (targets.empty()) return refuse(LLM_PARAM_INVALID, "no cluster to link");
  if (timeout_ms <= 0) return refuse(LLM_PARAM_INVALID, words("timeout ", timeout_ms, " ms must be > 0"));
  std::vector<std::string> details(targets.size());
  constexpr size_t kParallel = 16;
  rets.assign(targets.size(), LLM_SUCCESS);
  for (size_t first = 0; first < targets.size(); first += kParallel) {
    std::vector<std::thread> threads;
    auto link_one = [this, &targets, &rets, &details, timeout_ms](size_t i) {
      const LinkTarget &t = targets[i];
      if (t.peer_id == cluster_id_) {
        rets[i] = LLM_PARAM_INVALID;
        details[i] = "a cluster cannot link to itself";
        return;
      }
      rets[i] = transport_->link(t.peer_id, t.remote_ip, t.remote_port, t.local_ip, timeout_ms);
      details[i] = error_detail();
    };
    for (size_t i = first; i < std::min(targets.size(), first + kParallel); ++i) {
      try {
        threads.emplace_back(link_one, i);
      } catch (const std::system_error &) {
        link_one(i);  // no thread to be had: this one links in turn
      }
    }
    for (auto &thread : threads) thread.join();
  }
  for (size_t i = 0; i < rets.size(); ++i) {
    if (rets[i] == LLM_SUCCESS) continue;
    const LinkTarget &t = targets[i];
    std::string why = words("link to cluster ", t.peer_id, " at ", t.remote_ip, ":", t.remote_port, " failed with ",
                            status_name(rets[i]));
    if (!details[i].empty()) why += ": " + details[i];
    return refuse(rets[i], std::move(why));
  }
  return LLM_SUCCESS;
}

Status Engine::unlink_clusters(const std::vector<uint64_t> &peers, bool force, int timeout_ms,
                               std::vector<Status> &rets) {
  clear_error_detail();
  std::shared_lock<std::shared_mutex> lock(state_mu_);
  if (state_ != State::kReady) return not_ready(state_ == State::kFinalized);
  if (peers.empty()) return refuse(LLM_PARAM_INVALID, "no cluster to unlink");
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
  clear_error_detail();
  std::shared_lock<std::shared_mutex> lock(state_mu_);
  if (state_ != State::kReady) return not_ready(state_ == State::kFinalized);
  const uint32_t code = role_code(role);
  if (code == 0) return refuse(LLM_PARAM_INVALID, "unknown role '" + role + "'");
  if (transport_->link_count() != 0) {
    return refuse(LLM_EXIST_LINK, words("the role cannot change while ", transport_->link_count(),
                                        " link(s) exist; unlink them first"));
  }
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
  clear_error_detail();
  std::shared_lock<std::shared_mutex> lock(state_mu_);
  if (state_ != State::kReady) return not_ready(state_ == State::kFinalized);
  CommSpec spec;
  spec.name = name;
  spec.members = members;
  spec.total_time_ms = static_cast<uint32_t>(
      std::min<uint64_t>(uint64_t{options_.link_total_time_s} * 1000, UINT32_MAX));
  spec.retry_count = options_.link_retry_count;
  return comms_->link(spec, comm_id);
}

Status Engine::unlink_comm(uint64_t comm_id) {
  clear_error_detail();
  std::shared_lock<std::shared_mutex> lock(state_mu_);
  if (state_ != State::kReady) return not_ready(state_ == State::kFinalized);
  return comms_->unlink(comm_id, kCommUnlinkTimeoutMs);
}

Status Engine::comm_state(uint64_t comm_id, CommState &out) const {
  clear_error_detail();
  std::shared_lock<std::shared_mutex> lock(state_mu_);
  if (state_ != State::kReady) return not_ready(state_ == State::kFinalized);
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

// LLM_PARAM_INVALID naming the first block of `blocks` (called `name`) that
// is not below `limit`, the block count of the `side` cache.
Status check_below(const std::vector<uint64_t> &blocks, const char *name, uint64_t limit, const char *side) {
  for (size_t k = 0; k < blocks.size(); ++k) {
    if (blocks[k] >= limit) {
      return refuse(LLM_PARAM_INVALID, words(name, "[", k, "] = ", blocks[k], " is out of range: the ", side,
                                             " cache has ", limit, " blocks"));
    }
  }
  return LLM_SUCCESS;
}

// LLM_PARAM_INVALID naming the first block of `blocks` listed twice.
Status check_distinct(const std::vector<uint64_t> &blocks, const char *name) {
  std::unordered_map<uint64_t, size_t> seen;
  for (size_t k = 0; k < blocks.size(); ++k) {
    auto [it, fresh] = seen.emplace(blocks[k], k);
    if (!fresh) {
      return refuse(LLM_PARAM_INVALID, words("duplicated destination block: ", name, "[", k, "] = ", blocks[k],
                                             " repeats ", name, "[", it->second, "]"));
    }
  }
  return LLM_SUCCESS;
}

// Pairs first[k] with second[k]; LLM_PARAM_INVALID unless both lists have
// the same length, the local list stays below `local_blocks` and no
// destination (second) is named twice.
Status pair_blocks(const std::vector<uint64_t> &first, const std::vector<uint64_t> &second, bool local_is_first,
                   uint64_t local_blocks, BlockPairs &pairs) {
  if (first.size() != second.size()) {
    return refuse(LLM_PARAM_INVALID, words("src_blocks and dst_blocks differ in length: ", first.size(),
                                           " != ", second.size()));
  }
  Status st = check_below(local_is_first ? first : second, local_is_first ? "src_blocks" : "dst_blocks",
                          local_blocks, "local");
  if (st != LLM_SUCCESS) return st;
  st = check_distinct(second, "dst_blocks");
  if (st != LLM_SUCCESS) return st;
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

// The frames of an operation on `local`'s memory: those that name device
// exports carry no bytes, so they go up to the most the peer reads (fewer
// frames, each a longer run of copies at the owner).
FramePlanner frames_for(const Link &link, const CacheEntry &local, const wire::Target &target) {
  if (local.device && link.device_frames_by_reference()) {
    return FramePlanner(target, link.device_frame_bytes(), wire::kMaxRanges);
  }
  return FramePlanner(target);
}

// A pull through a key releases it on the owner once every tensor was read.
uint8_t release_flag(const RemoteName &src) { return src.kind == wire::kByKey ? wire::kReleaseKey : 0; }

}  // namespace

Status Engine::prepare_remote(int64_t local_id, uint64_t peer, const LayerSpan &span,
                              std::shared_ptr<CacheEntry> &entry, std::shared_ptr<Link> &link) const {
  clear_error_detail();
  if (state_ != State::kReady) return not_ready(state_ == State::kFinalized);
  entry = registry_.find(local_id);
  if (!entry) return refuse(LLM_KV_CACHE_NOT_EXIST, words("no local cache with id ", local_id));
  if (peer == cluster_id_) {
    return refuse(LLM_PARAM_INVALID, words("cluster ", peer, " is this instance itself, not a peer"));
  }
  link = transport_->find(peer);
  // A link going down is found until it is taken out; its comm hears of the
  // loss first, so an operation meanwhile is told to retry.
  if ((!link || link->is_down()) && comms_->relinking(peer)) {
    return refuse(LLM_PROCESSING_LINK, words("the link to cluster ", peer,
                                             " was lost and its comm is linking it again; retry"));
  }
  if (!link) return refuse(LLM_NOT_YET_LINK, words("no link to cluster ", peer, "; link_clusters first"));
  if (options_.remote_cache_accessible && !entry->remote_accessible) {
    return refuse(LLM_PARAM_INVALID, words("local cache ", local_id, " was registered with remote_accessible=False"));
  }
  const uint32_t tensors = entry->spec.num_tensors;
  if (span.per_layer == 0 || tensors % span.per_layer != 0) {
    return refuse(LLM_PARAM_INVALID, words("the local cache's ", tensors,
                                           " tensors do not split into layers of tensor_num_per_layer=",
                                           span.per_layer));
  }
  if (uint64_t{span.local_first} + span.count > tensors / span.per_layer) {
    return refuse(LLM_PARAM_INVALID, words("layer range too long: layers [", span.local_first, ", ",
                                           uint64_t{span.local_first} + span.count, ") of a local cache of ",
                                           tensors / span.per_layer, " layers"));
  }
  if ((uint64_t{span.remote_first} + span.count) * span.per_layer > UINT32_MAX) {
    return refuse(LLM_PARAM_INVALID, words("remote layer range [", span.remote_first, ", ",
                                           uint64_t{span.remote_first} + span.count, ") is too far"));
  }
  return LLM_SUCCESS;
}

Status Engine::start_remote(const std::shared_ptr<Link> &link, bool write, FramePlanner &planner,
                            std::shared_ptr<CacheEntry> pin, std::shared_ptr<Request> &out,
                            const std::shared_ptr<Request> &into, size_t result_index) {
  out = into ? into : tracker_->create(1);
  auto frames = planner.take();
  if (!frames.empty()) {
    const Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(options_.sync_kv_timeout_ms);
    std::shared_ptr<cuda::Device> device = pin->device;
    link->submit(write, std::move(frames), out, result_index, deadline, std::move(pin), std::move(device));
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
  if (src_slot >= src->geometry.num_slots) {
    return refuse(LLM_PARAM_INVALID, words("src_batch_index ", src_slot, " is out of range: the local cache has ",
                                           src->geometry.num_slots, " batch slots"));
  }
  if (dst_cache_id <= 0) {
    return refuse(LLM_KV_CACHE_NOT_EXIST, words("destination cache id ", dst_cache_id, " must be > 0"));
  }
  RemoteName name;
  name.cache_id = dst_cache_id;
  wire::Target target = name_target(name);
  target.flags = wire::kWithinSlot;
  target.expected_slot_size = slot;
  FramePlanner planner = frames_for(*link, *src, target);
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
  if (src_blocks.empty()) return refuse(LLM_PARAM_INVALID, "src_blocks is empty");
  BlockPairs pairs;
  st = pair_blocks(src_blocks, dst_blocks, true, src->geometry.num_slots, pairs);
  if (st != LLM_SUCCESS) return st;
  wire::Target target = name_target(dst);
  target.expected_slot_size = src->geometry.slot_size;
  FramePlanner planner = frames_for(*link, *src, target);
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
  if (dst_slot >= dst->geometry.num_slots) {
    return refuse(LLM_PARAM_INVALID, words("batch_index ", dst_slot, " is out of range: the local cache has ",
                                           dst->geometry.num_slots, " batch slots"));
  }
  if (size == 0 || size < -1 || (size > 0 && static_cast<uint64_t>(size) > slot)) {
    return refuse(LLM_PARAM_INVALID, words("size ", size, " must be -1 or in [1, ", slot,
                                           "] (the local slot size)"));
  }
  const uint64_t length = size < 0 ? slot : static_cast<uint64_t>(size);
  wire::Target target = name_target(src_name);
  target.flags = wire::kWithinSlot | release_flag(src_name);
  target.expected_slot_size = size < 0 ? slot : 0;
  FramePlanner planner = frames_for(*link, *dst, target);
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
  if (dst_blocks.empty()) return refuse(LLM_PARAM_INVALID, "dst_blocks is empty");
  st = check_below(dst_blocks, "dst_blocks", dst->geometry.num_slots, "local");
  if (st != LLM_SUCCESS) return st;
  const uint64_t block = dst->geometry.slot_size;
  wire::Target target = name_target(src_name);
  if (!src_blocks.empty()) {
    BlockPairs pairs;
    st = pair_blocks(src_blocks, dst_blocks, false, dst->geometry.num_slots, pairs);
    if (st != LLM_SUCCESS) return st;
    target.expected_slot_size = block;
    FramePlanner planner = frames_for(*link, *dst, target);
    add_block_runs(planner, *dst, span, pairs, false);
    return start_remote(link, false, planner, dst, out);
  }
  // A contiguous slot of the peer, cut into this cache's blocks.
  st = check_distinct(dst_blocks, "dst_blocks");
  if (st != LLM_SUCCESS) return st;
  wire::LookupReply remote;
  st = link->lookup(target, remote, static_cast<int>(options_.sync_kv_timeout_ms));
  if (st != LLM_SUCCESS) {
    if (error_detail().empty()) {
      set_error_detail(words("cluster ", peer, " answered the lookup of the source cache with ", status_name(st)));
    }
    return st;
  }
  const uint64_t chunks = (remote.slot_size + block - 1) / block;
  if (dst_blocks.size() > chunks) {
    return refuse(LLM_PARAM_INVALID, words(dst_blocks.size(), " dst_blocks for a peer slot of ", remote.slot_size,
                                           " bytes, which fills only ", chunks, " blocks of ", block, " bytes"));
  }
  target.flags = wire::kWithinSlot | release_flag(src_name);
  FramePlanner planner = frames_for(*link, *dst, target);
  for_each_tensor(span, [&](uint32_t local, uint32_t remote_tensor) {
    for (size_t j = 0; j < dst_blocks.size(); ++j) {
      const uint64_t offset = j * block;
      planner.add(dst->addrs[local] + dst_blocks[j] * block, remote_tensor, src_name.slot, offset,
                  std::min(block, remote.slot_size - offset));
    }
  });
  return start_remote(link, false, planner, dst, out);
}

namespace {

// Checks byte ranges inside blocks of `block` bytes before any moves: this
// side's end of each (the destination of a pull, `local_is_dst`, or the
// source of a push) lies in one of its `blocks` blocks; the peer's end does
// not overflow (the peer checks it against its own blocks); no two
// destination rows overlap (the outcome would depend on the order the rows
// were served in).
Status check_ranges(const std::vector<BlockRange> &ranges, uint64_t block, uint64_t blocks, bool local_is_dst) {
  if (ranges.empty()) return refuse(LLM_PARAM_INVALID, "ranges is empty");
  const char *const local_name = local_is_dst ? "dst" : "src";
  uint64_t elements = 0;
  for (size_t k = 0; k < ranges.size(); ++k) {
    const BlockRange &r = ranges[k];
    if (r.length == 0) return refuse(LLM_PARAM_INVALID, words("ranges[", k, "] has length 0"));
    if (r.count == 0 || r.count > wire::kMaxElements) {
      return refuse(LLM_PARAM_INVALID, words("ranges[", k, "]: count ", r.count, " must be in [1, ",
                                             wire::kMaxElements, "]"));
    }
    if (r.count > 1 && (r.src_stride < r.length || r.dst_stride < r.length)) {
      return refuse(LLM_PARAM_INVALID, words("ranges[", k, "]: strides (", r.src_stride, ", ", r.dst_stride,
                                             ") are shorter than the length ", r.length));
    }
    const uint64_t local_block = local_is_dst ? r.dst_block : r.src_block;
    const uint64_t local_offset = local_is_dst ? r.dst_offset : r.src_offset;
    const uint64_t local_stride = local_is_dst ? r.dst_stride : r.src_stride;
    if (local_block >= blocks) {
      return refuse(LLM_PARAM_INVALID, words("ranges[", k, "]: ", local_name, "_block ", local_block,
                                             " is out of range: the local cache has ", blocks, " blocks"));
    }
    // The last row's offsets, in 128 bits: no input overflows them.
    const unsigned __int128 rows = r.count - 1;
    if (local_offset + rows * local_stride + r.length > block) {
      return refuse(LLM_PARAM_INVALID, words("ranges[", k, "]: [", local_offset, ", +", r.length,
                                             r.count > 1 ? words(") repeated ", r.count, " times ", local_stride,
                                                                 " bytes apart")
                                                         : std::string(")"),
                                             " leaves the local block of ", block, " bytes"));
    }
    const uint64_t remote_offset = local_is_dst ? r.src_offset : r.dst_offset;
    const uint64_t remote_stride = local_is_dst ? r.src_stride : r.dst_stride;
    if (remote_offset + rows * remote_stride + r.length > UINT64_MAX) {
      return refuse(LLM_PARAM_INVALID, words("ranges[", k, "]: the ", local_is_dst ? "source" : "destination",
                                             " offsets overflow"));
    }
    elements += r.count;
  }
  struct Row {
    uint64_t block, start, length;
    size_t range;
  };
  std::vector<Row> written;
  written.reserve(elements);
  for (size_t k = 0; k < ranges.size(); ++k) {
    const BlockRange &r = ranges[k];
    for (uint64_t j = 0; j < r.count; ++j) written.push_back({r.dst_block, r.dst_offset + j * r.dst_stride, r.length, k});
  }
  std::sort(written.begin(), written.end(),
            [](const Row &a, const Row &b) { return a.block != b.block ? a.block < b.block : a.start < b.start; });
  for (size_t i = 1; i < written.size(); ++i) {
    const Row &a = written[i - 1], &b = written[i];
    if (a.block == b.block && a.start + a.length > b.start) {
      return refuse(LLM_PARAM_INVALID, words("ranges[", std::min(a.range, b.range), "] and ranges[",
                                             std::max(a.range, b.range), "] overlap in ",
                                             local_is_dst ? "local" : "destination", " block ", b.block));
    }
  }
  return LLM_SUCCESS;
}

}  // namespace

Status Engine::pull_ranges(int64_t dst_id, uint64_t peer, const RemoteName &src_name,
                           const std::vector<BlockRange> &ranges, const LayerSpan &span,
                           std::shared_ptr<Request> &out) {
  std::shared_lock<std::shared_mutex> lock(state_mu_);
  std::shared_ptr<CacheEntry> dst;
  std::shared_ptr<Link> link;
  Status st = prepare_remote(dst_id, peer, span, dst, link);
  if (st != LLM_SUCCESS) return st;
  const uint64_t block = dst->geometry.slot_size;
  st = check_ranges(ranges, block, dst->geometry.num_slots, true);
  if (st != LLM_SUCCESS) return st;
  wire::Target target = name_target(src_name);
  target.flags = wire::kWithinSlot;
  FramePlanner planner = frames_for(*link, *dst, target);
  for_each_tensor(span, [&](uint32_t local, uint32_t remote) {
    for (const BlockRange &r : ranges) {
      planner.add_strided(dst->addrs[local] + r.dst_block * block + r.dst_offset, r.dst_stride, remote, r.src_block,
                          r.src_offset, r.src_stride, r.count, r.length);
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
  if (raw && step.dst_addrs.size() != step.per_layer) {
    return refuse(LLM_PARAM_INVALID, words(step.dst_addrs.size(), " destination addresses for a layer of ",
                                           step.per_layer, " tensors"));
  }
  if (!step.ranges.empty()) {
    if (raw || blocks_to_blocks || slot_to_blocks) {
      return refuse(LLM_PARAM_INVALID, "ranges move without block lists or destination addresses");
    }
    st = check_ranges(step.ranges, slot, src->geometry.num_slots, false);
    if (st != LLM_SUCCESS) return st;
    wire::Target target = name_target(step.dst);
    target.flags = wire::kWithinSlot;
    target.group = step.group;
    FramePlanner planner = frames_for(*link, *src, target);
    for (uint32_t i = 0; i < step.per_layer; ++i) {
      uint8_t *base = src->addrs[step.src_layer * step.per_layer + i];
      const uint32_t remote = step.dst_layer * step.per_layer + i;
      for (const BlockRange &r : step.ranges) {
        planner.add_strided(base + r.src_block * slot + r.src_offset, r.src_stride, remote, r.dst_block,
                            r.dst_offset, r.dst_stride, r.count, r.length);
      }
    }
    std::shared_ptr<Request> out;
    return start_remote(link, true, planner, src, out, into, result_index);
  }
  uint64_t chunk = slot;
  std::vector<BlockRun> runs;
  if (blocks_to_blocks) {
    if (step.chunk_size != 0 && step.chunk_size != slot) {
      return refuse(LLM_PARAM_INVALID, words("dst_block_memory_size ", step.chunk_size,
                                             " differs from the source block size ", slot));
    }
    BlockPairs pairs;
    st = pair_blocks(step.src_blocks, step.dst_blocks, true, src->geometry.num_slots, pairs);
    if (st != LLM_SUCCESS) return st;
    runs = merge_block_runs(pairs);
  } else {
    if (step.src_slot >= src->geometry.num_slots) {
      return refuse(LLM_PARAM_INVALID, words("src_batch_index ", step.src_slot,
                                             " is out of range: the source cache has ", src->geometry.num_slots,
                                             " batch slots"));
    }
    if (slot_to_blocks) {
      chunk = step.chunk_size;
      if (chunk == 0 || chunk > slot) {
        return refuse(LLM_PARAM_INVALID, words("dst_block_memory_size ", chunk, " must be in [1, ", slot,
                                               "] (the source slot size)"));
      }
      if ((slot + chunk - 1) / chunk < step.dst_blocks.size()) {
        return refuse(LLM_PARAM_INVALID, words(step.dst_blocks.size(), " dst_block_indices for a slot of ", slot,
                                               " bytes, which fills only ", (slot + chunk - 1) / chunk,
                                               " blocks of ", chunk, " bytes"));
      }
      st = check_distinct(step.dst_blocks, "dst_block_indices");
      if (st != LLM_SUCCESS) return st;
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

namespace datadist {

void Engine::EventWatch::settle(Status status, bool skipped) {
  if (!settled.exchange(true)) request->release(0, status, skipped);
}

Status Engine::watch_event(uint64_t event, std::shared_ptr<Request> &out) {
  clear_error_detail();
  std::shared_lock<std::shared_mutex> lock(state_mu_);
  if (state_ != State::kReady) return not_ready(state_ == State::kFinalized);
  if (event == 0) return refuse(LLM_PARAM_INVALID, "event: 0 is not a CUevent");
  CacheSpec device_spec;
  device_spec.placement = Placement::kDevice;
  std::shared_ptr<cuda::Device> device;
  Status st = open_device(device_spec, device);
  if (st != LLM_SUCCESS) return st;
  auto watch = std::make_shared<EventWatch>();
  watch->request = tracker_->create(1);  // its hold is the watch's
  std::string why;
  // The host function keeps the device (and so the stream it runs on) alive.
  auto done = [watch, device] { watch->settle(LLM_SUCCESS, false); };
  {
    std::lock_guard<std::mutex> watches(watches_mu_);
    for (auto it = watches_.begin(); it != watches_.end();) {
      it = it->second->settled.load() ? watches_.erase(it) : std::next(it);
    }
    watches_.emplace(watch->request->id(), watch);
  }
  if (!device->after_event(reinterpret_cast<cuda::CUevent>(static_cast<uintptr_t>(event)), std::move(done), why)) {
    {
      std::lock_guard<std::mutex> watches(watches_mu_);
      watches_.erase(watch->request->id());
    }
    watch->settle(LLM_PARAM_INVALID, true);
    return refuse(LLM_PARAM_INVALID, words("event ", event, ": ", why));
  }
  out = watch->request;
  return LLM_SUCCESS;
}

bool Engine::unwatch_event(uint64_t request_id) {
  std::shared_ptr<EventWatch> watch;
  {
    std::lock_guard<std::mutex> watches(watches_mu_);
    auto it = watches_.find(request_id);
    if (it == watches_.end()) return false;
    watch = std::move(it->second);
    watches_.erase(it);
  }
  const bool first = !watch->settled.load();
  watch->settle(kCancelledStatus, true);
  return first;
}

}  // namespace datadist
