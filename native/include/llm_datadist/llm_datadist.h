// llm_datadist: the C++ API of datadist_aio, over the same engine as the
// Python package. Names, members and status codes follow LLM-DataDist.
//
// Threads: an LlmDataDist may be used from any thread, except that
// Finalize() must not run concurrently with another call on the same
// object. Every call blocks until its work is done (or has failed).
// Includes only the standard library.
#ifndef LLM_DATADIST_LLM_DATADIST_H_
#define LLM_DATADIST_LLM_DATADIST_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "llm_datadist/llm_error_codes.h"

namespace llm_datadist {

// A string type with the upstream name; converts to and from std::string.
class AscendString {
 public:
  AscendString() = default;
  AscendString(const char *s) : s_(s == nullptr ? "" : s) {}  // NOLINT: implicit, as upstream
  AscendString(std::string s) : s_(std::move(s)) {}           // NOLINT
  const char *GetString() const { return s_.c_str(); }
  size_t GetLength() const { return s_.size(); }
  const std::string &str() const { return s_; }
  bool operator<(const AscendString &o) const { return s_ < o.s_; }
  bool operator==(const AscendString &o) const { return s_ == o.s_; }
  bool operator!=(const AscendString &o) const { return s_ != o.s_; }

 private:
  std::string s_;
};

// Option keys for Initialize() and SetRole().
constexpr const char OPTION_LISTEN_IP_INFO[] = "llm.ListenIpInfo";       // "ip:port"; port 0 picks one
constexpr const char OPTION_DEVICE_ID[] = "llm.DeviceId";                // the CUDA device of DEVICE caches
constexpr const char OPTION_SYNC_CACHE_WAIT_TIME[] = "llm.SyncKvCacheWaitTime";  // ms, default 1000
constexpr const char OPTION_BUF_POOL_CFG[] = "llm.BufPoolCfg";
constexpr const char OPTION_ENABLE_SET_ROLE[] = "llm.EnableSwitchRole";
constexpr const char OPTION_LOCAL_COMM_RES[] = "llm.LocalCommRes";
// Options of this implementation.
constexpr const char OPTION_HOST_MEM_POOL_CFG[] = "llm.HostMemPoolConfig";  // {"memory_size": N} for AllocateCache
constexpr const char OPTION_TCP_CONNECTIONS_PER_PEER[] = "llm.TcpConnectionsPerPeer";
// "auto" (default): peers on the same host move bytes by kernel copy where
// the kernel allows it; "tcp": sockets only.
constexpr const char OPTION_TRANSPORT[] = "llm.Transport";
// A shared secret every link proves in both directions (HMAC-SHA256 over the
// handshake; the secret never crosses the wire). Without it, the environment
// variable DATADIST_AIO_AUTH_KEY; without either, links are unauthenticated.
constexpr const char OPTION_AUTH_KEY[] = "llm.AuthKey";
// Not upstream: "off" (default) or "tls": TLS 1.3 on every TCP connection of
// a link, keyed from OPTION_AUTH_KEY (required then); linked peers must agree.
constexpr const char OPTION_LINK_ENCRYPTION[] = "llm.LinkEncryption";
// Not upstream: "one_sided" (default) or "owner". One-sided: on one host, an
// engine grants each peer that reaches its memory its remotely accessible
// host caches once, and that peer moves the bytes of its operations on them
// itself (kernel copies checked against the grant), with no frame to the
// owner; "owner": the owner of the memory moves every byte. Without it, the
// environment variable DATADIST_AIO_ACCESS; without either, "one_sided".
constexpr const char OPTION_ACCESS[] = "llm.Access";
// Not upstream: "1" lets transport "ucx" move bytes unencrypted while links are encrypted.
constexpr const char OPTION_ALLOW_UNENCRYPTED_UCX[] = "llm.AllowUnencryptedUcx";
// Not upstream: PEM files for link encryption authenticated by certificates
// instead of the link secret: this end's certificate chain and private key,
// and the CA bundle every peer's chain must verify against (all three).
constexpr const char OPTION_TLS_CERT_FILE[] = "llm.TlsCertFile";
constexpr const char OPTION_TLS_KEY_FILE[] = "llm.TlsKeyFile";
constexpr const char OPTION_TLS_CA_FILE[] = "llm.TlsCaFile";
// Ms answers of same-host links may wait with nobody reading before the
// engine's housekeeping reads them (default 100; 0: never). Every call of
// this class waits in a way that reads its own answers, so none depends on it.
constexpr const char OPTION_ANSWER_SWEEP_MS[] = "llm.AnswerSweepMs";

constexpr uint32_t kDefaultTensorNumPerLayer = 2;
constexpr uint32_t kMaxRegisterAddrs = 240;

enum DataType : int32_t {
  DT_FLOAT = 0,
  DT_FLOAT16 = 1,
  DT_INT8 = 2,
  DT_INT32 = 3,
  DT_UINT8 = 4,
  DT_INT16 = 6,
  DT_UINT16 = 7,
  DT_UINT32 = 8,
  DT_INT64 = 9,
  DT_UINT64 = 10,
  DT_DOUBLE = 11,
  DT_BOOL = 12,
  DT_STRING = 13,
  DT_BF16 = 27,
  DT_UNDEFINED = 28,
};

enum class LlmRole : int32_t { kPrompt = 1, kDecoder = 2, kMix = 3, kEnd };

enum class CachePlacement : uint32_t { kHost = 0, kDevice = 1 };

struct IpInfo {
  AscendString ip;
  uint16_t port = 0;
  uint8_t reserved[128] = {0};
};

struct ClusterInfo {
  uint64_t remote_cluster_id = 0;
  int32_t remote_role_type = 0;
  std::vector<IpInfo> local_ip_infos;
  std::vector<IpInfo> remote_ip_infos;
  uint8_t reserved[128] = {0};
};

// A cache of a peer: its id there and a batch slot.
struct CacheIndex {
  uint64_t cluster_id;
  int64_t cache_id;
  uint32_t batch_index;
  uint8_t reserved[128];
};

struct CacheDesc {
  CachePlacement placement = CachePlacement::kDevice;
  uint32_t num_tensors = 0;
  DataType data_type = DT_UNDEFINED;
  std::vector<int64_t> shape;
  uint8_t reserved[128] = {0};
};

struct Cache {
  int64_t cache_id = -1;
  std::vector<uintptr_t> tensor_addrs;
  CacheDesc cache_desc;
  uint8_t reserved[128] = {0};
};

// Layer ranges are closed, (first, second); (-1, -1) means every layer.
// Layer i is tensors [i * tensor_num_per_layer, (i + 1) * tensor_num_per_layer).
struct KvCacheExtParam {
  std::pair<int32_t, int32_t> src_layer_range = {-1, -1};
  std::pair<int32_t, int32_t> dst_layer_range = {-1, -1};
  uint8_t tensor_num_per_layer = kDefaultTensorNumPerLayer;
  uint8_t reserved[127] = {0};
};

struct RegisterCfg {
  uint8_t reserved[128] = {0};
};

class LlmDataDist {
 public:
  LlmDataDist(uint64_t cluster_id, LlmRole role);
  ~LlmDataDist();
  LlmDataDist(const LlmDataDist &) = delete;
  LlmDataDist &operator=(const LlmDataDist &) = delete;

