// The UCX data path of a link (LLMConfig.transport "ucx"): the owner moves
// an operation's bytes with UCX's one-sided operations, reading the
// initiator's memory for a write (get) and writing into it for a read (put,
// then a flush), after checking its own ranges as on every path. The
// initiator names its own memory only: each frame carries, beside its
// segments, the packed remote key of every mapped tensor they lie in.
// Without RDMA, host-to-host ranges move as the plugin's active messages
// (ucx_plugin.h). A failed link's reap closes its Peer and waits until
// every get and put on it has ended.
//
// One worker per transport, progressed by the transport's I/O loop: its
// event fd is watched there like a socket, and the thread the loop wakes
// progresses it, then arms it again. No thread of its own, no busy polling.
// Completions run on that thread (or on the one that posted, when UCX
// finishes an operation at once).
//
// Threads: every call may come from any thread.
#ifndef DATADIST_TRANSPORT_PATHS_UCX_UCX_PATH_H_
#define DATADIST_TRANSPORT_PATHS_UCX_UCX_PATH_H_

#include <sys/uio.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "device/cuda_driver.h"
#include "registry.h"
#include "transport/io_loop.h"
#include "transport/paths/ucx/ucx_loader.h"
#include "transport/wire.h"

namespace datadist::ucx {

class Worker : public IoHandler, public std::enable_shared_from_this<Worker> {
 public:
  // Loads the plugin, makes the worker and has `loop` watch its event fd;
  // null with `why` (UCX missing, or UCX refused) otherwise.
  static std::shared_ptr<Worker> create(IoLoop &loop, std::string &why);
  ~Worker() override;
  Worker(const Worker &) = delete;
  Worker &operator=(const Worker &) = delete;

  const datadist_ucx_plugin_v1 &api() const { return *plugin_->api; }
  datadist_ucx_worker *handle() const { return worker_; }
  // The worker's address, for the peer's endpoint (sent in the handshake).
  const std::string &address() const { return address_; }
  std::string describe(int status) const { return plugin_->describe(status); }
  const std::string &version() const { return plugin_->version; }
  // Whether this UCX has a one-sided network transport (RDMA) here.
  bool one_sided_network() const { return one_sided_network_; }
  // Whether this UCX moves CUDA device memory: built with CUDA, NVIDIA's
  // driver found, and a one-sided network transport here (ucx_path.cpp).
  bool reaches_device() const { return reaches_device_; }
  // The device whose context the progressing thread makes current (the
  // first one mapped; UCX's CUDA transports copy on that thread).
  void use_device(const std::shared_ptr<cuda::Device> &device);

  // Progresses until nothing is due, then arms the event fd again.
  void on_ready(uint64_t tag, uint32_t events) override;
  // Progresses once from the calling thread (after posting operations).
  void poke();
  // Stops watching the event fd; the worker itself goes with the last owner.
  void stop();

 private:
  Worker() = default;
  const Plugin *plugin_ = nullptr;
  datadist_ucx_worker *worker_ = nullptr;
  std::string address_;
  bool one_sided_network_ = false;  // asked of UCX once, at create
  bool reaches_device_ = false;
  std::mutex device_mu_;
  std::shared_ptr<cuda::Device> device_;  // under device_mu_
  IoLoop *loop_ = nullptr;
  uint64_t io_id_ = 0;
  std::mutex stop_mu_;
};

// A range of this process's memory mapped for peers, and its packed key.
class Mapping {
 public:
  Mapping(std::shared_ptr<Worker> worker, datadist_ucx_mem *mem, uint64_t base, uint64_t length, std::string rkey)
      : worker_(std::move(worker)), mem_(mem), base_(base), length_(length), rkey_(std::move(rkey)) {}
  ~Mapping();
  Mapping(const Mapping &) = delete;
  Mapping &operator=(const Mapping &) = delete;
  uint64_t base() const { return base_; }
  uint64_t length() const { return length_; }
  // Whether [addr, addr + length) lies inside the mapped range.
  bool holds(uintptr_t addr, size_t length) const {
    return addr >= base_ && addr - base_ <= length_ && length <= length_ - (addr - base_);
  }
  const std::string &rkey() const { return rkey_; }
  const Worker *worker() const { return worker_.get(); }
  datadist_ucx_mem *mem() const { return mem_; }

