#include "transport/paths/ucx/ucx_path.h"

#include <sys/epoll.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "log.h"

namespace datadist::ucx {

std::shared_ptr<Worker> Worker::create(IoLoop &loop, std::string &why) {
  const Plugin *plugin = load_plugin(why);
  if (plugin == nullptr) return nullptr;
  std::shared_ptr<Worker> w(new Worker());
  w->plugin_ = plugin;
  int st = w->api().worker_create(&w->worker_);
  if (st != DATADIST_UCX_OK) {
    why = "UCX refused a worker: " + plugin->describe(st);
    w->worker_ = nullptr;
    return nullptr;
  }
  const void *address = nullptr;
  size_t length = 0;
  int fd = -1;
  st = w->api().worker_address(w->worker_, &address, &length);
  if (st == DATADIST_UCX_OK && length > wire::kMaxPathPartBytes) {
    why = "the UCX worker's address is " + std::to_string(length) + " bytes, past the handshake's " +
          std::to_string(wire::kMaxPathPartBytes);
    return nullptr;
  }
  if (st == DATADIST_UCX_OK) st = w->api().event_fd(w->worker_, &fd);
  if (st != DATADIST_UCX_OK) {
    why = "UCX worker: " + plugin->describe(st);
    return nullptr;
  }
  w->address_.assign(static_cast<const char *>(address), length);
  // Device memory goes by UCX only where a one-sided network transport
  // (RDMA) moves it. Over UCX's tcp, UCX emulates a get or put of device
  // memory through host memory with its own software RMA, which aborts the
  // survivor when the peer dies mid-operation (the fault that active
  // messages took host memory away from); there device memory goes the
  // link's own ways (CUDA IPC on one host under "auto", else staged).
  w->one_sided_network_ = w->api().one_sided_network(w->worker_) != 0;
  w->reaches_device_ = w->api().reaches_cuda(w->worker_) != 0 && w->one_sided_network_;
  w->loop_ = &loop;
  w->io_id_ = loop.add(fd, w, 0);
  if (w->io_id_ == 0) {
    why = "the I/O loop refused the UCX worker's event fd";
    return nullptr;
  }
  // Whatever came before the first wait is progressed by the first wake.
  w->on_ready(0, 0);
  return w;
}

Worker::~Worker() {
  stop();
  if (worker_ != nullptr) api().worker_destroy(worker_);
}

void Worker::stop() {
  uint64_t id;
  {
    std::lock_guard<std::mutex> lock(stop_mu_);
    id = io_id_;
    io_id_ = 0;  // a handler running now arms nothing more
  }
  // Outside the lock: remove() waits for a running handler, which takes it.
  if (id != 0) loop_->remove(id);
}

void Worker::use_device(const std::shared_ptr<cuda::Device> &device) {
  std::lock_guard<std::mutex> lock(device_mu_);
  if (!device_) device_ = device;
}

void Worker::on_ready(uint64_t, uint32_t) {
  std::shared_ptr<cuda::Device> device;
  {
    std::lock_guard<std::mutex> lock(device_mu_);
    device = device_;
  }
  std::string why;
  if (device && !device->make_current(why)) log_warning("UCX: progress without the device's context: " + why);
  for (;;) {
    while (api().progress(worker_) != 0) {
    }
    if (api().arm(worker_) != DATADIST_UCX_BUSY) break;
  }
  std::lock_guard<std::mutex> lock(stop_mu_);
  if (io_id_ != 0 && !loop_->arm(io_id_, EPOLLIN)) {
    log_warning("UCX: the I/O loop no longer watches the worker's event fd");
  }
}

void Worker::poke() { api().progress(worker_); }

Mapping::~Mapping() {
  const int st = worker_->api().mem_unmap(mem_);
  if (st != DATADIST_UCX_OK) log_warning("UCX: unmapping a cache's memory: " + worker_->describe(st));
}

namespace {

// A cache's tensors mapped for UCX peers, each on its first use; attached
// to the cache (CacheEntry::attachment), so unmapped before its memory goes.
struct TensorMaps : CacheAttachment {
  std::mutex mu;
  std::vector<std::shared_ptr<Mapping>> maps;
};

// The tag of UCX's attachment.
constexpr char kTensorMapsTag = 0;

}  // namespace

// Device memory is mapped with its context current on the calling thread,
// where the worker's UCX reaches it.
std::shared_ptr<Mapping> tensor_mapping(const std::shared_ptr<Worker> &worker, CacheEntry &entry, size_t t,
                                        std::string &why) {
  if (entry.device && !worker->reaches_device()) {
    why = "cache " + std::to_string(entry.id) + " is device memory, which this end's UCX does not reach";
    return nullptr;
  }
  const auto attached = entry.attachment<TensorMaps>(&kTensorMapsTag, [] { return std::make_shared<TensorMaps>(); });
  std::lock_guard<std::mutex> lock(attached->mu);
  auto &slots = attached->maps;
  if (slots.size() != entry.addrs.size()) slots.resize(entry.addrs.size());
  if (slots[t] && slots[t]->worker() == worker.get()) return slots[t];
  if (entry.device) {
    if (!entry.device->make_current(why)) return nullptr;
    worker->use_device(entry.device);
  }
  const uint64_t size = entry.geometry.tensor_size;
  datadist_ucx_mem *mem = nullptr;
  const void *rkey = nullptr;
  size_t rkey_length = 0;
  const int st = worker->api().mem_map(worker->handle(), entry.addrs[t], static_cast<size_t>(size),
                                       entry.device ? DATADIST_UCX_CUDA : DATADIST_UCX_HOST, &mem, &rkey,
                                       &rkey_length);
  if (st != DATADIST_UCX_OK) {
    why = "UCX could not map a tensor of cache " + std::to_string(entry.id) + ": " + worker->describe(st);
    return nullptr;
  }
  if (rkey_length == 0 || rkey_length > kMaxKeyBytes) {
    worker->api().mem_unmap(mem);
    why = "UCX's key for a tensor is " + std::to_string(rkey_length) + " bytes";
    return nullptr;
  }
  slots[t] = std::make_shared<Mapping>(worker, mem, reinterpret_cast<uintptr_t>(entry.addrs[t]), size,
                                       std::string(static_cast<const char *>(rkey), rkey_length));
  return slots[t];
}

bool keys_for(const std::shared_ptr<Worker> &worker, Registry &registry, const std::vector<iovec> &local,
              std::vector<std::shared_ptr<Mapping>> &out, std::string &why) {
  out.clear();
  for (const iovec &v : local) {
    const auto addr = reinterpret_cast<uintptr_t>(v.iov_base);
    bool known = false;
    for (const auto &m : out) known = known || m->holds(addr, v.iov_len);
    if (known) continue;
    size_t t = 0;
    std::shared_ptr<CacheEntry> entry = registry.find_by_address(addr, v.iov_len, &t);
    if (!entry) {
      why = "memory at " + std::to_string(addr) + " is not inside one tensor of a registered cache";
      return false;
    }
    std::shared_ptr<Mapping> mapping = tensor_mapping(worker, *entry, t, why);
    if (!mapping) return false;
    if (out.size() == kMaxKeys) {
      why = "a frame over more than " + std::to_string(kMaxKeys) + " tensors";
      return false;
    }
    out.push_back(std::move(mapping));
  }
  return true;
}

bool local_maps(const std::shared_ptr<Worker> &worker, CacheEntry &entry, const std::vector<iovec> &ranges,
                std::vector<std::shared_ptr<Mapping>> &held, std::vector<datadist_ucx_mem *> &mems,
                std::string &why) {
  held.clear();
  mems.assign(ranges.size(), nullptr);
  size_t t = 0;  // ranges mostly follow the tensors in order: the last one is tried first
  for (size_t i = 0; i < ranges.size(); ++i) {
    t = entry.tensor_holding(reinterpret_cast<uintptr_t>(ranges[i].iov_base), ranges[i].iov_len, t);
    if (t == entry.addrs.size()) {
      why = "a range of cache " + std::to_string(entry.id) + " is not inside one of its tensors";
      return false;
    }
    if (held.empty() || held.back()->base() != reinterpret_cast<uintptr_t>(entry.addrs[t])) {
      std::shared_ptr<Mapping> mapping = tensor_mapping(worker, entry, t, why);
      if (!mapping) return false;
      held.push_back(std::move(mapping));
    }
    mems[i] = held.back()->mem();
  }
  return true;
}

std::shared_ptr<Peer> Peer::connect(const std::shared_ptr<Worker> &worker, const std::string &address,
                                    std::string &why) {
  std::shared_ptr<Peer> peer(new Peer(worker));
  // The plugin calls back (once, never after the close) with this pointer.
  peer->error_arg_ = new std::shared_ptr<ErrorState>(peer->error_);
  auto fail = [](void *arg, int status) {
    auto *state = static_cast<std::shared_ptr<ErrorState> *>(arg);
    std::function<void(const std::string &)> fn;
    std::string words = "UCX found the peer failed: status " + std::to_string(status);
    {
      std::lock_guard<std::mutex> lock((*state)->mu);
      (*state)->failed = true;
      (*state)->why = words;
      fn = (*state)->fn;
    }
    if (fn) fn(words);
  };
  const int st = worker->api().ep_create(worker->handle(), address.data(), address.size(), fail, peer->error_arg_,
                                         &peer->ep_);
  if (st != DATADIST_UCX_OK) {
    why = "UCX refused the peer's worker address: " + worker->describe(st);
    delete peer->error_arg_;
    peer->error_arg_ = nullptr;
    peer->ep_ = nullptr;
    return nullptr;
  }
  return peer;
}

std::shared_ptr<Peer> Peer::connect_direct(const std::shared_ptr<Worker> &worker, const std::string &address,
                                           std::string &why) {
  std::shared_ptr<Peer> peer(new Peer(worker));
  peer->direct_ = true;
  const int st = worker->api().ep_create_direct(worker->handle(), address.data(), address.size(), &peer->ep_);
  if (st != DATADIST_UCX_OK) {
    why = "UCX refused the peer's worker address: " + worker->describe(st);
    peer->ep_ = nullptr;
    return nullptr;
  }
  return peer;
}

int Peer::rma() {
  std::lock_guard<std::mutex> lock(mu_);
  return ep_ != nullptr ? worker_->api().ep_rma(ep_) : DATADIST_UCX_RMA_NONE;
}

Peer::~Peer() {
  close();
  // No callback after the close: the error state may go.
  delete error_arg_;
}

void Peer::close() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (ep_ == nullptr) return;
    for (auto &entry : rkeys_) worker_->api().rkey_destroy(entry.second);
    rkeys_.clear();
    // Wakes the worker: its thread runs the failed operations' done. A
    // direct endpoint's close is not forced: it flushes what is posted.
    worker_->api().ep_close(ep_, direct_ ? 0 : 1);
    ep_ = nullptr;
  }
}