  // Every method but these returns LLM_FAILED before Initialize succeeded.
  Status Initialize(const std::map<AscendString, AscendString> &options);
  void Finalize();

  Status SetRole(LlmRole role, const std::map<AscendString, AscendString> &options = {});
  Status LinkLlmClusters(const std::vector<ClusterInfo> &clusters, std::vector<Status> &rets,
                         int32_t timeout_in_millis = 1000);
  Status UnlinkLlmClusters(const std::vector<ClusterInfo> &clusters, std::vector<Status> &rets,
                           int32_t timeout_in_millis = 1000, bool force_flag = false);
  // Not upstream: how transfers started here toward a linked cluster move
  // their bytes, "same_host" or "tcp" (see OPTION_TRANSPORT);
  // LLM_NOT_YET_LINK without a link.
  Status GetLinkTransport(uint64_t remote_cluster_id, std::string &transport) const;
  // The same, with how the link is protected (OPTION_LINK_ENCRYPTION).
  struct LinkTransportInfo {
    std::string transport;
    bool encrypted = false;  // its TCP connections carry TLS 1.3
    std::string cipher;      // e.g. "TLS_AES_128_GCM_SHA256"; empty unencrypted
    bool kernel_tls = false;  // the kernel carries the records (kTLS)
  };
  Status GetLinkTransport(uint64_t remote_cluster_id, LinkTransportInfo &info) const;

