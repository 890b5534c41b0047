// HostPool: the engine-owned host memory behind allocate_cache.
//
// One shared mapping (a memfd, so a same-host peer could map it too) carved
// first-fit into pages of 1 << page_shift bytes; freed ranges coalesce.
// Threads: allocate() and free() may be called from any thread.
#ifndef DATADIST_HOST_POOL_H_
#define DATADIST_HOST_POOL_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>

namespace datadist {

struct PoolConfig {
  uint64_t memory_size = 0;
  uint32_t page_shift = 16;
};

class HostPool {
 public:
  HostPool(const PoolConfig &config);  // throws std::system_error if mapping fails
  ~HostPool();
  HostPool(const HostPool &) = delete;
  HostPool &operator=(const HostPool &) = delete;

  // Returns nullptr when no free range is large enough.
  uint8_t *allocate(uint64_t size);
  void free(uint8_t *addr);

  uint64_t capacity() const { return capacity_; }
  uint64_t bytes_free() const;
  int memfd() const { return memfd_; }

 private:
  uint64_t round_up(uint64_t size) const;

  uint64_t capacity_;
  uint64_t page_;
  int memfd_ = -1;
  uint8_t *base_ = nullptr;
  mutable std::mutex mu_;
  std::map<uint64_t, uint64_t> free_;  // offset -> length
  std::map<uint64_t, uint64_t> used_;  // offset -> length
};

}  // namespace datadist

#endif  // DATADIST_HOST_POOL_H_
