#include "fuzz_support.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <random>

#include "transport/wire.h"

// Checks only: the fuzzer must not learn the marker from their comparisons.
#if defined(__clang__)
#define NOT_FOR_COVERAGE __attribute__((no_sanitize("coverage")))
#else
#define NOT_FOR_COVERAGE
#endif

namespace dd_fuzz {

namespace {

uint8_t *base = nullptr;
uint8_t marker[8];
std::vector<uint8_t> image;       // the arena's initial bytes (without the guard pages)
std::vector<uint8_t> may_change;  // 1 where the peer may write

bool within(size_t at, size_t start) { return at >= start && at < start + kTensorBytes; }
bool peer_writable(size_t at) {
  return within(at, kCacheA0) || within(at, kCacheA1) || within(at, kCacheB) || within(at, kReadInto);
}
bool peer_readable(size_t at) {
  return within(at, kCacheA0) || within(at, kCacheA1) || within(at, kCacheB) || within(at, kWriteFrom);
}

NOT_FOR_COVERAGE size_t changed_byte() {
  for (size_t i = 0; i < image.size(); ++i) {
    if (may_change[i] == 0 && base[kPage + i] != image[i]) return kPage + i;
  }
  return 0;
}

// The marker may start at any of its rotations in the arena.
NOT_FOR_COVERAGE bool holds_marker(const std::vector<uint8_t> &out) {
  for (size_t i = 0; i + sizeof(marker) <= out.size(); ++i) {
    for (size_t r = 0; r < sizeof(marker); ++r) {
      size_t j = 0;
      while (j < sizeof(marker) && out[i + j] == marker[(r + j) % sizeof(marker)]) ++j;
      if (j == sizeof(marker)) return true;
    }
  }
  return false;
}

}  // namespace

void require(bool ok, const char *what) {
  if (!ok) {
    std::fprintf(stderr, "fuzz: %s\n", what);
    std::abort();
  }
}

uint8_t *map_fixed(uintptr_t addr, size_t bytes) {
  void *p = ::mmap(reinterpret_cast<void *>(addr), bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
  require(p == reinterpret_cast<void *>(addr), "cannot map memory at its fixed address");
  return static_cast<uint8_t *>(p);
}

void arena_init() {
  base = map_fixed(kArenaAddr, kArenaBytes);
  ::mprotect(base, kPage, PROT_NONE);
  ::mprotect(base + kArenaBytes - kPage, kPage, PROT_NONE);
  std::random_device rd;
  for (uint8_t &b : marker) b = static_cast<uint8_t>(rd() | 0x80);
  for (size_t at = kPage; at < kArenaBytes - kPage; ++at) {
    image.push_back(peer_readable(at) ? static_cast<uint8_t>(at * 7 + 1) : marker[at % sizeof(marker)]);
    may_change.push_back(peer_writable(at) ? 1 : 0);
  }
  arena_reset();
}

uint8_t *arena() { return base; }

void arena_reset() { std::memcpy(base + kPage, image.data(), image.size()); }

void add_caches(datadist::Registry &registry) {
  using datadist::kInvalidId;
  auto entry = [](std::vector<size_t> tensors, uint64_t slots, bool remote, bool blocks) {
    auto e = std::make_shared<datadist::CacheEntry>();
    e->spec.num_tensors = static_cast<uint32_t>(tensors.size());
    e->spec.shape = {static_cast<int64_t>(slots), static_cast<int64_t>(kTensorBytes / slots)};
    e->spec.data_type = 4;  // uint8
    e->spec.is_blocks = blocks;
    e->geometry = {kTensorBytes, kTensorBytes / slots, slots};
    for (size_t at : tensors) e->addrs.push_back(base + at);
    e->remote_accessible = remote;
    return e;
  };
  int64_t id;
  registry.add(entry({kCacheA0, kCacheA1}, 4, true, false),
               {{kInvalidId, 1, kInvalidId}, {7, 1, kInvalidId}, {8, 1, kInvalidId}}, std::nullopt, false, id);
  registry.add(entry({kCacheB}, 8, true, true), {}, 3, false, id);
  registry.add(entry({kCacheC}, 4, false, false), {{9, 1, kInvalidId}}, std::nullopt, false, id);
}

void check_arena(const char *target, const std::vector<uint8_t> &answers) {
  if (const size_t at = changed_byte()) {
    std::fprintf(stderr, "%s: arena byte 0x%zx changed\n", target, at);
    std::abort();
  }
  if (holds_marker(answers)) {
    std::fprintf(stderr, "%s: an answer carried memory the peer may not read\n", target);
    std::abort();
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

std::vector<uint8_t> exchange(int fd, const uint8_t *input, size_t size, int idle_ms) {
  std::vector<uint8_t> out;
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  size_t sent = 0;
  bool writing = size != 0;
  if (!writing) ::shutdown(fd, SHUT_WR);
  uint8_t buf[64 * 1024];
  for (;;) {
    pollfd p{fd, static_cast<short>(POLLIN | (writing ? POLLOUT : 0)), 0};
    const int ready = ::poll(&p, 1, writing ? -1 : idle_ms);
    if (ready == 0) return out;  // idle: the other end waits for more
    if (ready < 0) continue;
    if (writing && (p.revents & (POLLOUT | POLLERR | POLLHUP)) != 0) {
      const ssize_t n = ::send(fd, input + sent, size - sent, MSG_NOSIGNAL);
      if (n > 0) sent += static_cast<size_t>(n);
      if (n < 0 && errno != EAGAIN && errno != EINTR) writing = false;  // the other end closed
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

void trace(const std::vector<uint8_t> &answers) {
  using datadist::wire::FrameHeader;
  for (size_t at = 0; at + sizeof(FrameHeader) <= answers.size();) {
    FrameHeader h;
    std::memcpy(&h, answers.data() + at, sizeof(h));
    std::fprintf(stderr, "answer: type %u, op %llu, status %u, body %u, data %llu\n", h.type,
                 static_cast<unsigned long long>(h.op_id), h.status, h.body_len,
                 static_cast<unsigned long long>(h.data_len));
    at += sizeof(h) + h.body_len + h.data_len;
  }
}

}  // namespace dd_fuzz
