#include "options.h"

#include <cctype>
#include <cstdlib>
#include <thread>

#include "error_detail.h"

namespace datadist {

using llm_datadist::LLM_PARAM_INVALID;
using llm_datadist::LLM_SUCCESS;

namespace {

// Parses a decimal unsigned integer that makes up the whole string.
bool parse_uint(const std::string &text, uint64_t max, uint64_t &out) {
  if (text.empty() || text.size() > 20) return false;
  uint64_t value = 0;
  for (char c : text) {
    if (c < '0' || c > '9') return false;
    if (__builtin_mul_overflow(value, 10, &value) || __builtin_add_overflow(value, c - '0', &value)) {
      return false;
    }
  }
  if (value > max) return false;
  out = value;
  return true;
}

// A reader for the one JSON shape pool configs use: a flat object whose
// values are unsigned integers.
class FlatJsonReader {
 public:
  explicit FlatJsonReader(const std::string &text) : s_(text) {}

  bool read(std::map<std::string, uint64_t> &out) {
    if (!expect('{')) return false;
    skip_space();
    if (peek() == '}') return ++pos_, at_end();
    for (;;) {
      std::string key;
      uint64_t value;
      if (!read_string(key) || !expect(':') || !read_number(value)) return false;
      if (!out.emplace(key, value).second) return false;
      skip_space();
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      return expect('}') && at_end();
    }
  }

 private:
  char peek() const { return pos_ < s_.size() ? s_[pos_] : '\0'; }
  void skip_space() {
    while (pos_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[pos_]))) ++pos_;
  }
  bool expect(char c) {
    skip_space();
    if (peek() != c) return false;
    ++pos_;
    return true;
  }
  bool at_end() {
    skip_space();
    return pos_ == s_.size();
  }
  bool read_string(std::string &out) {
    if (!expect('"')) return false;
    const size_t end = s_.find('"', pos_);
    if (end == std::string::npos || end - pos_ > 64) return false;
    out = s_.substr(pos_, end - pos_);
    pos_ = end + 1;
    return out.find('\\') == std::string::npos;
  }
  bool read_number(uint64_t &out) {
    skip_space();
    const size_t start = pos_;
    while (pos_ < s_.size() && std::isdigit(static_cast<unsigned char>(s_[pos_]))) ++pos_;
    return parse_uint(s_.substr(start, pos_ - start), UINT64_MAX, out);
  }

  const std::string &s_;
  size_t pos_ = 0;
};

const std::string *find(const OptionMap &options, const char *key) {
  auto it = options.find(key);
  return it == options.end() ? nullptr : &it->second;
}

}  // namespace

uint32_t role_code(const std::string &role) {
  if (role == "Prompt") return 1;
  if (role == "Decoder") return 2;
  if (role == "Mix") return 3;
  return 0;
}

Status parse_listen(const OptionMap &options, std::optional<std::string> &ip, uint16_t &port) {
  const std::string *listen_ip = find(options, kOptListenIp);
  if (listen_ip == nullptr) {
    ip.reset();
    port = 0;
    return LLM_SUCCESS;
  }
  uint64_t value = 0;
  const std::string *listen_port = find(options, kOptListenPort);
  if (listen_port == nullptr || !parse_uint(*listen_port, UINT16_MAX, value)) {
    return refuse(LLM_PARAM_INVALID, "the listen port must be an integer in [0, 65535]");
  }
  ip = *listen_ip;
  port = static_cast<uint16_t>(value);
  return LLM_SUCCESS;
}

Status parse_pool_config(const std::string &json, PoolConfig &out) {
  std::map<std::string, uint64_t> fields;
  if (!FlatJsonReader(json).read(fields)) {
    return refuse(LLM_PARAM_INVALID, "memory pool config must be flat JSON of integers, got '" + json + "'");
  }
  auto size = fields.find("memory_size");
  if (size == fields.end() || size->second == 0) {
    return refuse(LLM_PARAM_INVALID, "memory pool config needs \"memory_size\" > 0");
  }
  out.memory_size = size->second;
  auto shift = fields.find("page_shift");
  if (shift != fields.end()) {
    if (shift->second < 10 || shift->second >= 31) {
      return refuse(LLM_PARAM_INVALID, words("page_shift ", shift->second, " is outside [10, 30]"));
    }
    out.page_shift = static_cast<uint32_t>(shift->second);
  }
  return LLM_SUCCESS;
}

