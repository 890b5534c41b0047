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
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <dirent.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "registry.h"
#include "request.h"
#include "transport/link.h"
#include "transport/same_host.h"

#if defined(__clang__)
#define NOT_FOR_COVERAGE __attribute__((no_sanitize("coverage")))
#else
#define NOT_FOR_COVERAGE
#endif

namespace {

using namespace datadist;

// Fixed addresses, so that seeds may name raw addresses and same-host segments.
constexpr uintptr_t kArenaAddr = 0x6a0000000000;
constexpr uintptr_t kPeerAddr = 0x6b0000000000;  // mapped in the peer process
constexpr size_t kPage = 4096;
constexpr size_t kArenaBytes = 8 * kPage;
constexpr size_t kPeerBytes = 16 * kPage;
constexpr uint64_t kPeerId = 42;

// Where things lie in the arena (offsets); every gap holds the marker.
constexpr size_t kCacheA0 = 0x1000, kCacheA1 = 0x1200;  // contiguous, 2 tensors x 4 slots x 64 B, remote
constexpr size_t kCacheB = 0x2000;                       // blocks of model 3, 8 x 32 B, remote
constexpr size_t kCacheC = 0x3000;                       // 4 slots x 64 B, not remote accessible
constexpr size_t kReadInto = 0x4000;                     // destination of the harness's own read
constexpr size_t kWriteFrom = 0x5000;                    // source of the harness's own write
constexpr size_t kTensorBytes = 256;

enum Mode : uint8_t {
  kOffered = 1,      // this end offered the same-host path
  kPeerCopies = 2,   // the peer reaches this end's memory
  kReaches = 4,      // this end reaches the peer's memory (a child process)
  kAnnounce = 8,     // ... and says so with the link's first frame
  kSubmit = 16,      // this end has a read (op 1) and a write (op 2) open
  kInitiated = 32,   // this end initiated the link
};

class FuzzHost : public LinkHost {
 public:
  explicit FuzzHost(Registry &registry) : registry_(registry) {}
  Registry &registry() override { return registry_; }
  void link_down(const std::shared_ptr<Link> &) override { down.store(true); }
  void detach(const std::shared_ptr<Link> &) override { detached.store(true); }
  same_host::CopyPool &copy_pool() override { return pool(); }
  static same_host::CopyPool &pool() {
    static same_host::CopyPool p(1);
    return p;
  }
  std::atomic<bool> down{false};
  std::atomic<bool> detached{false};

