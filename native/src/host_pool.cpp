#include "host_pool.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <system_error>

namespace datadist {

HostPool::HostPool(const PoolConfig &config) : page_(uint64_t{1} << config.page_shift) {
  capacity_ = round_up(config.memory_size);
  int flags = MAP_SHARED;
  memfd_ = ::memfd_create("datadist_aio_host_pool", MFD_CLOEXEC);
  if (memfd_ >= 0 && ::ftruncate(memfd_, static_cast<off_t>(capacity_)) != 0) {
    ::close(memfd_);
    memfd_ = -1;
  }
  if (memfd_ < 0) flags = MAP_PRIVATE | MAP_ANONYMOUS;
  void *p = ::mmap(nullptr, capacity_, PROT_READ | PROT_WRITE, flags, memfd_, 0);
  if (p == MAP_FAILED) {
    int err = errno;
    if (memfd_ >= 0) ::close(memfd_);
    throw std::system_error(err, std::generic_category(), "mmap host pool");
  }
  base_ = static_cast<uint8_t *>(p);
  free_.emplace(0, capacity_);
}

HostPool::~HostPool() {
  ::munmap(base_, capacity_);
  if (memfd_ >= 0) ::close(memfd_);
}

uint64_t HostPool::round_up(uint64_t size) const { return (size + page_ - 1) / page_ * page_; }

uint8_t *HostPool::allocate(uint64_t size) {
  if (size == 0 || size > capacity_) return nullptr;
  const uint64_t want = round_up(size);
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < want) continue;
    const uint64_t offset = it->first;
    const uint64_t rest = it->second - want;
    free_.erase(it);
    if (rest != 0) free_.emplace(offset + want, rest);
    used_.emplace(offset, want);
    return base_ + offset;
  }
  return nullptr;
}

void HostPool::free(uint8_t *addr) {
  if (addr == nullptr) return;
  std::lock_guard<std::mutex> lock(mu_);
  auto used = used_.find(static_cast<uint64_t>(addr - base_));
  if (used == used_.end()) return;
  uint64_t offset = used->first;
  uint64_t length = used->second;
  used_.erase(used);
  auto next = free_.lower_bound(offset);
  if (next != free_.end() && offset + length == next->first) {
    length += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {
      prev->second += length;
      return;
    }
  }
  free_.emplace(offset, length);
}

uint64_t HostPool::bytes_free() const {
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t total = 0;
  for (auto &range : free_) total += range.second;
  return total;
}

}  // namespace datadist
