// The test path: between two engines of one process, the initiator moves an
// operation's bytes itself with memcpy, resolving the owner's ranges in the
// owner's registry with the owner's own checks (target_resolver.h), and no
// frame goes to the owner. Offered only where PathOptions.test_path is set
// ($DATADIST_AIO_TEST_PATH=1): it is what a path is made of, its folder and
// a line in paths.cpp, and gives tests a path the link manager knows
// nothing of.
//
// Its part of a hello (the first connection's) or of an ack: this process's
// token and the sender's engine number. A peer whose token differs is in
// another process: the link goes without the path. Host memory only; reads
// through a key (the owner releases it) and device memory go by the link's
// other paths.
#ifndef DATADIST_TRANSPORT_PATHS_TEST_TEST_PATH_H_
#define DATADIST_TRANSPORT_PATHS_TEST_TEST_PATH_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "transport/paths/paths.h"

namespace datadist::test_path {

class TestKind : public PathKind {
 public:
  static constexpr uint16_t kId = 0x7e01;
  explicit TestKind(Registry &registry);
  ~TestKind() override;

  uint16_t id() const override { return kId; }
  void stop() override;
  std::unique_ptr<PathHandshake> handshake(uint64_t peer_id, bool acceptor) override;

 private:
  const uint64_t engine_;  // this engine's number in the process
};

class TestPath : public DataPath {
 public:
  explicit TestPath(uint64_t peer_engine) : peer_engine_(peer_engine) {}

  const char *name() const override { return "test"; }
  // Never names the link's transport, and carries no frame: it moves bytes itself or leaves them.
  bool active() const override { return false; }
  Carry carry(const PlannedFrame &, const cuda::Device *, bool, size_t, Carried &) override { return Carry::kNext; }
  bool move(bool write, const PlannedFrame &planned, const std::shared_ptr<cuda::Device> &device,
            const Settle &settle) override;
  bool serves(const wire::Request &) const override { return false; }
  void serve(std::shared_ptr<ServedFrame>) override {}
  // test_moves, test_bytes: operations and bytes it moved; test_refused:
  // operations the owner's checks refused here.
  void counters(std::map<std::string, uint64_t> &out) const override;

 private:
  const uint64_t peer_engine_;
  std::atomic<uint64_t> moves_{0}, bytes_{0}, refused_{0};
};

}  // namespace datadist::test_path

#endif  // DATADIST_TRANSPORT_PATHS_TEST_TEST_PATH_H_