bool Peer::wait_idle(std::chrono::milliseconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  for (;;) {
    worker_->poke();
    std::unique_lock<std::mutex> lock(in_flight_->mu);
    if (in_flight_->count == 0) return true;
    if (std::chrono::steady_clock::now() >= deadline) return false;
    in_flight_->cv.wait_for(lock, std::chrono::milliseconds(1));
  }
}

void Peer::on_error(std::function<void(const std::string &)> fn) {
  std::string already;
  {
    std::lock_guard<std::mutex> lock(error_->mu);
    error_->fn = fn;
    if (error_->failed) already = error_->why;
  }
  if (!already.empty()) fn(already);
}

datadist_ucx_rkey *Peer::rkey_locked(const std::string &packed, std::string &why) {
  auto it = rkeys_.find(packed);
  if (it != rkeys_.end()) return it->second;
  datadist_ucx_rkey *rkey = nullptr;
  const int st = worker_->api().rkey_unpack(ep_, packed.data(), packed.size(), &rkey);
  if (st != DATADIST_UCX_OK) {
    why = "UCX refused the peer's memory key: " + worker_->describe(st);
    return nullptr;
  }
  // Keys of tensors unmapped since are not told apart: bounded, the oldest dropped.
  if (rkeys_.size() >= 1024) {
    worker_->api().rkey_destroy(rkeys_.begin()->second);
    rkeys_.erase(rkeys_.begin());
  }
  rkeys_.emplace(packed, rkey);
  return rkey;
}

