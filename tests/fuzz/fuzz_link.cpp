// Fuzz target: one link's frame handling, fed from bytes. A real Link, with
// a real Registry behind it, reads the input from a socket as it would read
// a peer; its answers are drained from the other end. After each input the
// harness checks that:
//   - no byte outside the remotely accessible caches (and the link's own
//     receive buffer) changed: every cache lies in one arena between
//     PROT_NONE guard pages, and the rest of the arena is a known pattern;
//   - no answer carried a byte of memory the peer may not read (the arena's
//     other bytes hold a random marker that no answer may contain);
//   - the link went down at the end of the input, every operation it had
//     open settled, and no file descriptor was left open.
// ASan, UBSan and LeakSanitizer report everything else.
//
// Input: one mode byte (how the handshake set the link up, see Mode), then
// the byte stream the peer sends.
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "fuzz_support.h"
#include "registry.h"
#include "request.h"
#include "transport/link.h"
#include "transport/paths/paths.h"
#include "transport/paths/same_host/same_host_kind.h"

namespace {

using namespace datadist;
using namespace dd_fuzz;

constexpr uintptr_t kPeerAddr = 0x6b0000000000;  // mapped in the peer process, for seeds' segments
constexpr size_t kPeerBytes = 16 * kPage;
constexpr uint64_t kPeerId = 42;

enum Mode : uint8_t {
  kOffered = 1,      // this end offered the same-host path
  kPeerCopies = 2,   // the peer reaches this end's memory
  kReaches = 4,      // this end reaches the peer's memory (a child process)
  kAnnounce = 8,     // ... and says so with the link's first frame
  kSubmit = 16,      // this end has a read (op 1) and a write (op 2) open
  kInitiated = 32,   // this end initiated the link
  kOneSided = 64,    // access "one_sided": grants this end's caches (with kPeerCopies), takes the peer's
};

class FuzzHost : public LinkHost {
 public:
  explicit FuzzHost(Registry &registry) : registry_(registry) {}
  Registry &registry() override { return registry_; }
  void link_down(const std::shared_ptr<Link> &) override { down.store(true); }
  void detach(const std::shared_ptr<Link> &) override {}
  static const std::shared_ptr<same_host::CopyPool> &pool() {
    static const auto p = std::make_shared<same_host::CopyPool>(1);
    return p;
  }
  IoLoop &io_loop() override { return loop(); }
  static IoLoop &loop() {
    static IoLoop l(1);
    return l;
  }
  std::atomic<bool> down{false};

 private:
  Registry &registry_;
};

pid_t peer_pid = -1;
std::shared_ptr<same_host::PeerMemory> peer_memory;

// The peer process: a child that only waits, whose memory same-host frames
// name (copying into it cannot harm the harness). Started again if it died.
void start_peer() {
  if (peer_pid > 0 && ::waitpid(peer_pid, nullptr, WNOHANG) == 0) return;
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  require(pid >= 0, "fork failed");
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(0);
    for (;;) ::pause();
  }
  peer_pid = pid;
  peer_memory = std::make_shared<same_host::PeerMemory>(pid);
}

// Op 1 reads 2 x 32 bytes of the peer's cache 5 into kReadInto; op 2 writes
// 64 bytes of kWriteFrom into it.
std::shared_ptr<Request> submit_both(Link &link) {
  auto request = std::make_shared<Request>(1, 2, nullptr, std::weak_ptr<RequestTracker>{});
  const auto deadline = Clock::now() + std::chrono::hours(1);
  wire::Target target{};
  target.kind = wire::kById;
  target.cache_id = 5;
  std::vector<PlannedFrame> reads(1);
  reads[0].target = target;
  reads[0].ranges = {{0, 0, 0, 0, 32}, {1, 0, 1, 0, 32}};
  reads[0].local = {{arena() + kReadInto, 32}, {arena() + kReadInto + 64, 32}};
  link.submit(false, std::move(reads), request, 0, deadline, nullptr);
  std::vector<PlannedFrame> writes(1);
  writes[0].target = target;
  writes[0].ranges = {{0, 0, 2, 0, 64}};
  writes[0].local = {{arena() + kWriteFrom, 64}};
  link.submit(true, std::move(writes), request, 1, deadline, nullptr);
  return request;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int *, char ***) {
  if (std::getenv("FUZZ_LOG") == nullptr) ::setenv("DATADIST_AIO_LOG", "off", 1);
  arena_init();
  std::memset(map_fixed(kPeerAddr, kPeerBytes), 0x5c, kPeerBytes);
  start_peer();
  FuzzHost::pool();
  FuzzHost::loop();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size == 0) return 0;
  const uint8_t mode = data[0];
  ++data;
  --size;
  start_peer();
  arena_reset();
  // Counted here, not once: libFuzzer's symbolizer opens pipes between inputs.
  const size_t fds_before = open_fds();
  Registry registry;
  add_caches(registry);
  FuzzHost host(registry);

  std::vector<std::shared_ptr<DataPath>> paths;
  if ((mode & kOffered) != 0) {
    same_host::Terms terms;
    terms.peer_copies = (mode & kPeerCopies) != 0;
    if ((mode & kReaches) != 0) terms.peer_memory = peer_memory;
    terms.announce = (mode & kAnnounce) != 0;
    terms.one_sided = (mode & kOneSided) != 0;
    terms.peer_pid = peer_pid;
    same_host::link_paths(FuzzHost::pool(), terms, paths);
  }
  int fds[2];
  require(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) == 0, "socketpair failed");
  // As the handshake lists them.
  auto link = std::make_shared<Link>(kPeerId, 1, (mode & kInitiated) != 0, std::vector<int>{fds[0]}, &host,
                                     std::move(paths));
  link->start();
  std::shared_ptr<Request> request;
  if ((mode & kSubmit) != 0) request = submit_both(*link);

  const std::vector<uint8_t> answers = exchange(fds[1], data, size);
  ::close(fds[1]);
  if (std::getenv("FUZZ_LOG") != nullptr) trace(answers);
  // The I/O thread reads to the end of the input, which takes the link down.
  for (int i = 0; i < 10000 && !host.down.load(); ++i) ::usleep(1000);
  link->reap();
  require(host.down.load(), "the link is not down at the end of its input");
  require(link->open_operations() == 0, "operations left open after the link was reaped");
  if (request) {
    request->release(0, llm_datadist::LLM_SUCCESS);
    require(request->done(), "an operation never settled");
  }
  link.reset();
  check_arena("fuzz_link", answers);
  require(open_fds() == fds_before, "a file descriptor was left open");
  return 0;
}
