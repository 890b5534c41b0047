#include "device/staging.h"

#include <algorithm>
#include <deque>

namespace datadist::staging {

Pool::Pool(size_t buffer_bytes, size_t max_buffers, Alloc alloc, Free free)
    : buffer_bytes_(buffer_bytes), max_buffers_(std::max<size_t>(max_buffers, 1)), alloc_(std::move(alloc)),
      free_(std::move(free)) {}

Pool::~Pool() {
  for (uint8_t *buffer : all_) free_(buffer);
}

uint8_t *Pool::take_locked(std::unique_lock<std::mutex> &lock, std::string &why) {
  if (!idle_.empty()) {
    uint8_t *buffer = idle_.back();
    idle_.pop_back();
    return buffer;
  }
  // Room for one more: made outside the lock (the driver may take a while).
  ++making_;
  lock.unlock();
  uint8_t *buffer = alloc_(buffer_bytes_, why);
  lock.lock();
  --making_;
  if (buffer != nullptr) {
    all_.push_back(buffer);
  } else {
    cv_.notify_all();  // the room it held is free again
  }
  return buffer;
}

uint8_t *Pool::acquire(std::string &why) {
  std::unique_lock<std::mutex> lock(mu_);
  ++waiters_;
  cv_.wait(lock, [&] { return !idle_.empty() || all_.size() + making_ < max_buffers_; });
  --waiters_;
  return take_locked(lock, why);
}

uint8_t *Pool::try_acquire() {
  std::unique_lock<std::mutex> lock(mu_);
  if (idle_.empty() && all_.size() + making_ >= max_buffers_) return nullptr;
  std::string why;
  return take_locked(lock, why);
}

void Pool::release(uint8_t *buffer) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    idle_.push_back(buffer);
  }
  cv_.notify_one();
}

size_t Pool::made() const {
  std::lock_guard<std::mutex> lock(mu_);
  return all_.size();
}

size_t Pool::in_use() const {
  std::lock_guard<std::mutex> lock(mu_);
  return all_.size() - idle_.size();
}

size_t Pool::waiters() const {
  std::lock_guard<std::mutex> lock(mu_);
  return waiters_;
}

namespace {

// A buffer of the pool and the lane its copies run on.
struct Slot {
  uint8_t *buffer = nullptr;
  size_t lane = 0;
  size_t bytes = 0;  // of the stream it holds
};

// The buffers one transfer holds: the first waited for, the rest only tried.
class Buffers {
 public:
  Buffers(Pool &pool, size_t depth, std::string &why) : pool_(pool) {
    uint8_t *first = pool.acquire(why);
    if (first == nullptr) return;
    free_.push_back({first, 0, 0});
    for (size_t lane = 1; lane < std::max<size_t>(depth, 1); ++lane) {
      uint8_t *more = pool.try_acquire();
      if (more == nullptr) break;
      free_.push_back({more, lane, 0});
    }
    held_ = free_.size();
  }
  ~Buffers() {
    for (const Slot &slot : free_) pool_.release(slot.buffer);
  }
  Buffers(const Buffers &) = delete;
  Buffers &operator=(const Buffers &) = delete;

  bool empty() const { return held_ == 0; }
  std::deque<Slot> &free() { return free_; }

 private:
  Pool &pool_;
  std::deque<Slot> free_;
  size_t held_ = 0;
};

// Walks the device ranges as one stream of bytes.
class Cursor {
 public:
  explicit Cursor(const std::vector<iovec> &ranges) : ranges_(ranges) { skip_empty(); }
  bool done() const { return index_ == ranges_.size(); }
  // Calls fn(device address, length) for the next pieces of at most `room`
  // bytes in all; returns the bytes covered, or stops at the first false.
  template <typename Fn>
  size_t take(size_t room, Fn &&fn, bool &ok) {
    size_t taken = 0;
    ok = true;
    while (taken < room && !done()) {
      const iovec &r = ranges_[index_];
      const size_t n = std::min(room - taken, r.iov_len - offset_);
      if (!fn(static_cast<uint8_t *>(r.iov_base) + offset_, taken, n)) {
        ok = false;
        return taken;
      }
      taken += n;
      offset_ += n;
      if (offset_ == r.iov_len) {
        ++index_;
        offset_ = 0;
        skip_empty();
      }
    }
    return taken;
  }