namespace {

struct Pending {
  Peer::Done done;
  std::function<void()> settled;  // after done: the peer's count of operations in flight
};

void finished(void *arg, int status) {
  std::unique_ptr<Pending> pending(static_cast<Pending *>(arg));
  pending->done(status, {});
  pending->settled();
}

// The `settled` of an operation counted in `in_flight`, counted now.
template <typename InFlight>
std::function<void()> count_in(const std::shared_ptr<InFlight> &in_flight) {
  {
    std::lock_guard<std::mutex> lock(in_flight->mu);
    ++in_flight->count;
  }
  return [in_flight] {
    std::lock_guard<std::mutex> lock(in_flight->mu);
    if (--in_flight->count == 0) in_flight->cv.notify_all();
  };
}

}  // namespace

bool Peer::post(bool get, const std::string &packed, const std::vector<datadist_ucx_range> &ranges, Done done,
                std::string &why) {
  auto *pending = new Pending{std::move(done), count_in(in_flight_)};
  int st;
  {
    std::lock_guard<std::mutex> lock(mu_);
    datadist_ucx_rkey *rkey = ep_ != nullptr ? rkey_locked(packed, why) : nullptr;
    if (ep_ == nullptr) why = "the link's UCX endpoint is closed";
    if (rkey == nullptr) {
      pending->settled();
      delete pending;
      return false;
    }
    st = get ? worker_->api().get(ep_, rkey, ranges.data(), ranges.size(), finished, pending)
             : worker_->api().put(ep_, rkey, ranges.data(), ranges.size(), finished, pending);
  }
  if (st != DATADIST_UCX_OK) {
    pending->settled();
    delete pending;
    why = std::string("UCX refused a ") + (get ? "get" : "put") + ": " + worker_->describe(st);
    return false;
  }
  worker_->poke();
  return true;
}

