// Staging: device memory moves to and from a peer through host buffers.
// The host never dereferences a device address; a copy engine (the
// driver's asynchronous copies on the engine's streams, or host copies in a
// test) fills or drains bounded host buffers chunk by chunk, and the link's
// sockets (or kernel copies) take or give each chunk in order, so the copy
// engine and the network overlap: the first chunk leaves while the second
// is being copied.
//
// Nothing here knows CUDA: cuda_driver.h gives the copier and the pinned
// pools of a device.
//
// Threads: a Pool may be used from any thread. A Copier, and one call of
// stage_out / stage_in, belong to the calling thread.
#ifndef DATADIST_DEVICE_STAGING_H_
#define DATADIST_DEVICE_STAGING_H_

#include <sys/uio.h>

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

namespace datadist::staging {

// Bytes per staging buffer (one chunk), and buffers per pool.
inline constexpr size_t kChunkBytes = 1 << 20;
inline constexpr size_t kPoolBuffers = 8;
// Buffers one transfer keeps in flight: one being copied while another
// goes out (or comes in).
inline constexpr size_t kDepth = 2;

// At most `max_buffers` host buffers of `buffer_bytes` each, made on first
// need with `alloc` and freed with `free` by the destructor (every buffer
// must have come back by then). A caller that holds none waits in acquire()
// until one is free; a caller that holds one only ever tries (try_acquire),
// so transfers sharing a pool cannot wait on each other in a circle.
class Pool {
 public:
  using Alloc = std::function<uint8_t *(size_t bytes, std::string &why)>;
  using Free = std::function<void(uint8_t *)>;

  Pool(size_t buffer_bytes, size_t max_buffers, Alloc alloc, Free free);
  ~Pool();
  Pool(const Pool &) = delete;
  Pool &operator=(const Pool &) = delete;

  size_t buffer_bytes() const { return buffer_bytes_; }
  size_t max_buffers() const { return max_buffers_; }

  // Waits until a buffer is free or may be made; null with `why` when
  // making one failed.
  uint8_t *acquire(std::string &why);
  // A free buffer, or one made now; null at once when none may be had.
  uint8_t *try_acquire();
  void release(uint8_t *buffer);

  size_t made() const;     // buffers allocated so far (never above max_buffers)
  size_t in_use() const;   // buffers handed out now
  size_t waiters() const;  // callers waiting in acquire()

 private:
  uint8_t *take_locked(std::unique_lock<std::mutex> &lock, std::string &why);

  const size_t buffer_bytes_;
  const size_t max_buffers_;
  const Alloc alloc_;
  const Free free_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<uint8_t *> all_;
  std::vector<uint8_t *> idle_;
  size_t making_ = 0;  // allocations under way (outside the lock)
  size_t waiters_ = 0;
};

// The copy engine. Copies queued on one lane run in order; wait(lane)
// returns once every copy queued on it has run. Each returns false with
// `why` when the copy engine refuses or failed.
class Copier {
 public:
  virtual ~Copier() = default;
  // `device` is a device address: the host never reads or writes it.
  virtual bool to_host(size_t lane, uint8_t *host, const uint8_t *device, size_t n, std::string &why) = 0;
  virtual bool to_device(size_t lane, uint8_t *device, const uint8_t *host, size_t n, std::string &why) = 0;
  virtual bool wait(size_t lane, std::string &why) = 0;
};

enum class Outcome {
  kDone,        // every byte moved
  kCopyFailed,  // the copy engine failed (or no buffer could be made): `why`
  kIoFailed,    // the sink or source returned false
};

struct Result {
  Outcome outcome = Outcome::kDone;
  uint64_t moved = 0;  // bytes handed to the sink, or taken from the source
  std::string why;
};

// Takes `n` bytes of the stream from a buffer (stage_out), or puts the next
// `n` into one (stage_in); false stops the transfer (kIoFailed).
using Sink = std::function<bool(const uint8_t *bytes, size_t n)>;
using Source = std::function<bool(uint8_t *bytes, size_t n)>;

// Copies the device ranges `device`, in order, into chunks of at most one
// buffer (a chunk may gather several short ranges) and hands each chunk to
// `sink` in order, with up to `depth` buffers in flight. On failure no
// later byte reaches the sink; `moved` says how many did.
Result stage_out(Pool &pool, Copier &copier, const std::vector<iovec> &device, size_t depth, const Sink &sink);

// Takes the stream from `source` chunk by chunk and copies each into the
// device ranges `device`, in order, with up to `depth` buffers in flight.
// Returns once every queued copy has run; on failure the source is not
// read further (`moved` says how far it was).
Result stage_in(Pool &pool, Copier &copier, const std::vector<iovec> &device, size_t depth, const Source &source);

}  // namespace datadist::staging

#endif  // DATADIST_DEVICE_STAGING_H_