 private:
  std::shared_ptr<Worker> worker_;  // outlives the mapping
  datadist_ucx_mem *mem_;
  uint64_t base_;
  uint64_t length_;
  std::string rkey_;
};

// Tensor `t` of `entry` mapped with `worker`, made on its first use and
// kept in the entry until the cache goes (its memory is unmapped before it
// goes); null with `why` when it cannot be mapped.
std::shared_ptr<Mapping> tensor_mapping(const std::shared_ptr<Worker> &worker, CacheEntry &entry, size_t t,
                                        std::string &why);

// The keys a frame's local memory needs: for each iovec, the tensor of a
// registered cache that holds it, mapped with `worker` on its first use
// (attached to the cache, which keeps the mapping until it goes). False with
// `why` when some memory is not inside one registered tensor, or is device
// memory that this UCX does not reach.
bool keys_for(const std::shared_ptr<Worker> &worker, Registry &registry, const std::vector<iovec> &local,
              std::vector<std::shared_ptr<Mapping>> &out, std::string &why);

// The owner's side: the mapping of each of `ranges` (ranges of `entry`,
// already checked), for UCX to move them with no lookup of its own; `held`
// keeps the mappings. False with `why` when one cannot be mapped.
bool local_maps(const std::shared_ptr<Worker> &worker, CacheEntry &entry, const std::vector<iovec> &ranges,
                std::vector<std::shared_ptr<Mapping>> &held, std::vector<datadist_ucx_mem *> &mems,
                std::string &why);

// A link's endpoint to its peer's worker, with the peer's keys unpacked
// as they come (cached by their bytes).
class Peer {
 public:
  // Null with `why` when UCX refuses the peer's address.
  static std::shared_ptr<Peer> connect(const std::shared_ptr<Worker> &worker, const std::string &address,
                                       std::string &why);
  // An endpoint for one-sided moves under the peer's grants (the plugin's
  // ep_create_direct): no error callback, never force-closed. Null with
  // `why` when UCX refuses the address.
  static std::shared_ptr<Peer> connect_direct(const std::shared_ptr<Worker> &worker, const std::string &address,
                                              std::string &why);
  // How this endpoint's gets and puts reach the peer (DATADIST_UCX_RMA_*).
  int rma();
  ~Peer();
  Peer(const Peer &) = delete;
  Peer &operator=(const Peer &) = delete;

  // Runs `fn` (once, from the worker's progress) when UCX finds the peer
  // failed; set once the link exists.
  void on_error(std::function<void(const std::string &)> fn);
  const std::shared_ptr<Worker> &worker() const { return worker_; }

  // The ranges, each inside the region the key `packed` covers, moved with
  // one get (from the peer into this process) or put; `done(status, why)`
  // runs once (status 0: done; for put, done at the peer). False with `why`
  // when nothing was posted (done then never runs).
  using Done = std::function<void(int status, const std::string &why)>;
  bool get(const std::string &packed, const std::vector<datadist_ucx_range> &ranges, Done done, std::string &why);
  bool put(const std::string &packed, const std::vector<datadist_ucx_range> &ranges, Done done, std::string &why);
  // `done` once every operation posted so far completed at the peer.
  bool flush(Done done, std::string &why);

  // Closes the endpoint at once (UCX's forced close): what is posted on it
  // fails (its `done` runs with an error, from the worker's progress), no
  // byte of it lands afterwards, and nothing more is posted. Once is enough.
  void close();
  // Progresses the worker from the calling thread until every `done` of this
  // peer has run; false when some had not by `limit`.
  bool wait_idle(std::chrono::milliseconds limit);

 private:
  explicit Peer(std::shared_ptr<Worker> worker) : worker_(std::move(worker)) {}
  bool direct_ = false;  // made by connect_direct: closed without force
  datadist_ucx_rkey *rkey_locked(const std::string &packed, std::string &why);
  bool post(bool get, const std::string &packed, const std::vector<datadist_ucx_range> &ranges, Done done,
            std::string &why);

  // The operations posted whose `done` has not run yet.
  struct InFlight {
    std::mutex mu;
    std::condition_variable cv;
    size_t count = 0;
  };

  struct ErrorState {
    std::mutex mu;
    std::function<void(const std::string &)> fn;
    std::string why;  // set when the error came before fn
    bool failed = false;
  };

  std::shared_ptr<Worker> worker_;
  std::mutex mu_;
  datadist_ucx_ep *ep_ = nullptr;  // null once closed
  std::map<std::string, datadist_ucx_rkey *> rkeys_;
  std::shared_ptr<InFlight> in_flight_ = std::make_shared<InFlight>();
  std::shared_ptr<ErrorState> error_ = std::make_shared<ErrorState>();
  std::shared_ptr<ErrorState> *error_arg_ = nullptr;  // what the plugin calls back with
};

// The UCX path's trailer of a frame by reference (wire::kPathTrailer): a
// uint32 count and a uint32 zero, then `count` keys, each a Key and its
// `key_length` packed bytes, padded with zeros to a multiple of 8. A key
// covers [base, base + length) of the initiator's memory; every segment
// must lie inside one of them.
#pragma pack(push, 1)
struct Key {
  uint64_t base;
  uint64_t length;
  uint32_t key_length;
  uint32_t zero;
};
static_assert(sizeof(Key) == 24, "ucx key layout");
#pragma pack(pop)
constexpr uint32_t kMaxKeys = 256;
constexpr uint32_t kMaxKeyBytes = 4096;
// Appends the key table of `keys` to `body`.
void encode_keys(const std::vector<std::shared_ptr<Mapping>> &keys, std::vector<uint8_t> &body);
// The bytes encode_keys() appends.
size_t key_table_bytes(const std::vector<std::shared_ptr<Mapping>> &keys);
// A key table read: the keys, their packed bytes, and for each segment the
// index of the key it lies in.
struct KeyTable {
  std::vector<Key> keys;
  std::vector<std::string> packed;
  std::vector<uint32_t> segment_key;
};
// Reads the key table `trailer` for `segments`; empty string on success,
// else why it is malformed.
std::string decode_keys(const std::vector<uint8_t> &trailer, const std::vector<wire::Segment> &segments,
                        KeyTable &out);

}  // namespace datadist::ucx

#endif  // DATADIST_TRANSPORT_PATHS_UCX_UCX_PATH_H_