bool Peer::get(const std::string &packed, const std::vector<datadist_ucx_range> &ranges, Done done,
               std::string &why) {
  return post(true, packed, ranges, std::move(done), why);
}

bool Peer::put(const std::string &packed, const std::vector<datadist_ucx_range> &ranges, Done done,
               std::string &why) {
  return post(false, packed, ranges, std::move(done), why);
}

bool Peer::flush(Done done, std::string &why) {
  auto *pending = new Pending{std::move(done), count_in(in_flight_)};
  int st = DATADIST_UCX_OK;
  bool closed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    closed = ep_ == nullptr;
    if (!closed) st = worker_->api().ep_flush(ep_, finished, pending);
  }
  if (closed || st != DATADIST_UCX_OK) {
    pending->settled();
    delete pending;
    why = closed ? "the link's UCX endpoint is closed" : "UCX refused a flush: " + worker_->describe(st);
    return false;
  }
  worker_->poke();
  return true;
}

size_t key_table_bytes(const std::vector<std::shared_ptr<Mapping>> &keys) {
  size_t bytes = 2 * sizeof(uint32_t);
  for (const auto &k : keys) bytes += sizeof(Key) + (k->rkey().size() + 7) / 8 * 8;
  return bytes;
}

void encode_keys(const std::vector<std::shared_ptr<Mapping>> &keys, std::vector<uint8_t> &body) {
  const uint32_t head[2] = {static_cast<uint32_t>(keys.size()), 0};
  const size_t at = body.size();
  body.resize(at + key_table_bytes(keys), 0);
  uint8_t *p = body.data() + at;
  std::memcpy(p, head, sizeof(head));
  p += sizeof(head);
  for (const auto &k : keys) {
    const Key key{k->base(), k->length(), static_cast<uint32_t>(k->rkey().size()), 0};
    std::memcpy(p, &key, sizeof(key));
    p += sizeof(key);
    std::memcpy(p, k->rkey().data(), k->rkey().size());
    p += (k->rkey().size() + 7) / 8 * 8;
  }
}

std::string decode_keys(const std::vector<uint8_t> &trailer, const std::vector<wire::Segment> &segments,
                        KeyTable &out) {
  uint32_t head[2] = {0, 0};
  if (trailer.size() < sizeof(head)) return "UCX key table missing";
  std::memcpy(head, trailer.data(), sizeof(head));
  if (head[0] == 0 || head[0] > kMaxKeys || head[1] != 0) return "bad UCX key count";
  size_t at = sizeof(head);
  for (uint32_t i = 0; i < head[0]; ++i) {
    Key key{};
    if (trailer.size() - at < sizeof(key)) return "UCX key table too short";
    std::memcpy(&key, trailer.data() + at, sizeof(key));
    at += sizeof(key);
    if (key.key_length == 0 || key.key_length > kMaxKeyBytes || key.zero != 0 || key.length == 0 ||
        key.base + key.length < key.base) {
      return "bad UCX key";
    }
    const size_t padded = (static_cast<size_t>(key.key_length) + 7) / 8 * 8;
    if (trailer.size() - at < padded) return "UCX key table too short";
    if (!std::all_of(trailer.begin() + static_cast<std::ptrdiff_t>(at + key.key_length),
                     trailer.begin() + static_cast<std::ptrdiff_t>(at + padded), [](uint8_t b) { return b == 0; })) {
      return "UCX key padding not zero";
    }
    out.keys.push_back(key);
    out.packed.emplace_back(reinterpret_cast<const char *>(trailer.data() + at), key.key_length);
    at += padded;
  }
  if (at != trailer.size()) return "UCX key table length mismatch";
  // Each segment inside one key's range.
  out.segment_key.resize(segments.size());
  for (size_t i = 0; i < segments.size(); ++i) {
    const wire::Segment &s = segments[i];
    size_t k = 0;
    while (k < out.keys.size() && !(s.addr >= out.keys[k].base && s.length <= out.keys[k].length &&
                                    s.addr - out.keys[k].base <= out.keys[k].length - s.length)) {
      ++k;
    }
    if (k == out.keys.size()) return "UCX segment outside every key";
    out.segment_key[i] = static_cast<uint32_t>(k);
  }
  return {};
}

}  // namespace datadist::ucx