 private:
  void skip_empty() {
    while (index_ < ranges_.size() && ranges_[index_].iov_len == 0) ++index_;
  }
  const std::vector<iovec> &ranges_;
  size_t index_ = 0;
  size_t offset_ = 0;
};

uint64_t total_bytes(const std::vector<iovec> &ranges) {
  uint64_t total = 0;
  for (const iovec &r : ranges) total += r.iov_len;
  return total;
}

// Waits for every slot still in flight (their copies touch the buffers)
// and puts them back with the free ones.
void settle(Copier &copier, std::deque<Slot> &in_flight, Buffers &buffers) {
  std::string ignored;
  for (Slot &slot : in_flight) {
    copier.wait(slot.lane, ignored);
    buffers.free().push_back(slot);
  }
  in_flight.clear();
}

}  // namespace

Result stage_out(Pool &pool, Copier &copier, const std::vector<iovec> &device, size_t depth, const Sink &sink) {
  Result result;
  if (total_bytes(device) == 0) return result;
  Buffers buffers(pool, depth, result.why);
  if (buffers.empty()) {
    result.outcome = Outcome::kCopyFailed;
    result.why = "no staging buffer: " + result.why;
    return result;
  }
  Cursor cursor(device);
  std::deque<Slot> in_flight;
  const size_t room = pool.buffer_bytes();
  for (;;) {
    // Queue the copies of as many chunks as there are free buffers.
    while (!buffers.free().empty() && !cursor.done()) {
      Slot slot = buffers.free().front();
      buffers.free().pop_front();
      bool ok = true;
      slot.bytes = cursor.take(
          room,
          [&](uint8_t *from, size_t at, size_t n) { return copier.to_host(slot.lane, slot.buffer + at, from, n, result.why); },
          ok);
      in_flight.push_back(slot);
      if (!ok) {
        settle(copier, in_flight, buffers);
        result.outcome = Outcome::kCopyFailed;
        return result;
      }
    }
    if (in_flight.empty()) return result;
    // The oldest chunk goes out once its copy has run.
    Slot slot = in_flight.front();
    in_flight.pop_front();
    const bool copied = copier.wait(slot.lane, result.why);
    const bool sent = copied && sink(slot.buffer, slot.bytes);
    buffers.free().push_back(slot);
    if (!sent) {
      settle(copier, in_flight, buffers);
      result.outcome = copied ? Outcome::kIoFailed : Outcome::kCopyFailed;
      return result;
    }
    result.moved += slot.bytes;
  }
}

Result stage_in(Pool &pool, Copier &copier, const std::vector<iovec> &device, size_t depth, const Source &source) {
  Result result;
  const uint64_t total = total_bytes(device);
  if (total == 0) return result;
  Buffers buffers(pool, depth, result.why);
  if (buffers.empty()) {
    result.outcome = Outcome::kCopyFailed;
    result.why = "no staging buffer: " + result.why;
    return result;
  }
  Cursor cursor(device);
  std::deque<Slot> in_flight;
  const size_t room = pool.buffer_bytes();
  while (!cursor.done()) {
    if (buffers.free().empty()) {
      // Every buffer is being copied out: the oldest is free once its copy ran.
      Slot slot = in_flight.front();
      in_flight.pop_front();
      const bool copied = copier.wait(slot.lane, result.why);
      buffers.free().push_back(slot);
      if (!copied) {
        settle(copier, in_flight, buffers);
        result.outcome = Outcome::kCopyFailed;
        return result;
      }
    }
    Slot slot = buffers.free().front();
    buffers.free().pop_front();
    slot.bytes = static_cast<size_t>(std::min<uint64_t>(room, total - result.moved));
    if (!source(slot.buffer, slot.bytes)) {
      buffers.free().push_back(slot);
      settle(copier, in_flight, buffers);
      result.outcome = Outcome::kIoFailed;
      return result;
    }
    result.moved += slot.bytes;
    bool ok = true;
    cursor.take(
        slot.bytes,
        [&](uint8_t *to, size_t at, size_t n) { return copier.to_device(slot.lane, to, slot.buffer + at, n, result.why); },
        ok);
    in_flight.push_back(slot);
    if (!ok) {
      settle(copier, in_flight, buffers);
      result.outcome = Outcome::kCopyFailed;
      return result;
    }
  }
  while (!in_flight.empty()) {
    Slot slot = in_flight.front();
    in_flight.pop_front();
    const bool copied = copier.wait(slot.lane, result.why);
    buffers.free().push_back(slot);
    if (!copied) {
      settle(copier, in_flight, buffers);
      result.outcome = Outcome::kCopyFailed;
      return result;
    }
  }
  return result;
}

}  // namespace datadist::staging