 private:
  Registry &registry_;
};

uint8_t *arena;
uint8_t marker[8];
pid_t peer_pid = -1;
std::shared_ptr<same_host::PeerMemory> peer_memory;

void require(bool ok, const char *what) {
  if (!ok) {
    std::fprintf(stderr, "fuzz_link: %s\n", what);
    std::abort();
  }
}

uint8_t *map_fixed(uintptr_t addr, size_t bytes) {
  void *p = ::mmap(reinterpret_cast<void *>(addr), bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
  require(p == reinterpret_cast<void *>(addr), "cannot map the arena at its fixed address");
  return static_cast<uint8_t *>(p);
}

// Bytes the peer may change (and read, but for the harness's own buffer).
bool writable(size_t at) {
  auto in = [at](size_t start) { return at >= start && at < start + kTensorBytes; };
  return in(kCacheA0) || in(kCacheA1) || in(kCacheB) || in(kReadInto);
}
bool readable(size_t at) {
  auto in = [at](size_t start) { return at >= start && at < start + kTensorBytes; };
  return in(kCacheA0) || in(kCacheA1) || in(kCacheB) || in(kWriteFrom);
}

uint8_t expected(size_t at) {
  return readable(at) ? static_cast<uint8_t>(at * 7 + 1) : marker[at % sizeof(marker)];
}

// The arena as every input starts with it, and which of its bytes the peer may change.
std::vector<uint8_t> image;
std::vector<uint8_t> may_change;

void fill_arena() { std::memcpy(arena + kPage, image.data(), image.size()); }

// Not instrumented for coverage (nor the next): they only check, and the
// fuzzer must not learn the marker from their comparisons.
NOT_FOR_COVERAGE size_t changed_byte() {
  for (size_t i = 0; i < image.size(); ++i) {
    if (may_change[i] == 0 && arena[kPage + i] != image[i]) return kPage + i;
  }
  return 0;
}

NOT_FOR_COVERAGE bool holds_marker(const std::vector<uint8_t> &out) {
  // The marker may start at any of its rotations in the arena.
  for (size_t i = 0; i + sizeof(marker) <= out.size(); ++i) {
    for (size_t r = 0; r < sizeof(marker); ++r) {
      size_t j = 0;
      while (j < sizeof(marker) && out[i + j] == marker[(r + j) % sizeof(marker)]) ++j;
      if (j == sizeof(marker)) return true;
    }
  }
  return false;
}

// With FUZZ_LINK_LOG set: the answers' headers, to see what a seed does.
void trace(const std::vector<uint8_t> &out) {
  for (size_t at = 0; at + sizeof(wire::FrameHeader) <= out.size();) {
    wire::FrameHeader h;
    std::memcpy(&h, out.data() + at, sizeof(h));
    std::fprintf(stderr, "answer: type %u, op %llu, status %u, body %u, data %llu\n", h.type,
                 static_cast<unsigned long long>(h.op_id), h.status, h.body_len,
                 static_cast<unsigned long long>(h.data_len));
    at += sizeof(h) + h.body_len + h.data_len;
  }
}

size_t open_fds() {
  size_t n = 0;
  DIR *d = ::opendir("/proc/self/fd");
  if (d == nullptr) return 0;
  while (::readdir(d) != nullptr) ++n;
  ::closedir(d);
  return n;
}

// The peer process: a child that only waits, whose memory same-host frames name.
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

void add_caches(Registry &registry) {
  auto entry = [](std::vector<size_t> tensors, uint64_t slots, bool remote, bool blocks) {
    auto e = std::make_shared<CacheEntry>();
    e->spec.num_tensors = static_cast<uint32_t>(tensors.size());
    e->spec.shape = {static_cast<int64_t>(slots), static_cast<int64_t>(kTensorBytes / slots)};
    e->spec.data_type = 4;  // uint8
    e->spec.is_blocks = blocks;
    e->geometry = {kTensorBytes, kTensorBytes / slots, slots};
    for (size_t at : tensors) e->addrs.push_back(arena + at);
    e->remote_accessible = remote;
    return e;
  };
  int64_t id;
  // Cache 1: keys (7, model 1) on slot 1 and (8, model 1) on slot 2.
  registry.add(entry({kCacheA0, kCacheA1}, 4, true, false), {{kInvalidId, 1, kInvalidId}, {7, 1, kInvalidId},
                                                           {8, 1, kInvalidId}},
               std::nullopt, false, id);
  // Cache 2: the blocks cache of model 3.
  registry.add(entry({kCacheB}, 8, true, true), {}, 3, false, id);
  // Cache 3: key (9, model 1) on slot 0, never remotely accessible.
  registry.add(entry({kCacheC}, 4, false, false), {{9, 1, kInvalidId}}, std::nullopt, false, id);
}

// Writes `input` to `fd` while draining what comes back, until the other end closes.
std::vector<uint8_t> exchange(int fd, const uint8_t *input, size_t size) {
  std::vector<uint8_t> out;
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  size_t sent = 0;
  bool writing = true;
  if (size == 0) {
    ::shutdown(fd, SHUT_WR);
    writing = false;
  }
  uint8_t buf[64 * 1024];
  for (;;) {
    pollfd p{fd, static_cast<short>(POLLIN | (writing ? POLLOUT : 0)), 0};
    if (::poll(&p, 1, -1) < 0) continue;
    if (writing && (p.revents & (POLLOUT | POLLERR | POLLHUP)) != 0) {
      const ssize_t n = ::send(fd, input + sent, size - sent, MSG_NOSIGNAL);
      if (n > 0) sent += static_cast<size_t>(n);
      if (n < 0 && errno != EAGAIN && errno != EINTR) writing = false;  // the link closed
      if (sent == size && writing) {
        ::shutdown(fd, SHUT_WR);
        writing = false;
      }
    }
    if ((p.revents & (POLLIN | POLLHUP | POLLERR)) != 0) {
      const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
      if (n > 0) out.insert(out.end(), buf, buf + n);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) return out;
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int *, char ***) {
  if (std::getenv("FUZZ_LINK_LOG") == nullptr) ::setenv("DATADIST_AIO_LOG", "off", 1);
  arena = map_fixed(kArenaAddr, kArenaBytes);
  ::mprotect(arena, kPage, PROT_NONE);
  ::mprotect(arena + kArenaBytes - kPage, kPage, PROT_NONE);
  std::random_device rd;
  for (uint8_t &b : marker) b = static_cast<uint8_t>(rd() | 0x80);
  for (size_t at = kPage; at < kArenaBytes - kPage; ++at) {
    image.push_back(expected(at));
    may_change.push_back(writable(at) ? 1 : 0);
  }
  uint8_t *peer = map_fixed(kPeerAddr, kPeerBytes);
  std::memset(peer, 0x5c, kPeerBytes);
  start_peer();
  FuzzHost::pool();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size == 0) return 0;
  const uint8_t mode = data[0];
  ++data;
  --size;
  start_peer();
  fill_arena();
  // Counted here, not once: libFuzzer's symbolizer opens pipes between inputs.
  const size_t fds_before = open_fds();
  Registry registry;
  add_caches(registry);
  FuzzHost host(registry);

  LinkPaths paths;
  paths.offered = (mode & kOffered) != 0;
  paths.peer_copies = (mode & kPeerCopies) != 0;
  if ((mode & kReaches) != 0) paths.peer_memory = peer_memory;
  paths.announce = (mode & kAnnounce) != 0;
  int fds[2];
  require(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) == 0, "socketpair failed");
  auto link = std::make_shared<Link>(kPeerId, 1, (mode & kInitiated) != 0, std::vector<int>{fds[0]}, &host, paths);
  link->start();

  std::shared_ptr<Request> request;
  if ((mode & kSubmit) != 0) {
    // Op 1 reads 2 x 32 bytes of the peer's cache 5 into kReadInto; op 2
    // writes 64 bytes of kWriteFrom into it.
    request = std::make_shared<Request>(1, 2, nullptr, std::weak_ptr<RequestTracker>{});
    const auto deadline = Clock::now() + std::chrono::hours(1);
    wire::Target target{};
    target.kind = wire::kById;
    target.cache_id = 5;
    PlannedFrame read;
    read.target = target;
    read.ranges = {{0, 0, 0, 0, 32}, {1, 0, 1, 0, 32}};
    read.local = {{arena + kReadInto, 32}, {arena + kReadInto + 64, 32}};
    std::vector<PlannedFrame> reads;
    reads.push_back(std::move(read));
    link->submit(false, std::move(reads), request, 0, deadline, nullptr);
    PlannedFrame write;
    write.target = target;
    write.ranges = {{0, 0, 2, 0, 64}};
    write.local = {{arena + kWriteFrom, 64}};
    std::vector<PlannedFrame> writes;
    writes.push_back(std::move(write));
    link->submit(true, std::move(writes), request, 1, deadline, nullptr);
  }

  const std::vector<uint8_t> answers = exchange(fds[1], data, size);
  ::close(fds[1]);
  if (std::getenv("FUZZ_LINK_LOG") != nullptr) trace(answers);
  link->reap();
  require(host.down.load(), "the link is not down at the end of its input");
  require(link->open_operations() == 0, "operations left open after the link was reaped");
  if (request) {
    request->release(0, llm_datadist::LLM_SUCCESS);
    require(request->done(), "an operation never settled");
  }
  link.reset();
  if (const size_t at = changed_byte()) {
    std::fprintf(stderr, "fuzz_link: arena byte 0x%zx changed\n", at);
    std::abort();
  }
  require(!holds_marker(answers), "an answer carried memory the peer may not read");
  require(open_fds() == fds_before, "a file descriptor was left open");
  return 0;
}