  // Registers caller memory as a cache usable both by batch slot and by
  // block (dimension 0 of the shape); peers may read and write it.
  Status RegisterKvCache(const CacheDesc &cache_desc, const std::vector<uint64_t> &addrs, const RegisterCfg &cfg,
                         int64_t &cache_id);
  // Returns once no peer's operation can touch the cache's memory (an
  // operation in flight is waited for; one that outlasts 2 s has its link
  // cut), so the caller may free it then.
  Status UnregisterKvCache(int64_t cache_id);
  // Allocates from the host pool (OPTION_HOST_MEM_POOL_CFG) for kHost, in
  // CUDA device memory of OPTION_DEVICE_ID for kDevice.
  Status AllocateCache(const CacheDesc &cache_desc, Cache &cache);
  Status DeallocateCache(int64_t cache_id);

  Status PullKvCache(const CacheIndex &src_cache_index, const Cache &dst_cache, uint32_t batch_index = 0,
                     int64_t size = -1, const KvCacheExtParam &ext_param = {});
  Status PullKvBlocks(const CacheIndex &src_cache_index, const Cache &dst_cache,
                      const std::vector<uint64_t> &src_blocks, const std::vector<uint64_t> &dst_blocks,
                      const KvCacheExtParam &ext_param = {});
  Status PushKvCache(const Cache &src_cache, const CacheIndex &dst_cache_index, uint32_t src_batch_index = 0,
                     int64_t size = -1, const KvCacheExtParam &ext_param = {});
  Status PushKvBlocks(const Cache &src_cache, const CacheIndex &dst_cache_index,
                      const std::vector<uint64_t> &src_blocks, const std::vector<uint64_t> &dst_blocks,
                      const KvCacheExtParam &ext_param = {});

  // Local copies between two caches of this instance: bytes
  // [offset, offset + size) of a batch slot (size -1: to the end of the
  // slot), or each source block to every block listed for it.
  Status CopyKvCache(const Cache &src_cache, const Cache &dst_cache, uint32_t src_batch_index = 0,
                     uint32_t dst_batch_index = 0, uint64_t offset = 0, int64_t size = -1);
  Status CopyKvBlocks(const Cache &src_cache, const Cache &dst_cache, const std::vector<uint64_t> &src_blocks,
                      const std::vector<std::vector<uint64_t>> &dst_blocks_list);

  // Not in upstream's API. Why the last call made on this thread (to any
  // LlmDataDist) failed, in words: which argument, index or size, or the
  // peer's reason; empty after a success or where no reason is known.
  std::string GetLastErrorMessage() const;
  // Not in upstream's API. How many answers of same-host links each kind of
  // reader has read: "drain" (an event loop of the Python API), "look" (a
  // caller asking for its request), "thread" (the engine's answer thread on
  // behalf of a blocking call), "sweep" (OPTION_ANSWER_SWEEP_MS), "link" (a
  // link going down or past its deadline). Empty before Initialize().
  std::map<std::string, uint64_t> GetAnswerCounts() const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace llm_datadist

#endif  // LLM_DATADIST_LLM_DATADIST_H_