namespace {

// The value of option `key`, else of environment variable `env` (set and not
// empty), else `first`; LLM_PARAM_INVALID, naming both, unless it is `first`
// or `second`.
Status either(const OptionMap &options, const char *key, const char *env, const char *what, const char *first,
              const char *second, std::string &out) {
  out = first;
  if (const std::string *set = find(options, key)) {
    out = *set;
  } else if (const char *value = std::getenv(env); value != nullptr && *value != '\0') {
    out = value;
  }
  if (out == first || out == second) return LLM_SUCCESS;
  return refuse(LLM_PARAM_INVALID, std::string(what) + " (" + key + " or " + env + ") must be " + first + " or " +
                                       second + ", got '" + out + "'");
}

}  // namespace

Status parse_options(const OptionMap &options, EngineOptions &out) {
  if (const std::string *role = find(options, kOptRole)) {
    if (role_code(*role) == 0) return refuse(LLM_PARAM_INVALID, "unknown role '" + *role + "'");
    out.role = *role;
  }
  const std::string *device = find(options, kOptDeviceId);
  if (device == nullptr) device = find(options, kOptExecDeviceId);
  if (device != nullptr) {
    const std::string first = device->substr(0, device->find(';'));
    uint64_t id = 0;
    if (!parse_uint(first, INT32_MAX, id)) {
      return refuse(LLM_PARAM_INVALID, "the device id must be an integer in [0, 2147483647], got '" + *device + "'");
    }
    out.device_id = static_cast<int>(id);
  }
  PoolConfig pool;
  if (const std::string *cfg = find(options, kOptHostMemPool)) {
    if (parse_pool_config(*cfg, pool) != LLM_SUCCESS) {
      return refuse(LLM_PARAM_INVALID, "host memory pool: " + error_detail());
    }
    out.host_pool = pool;
  }
  if (const std::string *cfg = find(options, kOptDeviceMemPool)) {
    if (parse_pool_config(*cfg, pool) != LLM_SUCCESS) {
      return refuse(LLM_PARAM_INVALID, "device memory pool: " + error_detail());
    }
    out.device_pool = pool;
  }
  uint64_t value;
  if (const std::string *timeout = find(options, kOptSyncKvTimeout)) {
    if (!parse_uint(*timeout, INT32_MAX, value) || value == 0) {
      return refuse(LLM_PARAM_INVALID, "sync kv timeout must be an integer in [1, 2147483647] ms, got '" + *timeout + "'");
    }
    out.sync_kv_timeout_ms = static_cast<uint32_t>(value);
  }
  const unsigned cores = std::thread::hardware_concurrency();
  out.engine_threads = cores == 0 ? 2 : (cores < 4 ? cores : 4);
  if (const std::string *threads = find(options, kOptEngineThreads)) {
    if (!parse_uint(*threads, 64, value) || value == 0) {
      return refuse(LLM_PARAM_INVALID, "engine threads must be an integer in [1, 64], got '" + *threads + "'");
    }
    out.engine_threads = static_cast<uint32_t>(value);
  }
  if (const std::string *conns = find(options, kOptTcpConnections)) {
    if (!parse_uint(*conns, 64, value) || value == 0) {
      return refuse(LLM_PARAM_INVALID, "TCP connections per peer must be an integer in [1, 64], got '" + *conns + "'");
    }
    out.tcp_connections_per_peer = static_cast<uint32_t>(value);
  }
  if (const std::string *io = find(options, kOptIoThreads)) {
    if (!parse_uint(*io, 64, value) || value == 0) {
      return refuse(LLM_PARAM_INVALID, "I/O threads must be an integer in [1, 64], got '" + *io + "'");
    }
    out.io_threads = static_cast<uint32_t>(value);
  }
  if (const std::string *transport = find(options, kOptTransport)) {
    if (*transport != "auto" && *transport != "tcp" && *transport != "ucx") {
      return refuse(LLM_PARAM_INVALID, "llm.Transport must be auto, tcp or ucx, got '" + *transport + "'");
    }
    out.same_host = *transport == "auto";
    out.ucx = *transport == "ucx";
  }
  if (const std::string *key = find(options, kOptAuthKey)) {
    if (key->empty()) return LLM_PARAM_INVALID;
    out.auth_key = *key;
  } else if (const char *env = std::getenv(kAuthKeyEnv); env != nullptr && *env != '\0') {
    out.auth_key = env;
  }
  std::string encryption, access;
  Status st = either(options, kOptLinkEncryption, kLinkEncryptionEnv, "link encryption", "off", "tls", encryption);
  if (st != LLM_SUCCESS) return st;
  out.encrypt = encryption == "tls";
  st = either(options, kOptAccess, kAccessEnv, "access", "one_sided", "owner", access);
  if (st != LLM_SUCCESS) return st;
  out.one_sided = access == "one_sided";
  if (const std::string *flag = find(options, kOptAllowUnencryptedUcx)) {
    if (*flag != "0" && *flag != "1") {
      return refuse(LLM_PARAM_INVALID, "llm.AllowUnencryptedUcx must be 0 or 1, got '" + *flag + "'");
    }
    out.allow_unencrypted_ucx = *flag == "1";
  }
  for (auto [name, field] : {std::pair{kOptTlsCertFile, &out.tls_cert_file}, std::pair{kOptTlsKeyFile, &out.tls_key_file},
                              std::pair{kOptTlsCaFile, &out.tls_ca_file}}) {
    if (const std::string *file = find(options, name)) {
      if (file->empty()) return refuse(LLM_PARAM_INVALID, std::string(name) + " must name a file");
      *field = *file;
    }
  }
  if (const std::string *timeout = find(options, kOptHandshakeTimeout)) {
    if (!parse_uint(*timeout, 600000, value) || value == 0) {
      return refuse(LLM_PARAM_INVALID, "handshake timeout must be an integer in [1, 600000] ms, got '" + *timeout + "'");
    }
    out.handshake_timeout_ms = static_cast<uint32_t>(value);
  }
  if (const std::string *sweep = find(options, kOptAnswerSweepMs)) {
    if (!parse_uint(*sweep, 600000, value)) {
      return refuse(LLM_PARAM_INVALID, "answer sweep must be an integer in [0, 600000] ms, got '" + *sweep + "'");
    }
    out.answer_sweep_ms = static_cast<uint32_t>(value);
  }
  if (parse_listen(options, out.listen_ip, out.listen_port) != LLM_SUCCESS) return LLM_PARAM_INVALID;
  if (const std::string *total = find(options, kOptLinkTotalTime)) {
    if (!parse_uint(*total, UINT32_MAX, value)) return LLM_PARAM_INVALID;
    out.link_total_time_s = value == 0 ? kDefaultLinkTotalTimeS : static_cast<uint32_t>(value);
  }
  if (const std::string *retries = find(options, kOptLinkRetryCount)) {
    if (!parse_uint(*retries, 100, value) || value == 0) return LLM_PARAM_INVALID;
    out.link_retry_count = static_cast<uint32_t>(value);
  }
  if (const std::string *level = find(options, kOptRdmaServiceLevel)) {
    if (!parse_uint(*level, UINT32_MAX, value)) return LLM_PARAM_INVALID;
    out.rdma_service_level = static_cast<uint32_t>(value);
  }
  if (const std::string *traffic = find(options, kOptRdmaTrafficClass)) {
    if (!parse_uint(*traffic, UINT32_MAX, value)) return LLM_PARAM_INVALID;
    out.rdma_traffic_class = static_cast<uint32_t>(value);
  }
  if (const std::string *flag = find(options, kOptEnableSwitchRole)) out.enable_switch_role = *flag == "1";
  if (const std::string *rca = find(options, kOptRemoteCacheAccessible)) {
    if (*rca != "0" && *rca != "1") {
      return refuse(LLM_PARAM_INVALID, "remote cache accessible must be 0 or 1, got '" + *rca + "'");
    }
    out.remote_cache_accessible = *rca == "1";
  }
  return LLM_SUCCESS;
}

}  // namespace datadist
