// Engine options: the string map given to initialize(), parsed and checked
// once. Keys keep LLM-DataDist's spelling.
#ifndef DATADIST_OPTIONS_H_
#define DATADIST_OPTIONS_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "host_pool.h"
#include "llm_datadist/llm_error_codes.h"

namespace datadist {

using llm_datadist::Status;
using OptionMap = std::map<std::string, std::string>;

inline constexpr const char *kOptRole = "llm.Role";
inline constexpr const char *kOptDeviceId = "llm.DeviceId";
inline constexpr const char *kOptExecDeviceId = "ge.exec.deviceId";
inline constexpr const char *kOptHostMemPool = "llm.HostMemPoolConfig";
inline constexpr const char *kOptDeviceMemPool = "llm.MemPoolConfig";
inline constexpr const char *kOptSyncKvTimeout = "llm.SyncKvCacheWaitTime";
inline constexpr const char *kOptEngineThreads = "llm.EngineThreads";
inline constexpr const char *kOptRemoteCacheAccessible = "llm.EnableRemoteCacheAccessible";
inline constexpr const char *kOptListenIp = "llm.ListenIp";
inline constexpr const char *kOptListenPort = "llm.ListenPort";
inline constexpr const char *kOptTcpConnections = "llm.TcpConnectionsPerPeer";
// The transport's I/O threads, which serve every link's connections; default one per core.
inline constexpr const char *kOptIoThreads = "llm.IoThreads";
// "auto" (default): kernel copies with peers on this host where allowed; "tcp": sockets only.
inline constexpr const char *kOptTransport = "llm.Transport";
// A shared secret every link proves both ways (HMAC-SHA256); without the
// option, the environment variable DATADIST_AIO_AUTH_KEY; without either,
// links are not authenticated.
inline constexpr const char *kOptAuthKey = "llm.AuthKey";
inline constexpr const char *kAuthKeyEnv = "DATADIST_AIO_AUTH_KEY";
// "off" (default) or "tls": TLS 1.3 on every TCP connection of a link, keyed
// from the link secret (which it needs); without the option, the
// environment variable DATADIST_AIO_LINK_ENCRYPTION.
inline constexpr const char *kOptLinkEncryption = "llm.LinkEncryption";
inline constexpr const char *kLinkEncryptionEnv = "DATADIST_AIO_LINK_ENCRYPTION";
// "1": with link encryption, transport "ucx" may move bytes with UCX,
// which TLS cannot cover (unencrypted); "0" (default) refuses that.
inline constexpr const char *kOptAllowUnencryptedUcx = "llm.AllowUnencryptedUcx";
// PEM files: with link encryption, TLS authenticated by certificates (this
// end's chain and key, and the CA every peer's must verify against: all
// three, mutual) instead of keys from the link secret.
inline constexpr const char *kOptTlsCertFile = "llm.TlsCertFile";
inline constexpr const char *kOptTlsKeyFile = "llm.TlsKeyFile";
inline constexpr const char *kOptTlsCaFile = "llm.TlsCaFile";
// The time (ms) an accepted connection has to finish its handshake, and a
// link to bring all its connections; default 5000.
inline constexpr const char *kOptHandshakeTimeout = "llm.HandshakeTimeoutMs";
// How long (ms) answers of same-host links may wait unread, with no reader
// coming, before the transport's housekeeping reads them (answer_hub.h);
// 0: never (they settle when a waiter comes, or at their deadline).
inline constexpr const char *kOptAnswerSweepMs = "llm.AnswerSweepMs";
inline constexpr const char *kOptAccess = "llm.Access";
inline constexpr const char *kAccessEnv = "DATADIST_AIO_ACCESS";
inline constexpr const char *kOptLinkTotalTime = "llm.LinkTotalTime";
inline constexpr const char *kOptLinkRetryCount = "llm.LinkRetryCount";
inline constexpr const char *kOptRdmaServiceLevel = "llm.RdmaServiceLevel";
inline constexpr const char *kOptRdmaTrafficClass = "llm.RdmaTrafficClass";
inline constexpr const char *kOptEnableSwitchRole = "llm.EnableSwitchRole";

// Link time of a rank-table comm when llm.LinkTotalTime is absent or 0, as
// upstream's default connect timeout.
inline constexpr uint32_t kDefaultLinkTotalTimeS = 120;

struct EngineOptions {
  std::string role = "Prompt";
  // The CUDA device of DEVICE caches: llm.DeviceId, else the first of
  // ge.exec.deviceId (as LLMConfig.device_id writes it).
  int device_id = 0;
  std::optional<PoolConfig> host_pool;
  std::optional<PoolConfig> device_pool;
  uint32_t sync_kv_timeout_ms = 1000;
  uint32_t engine_threads = 2;
  bool remote_cache_accessible = false;
  std::optional<std::string> listen_ip;
  uint16_t listen_port = 0;
  uint32_t tcp_connections_per_peer = 2;
  uint32_t io_threads = 0;  // 0: one per core
  bool same_host = true;  // llm.Transport "auto"
  bool ucx = false;        // llm.Transport "ucx"
  std::string auth_key;   // llm.AuthKey, else $DATADIST_AIO_AUTH_KEY
  bool encrypt = false;   // llm.LinkEncryption "tls", else $DATADIST_AIO_LINK_ENCRYPTION
  bool allow_unencrypted_ucx = false;  // llm.AllowUnencryptedUcx
  bool one_sided = true;  // llm.Access "one_sided" (default) or "owner", else $DATADIST_AIO_ACCESS
  std::string tls_cert_file;  // llm.TlsCertFile
  std::string tls_key_file;   // llm.TlsKeyFile
  std::string tls_ca_file;    // llm.TlsCaFile
  uint32_t handshake_timeout_ms = 5000;
  uint32_t answer_sweep_ms = 100;
  // Rank-table comms: the time their links may take in all (s), and the
  // attempts it is shared among.
  uint32_t link_total_time_s = kDefaultLinkTotalTimeS;
  uint32_t link_retry_count = 1;
  // Accepted and recorded; the TCP transport has no use for them.
  std::optional<uint32_t> rdma_service_level;
  std::optional<uint32_t> rdma_traffic_class;
  bool enable_switch_role = false;
};

// Role names as options spell them: "Prompt" 1, "Decoder" 2, "Mix" 3; 0 if unknown.
uint32_t role_code(const std::string &role);

// Reads llm.ListenIp / llm.ListenPort when present.
Status parse_listen(const OptionMap &options, std::optional<std::string> &ip, uint16_t &port);

// LLM_PARAM_INVALID for a malformed value; unknown keys are ignored.
Status parse_options(const OptionMap &options, EngineOptions &out);

// Parses a pool config: a JSON object with "memory_size" (required, > 0)
// and "page_shift" (optional, in [10, 31), default 16).
Status parse_pool_config(const std::string &json, PoolConfig &out);

}  // namespace datadist

#endif  // DATADIST_OPTIONS_H_
