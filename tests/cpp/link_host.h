// Helpers shared by the tests that run a Link of their own (link.h) on
// socket pairs: the transport's part a link asks of its host, and a cache
// of one tensor in slots, registered with that host.
#ifndef DATADIST_TESTS_CPP_LINK_HOST_H_
#define DATADIST_TESTS_CPP_LINK_HOST_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "registry.h"
#include "transport/io_loop.h"
#include "transport/link.h"

namespace datadist {

// A link's host: its own registry and an I/O loop of two threads; `down`
// is set once a link of its went down.
class TestLinkHost : public LinkHost {
 public:
  Registry &registry() override { return registry_; }
  void link_down(const std::shared_ptr<Link> &) override { down = true; }
  void detach(const std::shared_ptr<Link> &) override {}
  IoLoop &io_loop() override { return loop_; }
  std::atomic<bool> down{false};

 private:
  Registry registry_;
  IoLoop loop_{2};
};

// Registers `bytes` with `host` as a remote-accessible cache of one tensor
// of `slots` slots of `slot` bytes (uint8); its id, -1 when refused.
inline int64_t add_slot_cache(TestLinkHost &host, std::vector<uint8_t> &bytes, uint64_t slot, uint64_t slots) {
  auto entry = std::make_shared<CacheEntry>();
  entry->spec.num_tensors = 1;
  entry->spec.shape = {static_cast<int64_t>(slots), static_cast<int64_t>(slot)};
  entry->spec.data_type = 4;  // uint8
  entry->geometry = {slot * slots, slot, slots};
  entry->addrs = {bytes.data()};
  entry->remote_accessible = true;
  int64_t cache_id = -1;
  if (host.registry().add(entry, {}, std::nullopt, false, cache_id) != llm_datadist::LLM_SUCCESS) return -1;
  return cache_id;
}

}  // namespace datadist

#endif  // DATADIST_TESTS_CPP_LINK_HOST_H_
