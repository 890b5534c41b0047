#include "transport/paths/same_host/same_host.h"

#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <random>
#include <system_error>

#include "thread_name.h"

// The same numbers on every architecture (the unified system call table).
#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif

namespace datadist::same_host {

namespace {

constexpr char kProbeMagic[8] = {'D', 'D', 'A', 'O', 'P', 'R', 'B', '1'};
constexpr size_t kMaxIov = 1024;               // IOV_MAX: per call, on each side
constexpr uint64_t kSplitBytes = 1ull << 20;  // smallest share of a copy worth another thread

struct Probe24 {
  uint8_t bytes[sizeof(Info::probe)];
};

// The probe buffer: the magic, then a random token no other process knows.
const Probe24 &probe_buffer() {
  static const Probe24 buffer = [] {
    Probe24 b{};
    std::memcpy(b.bytes, kProbeMagic, sizeof(kProbeMagic));
    std::random_device rd;
    for (size_t i = sizeof(kProbeMagic); i < sizeof(b.bytes); i += 4) {
      const uint32_t v = rd();
      std::memcpy(b.bytes + i, &v, 4);
    }
    return b;
  }();
  return buffer;
}

// The kernel's boot id as 16 bytes; all zero if unreadable.
std::array<uint8_t, 16> read_boot_id() {
  std::array<uint8_t, 16> id{};
  FILE *f = std::fopen("/proc/sys/kernel/random/boot_id", "re");
  if (f == nullptr) return id;
  char text[64] = {};
  const bool ok = std::fgets(text, sizeof(text), f) != nullptr;
  std::fclose(f);
  if (!ok) return id;
  size_t n = 0;
  for (const char *p = text; *p != '\0' && n < 32; ++p) {
    int v;
    if (*p >= '0' && *p <= '9') {
      v = *p - '0';
    } else if (*p >= 'a' && *p <= 'f') {
      v = *p - 'a' + 10;
    } else {
      continue;
    }
    id[n / 2] = static_cast<uint8_t>(id[n / 2] | (n % 2 == 0 ? v << 4 : v));
    ++n;
  }
  if (n != 32) id.fill(0);
  return id;
}

bool all_zero(const uint8_t *p, size_t n) {
  return std::all_of(p, p + n, [](uint8_t b) { return b == 0; });
}

}  // namespace

SocketPair make_socket_pair(int type) {
  int fds[2];
  if (::socketpair(AF_UNIX, type | SOCK_CLOEXEC, 0, fds) != 0) return {};
  return {fds[0], fds[1]};
}

void close_pair(SocketPair &pair) {
  for (int *fd : {&pair.mine, &pair.theirs}) {
    if (*fd >= 0) ::close(*fd);
    *fd = -1;
  }
}

int take_descriptor(pid_t pid, uint32_t number, std::string &why) {
  const int pidfd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
  if (pidfd < 0) {
    why = std::string("pidfd_open: ") + std::strerror(errno);
    return -1;
  }
  // pidfd_getfd sets close-on-exec on the descriptor it makes.
  const int fd = static_cast<int>(::syscall(SYS_pidfd_getfd, pidfd, number, 0));
  const int error = errno;
  ::close(pidfd);
  if (fd < 0) {
    why = std::string("pidfd_getfd: ") + std::strerror(error);
    return -1;
  }
  return fd;
}

int take_socket(pid_t pid, uint32_t number, std::string &why, int type) {
  const int fd = take_descriptor(pid, number, why);
  if (fd < 0) return -1;
  int domain = 0, actual = 0;
  ucred cred{};
  socklen_t len = sizeof(domain);
  bool ok = ::getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &domain, &len) == 0 && domain == AF_UNIX;
  len = sizeof(actual);
  ok = ok && ::getsockopt(fd, SOL_SOCKET, SO_TYPE, &actual, &len) == 0 && actual == type;
  len = sizeof(cred);
  ok = ok && ::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0 && cred.pid == pid;
  if (!ok) {
    ::close(fd);
    why = "descriptor " + std::to_string(number) + " is not a Unix " +
          (type == SOCK_STREAM ? "stream" : "seqpacket") + " socket made by process " + std::to_string(pid);
    return -1;
  }
  return fd;
}

const Info &local_info() {
  static const std::array<uint8_t, 16> boot_id = read_boot_id();
  // The pid is read on every call: a forked child is another process.
  thread_local Info info{};
  std::memcpy(info.boot_id, boot_id.data(), sizeof(info.boot_id));
  info.pid = static_cast<uint64_t>(::getpid());
  info.probe_addr = reinterpret_cast<uintptr_t>(probe_buffer().bytes);
  std::memcpy(info.probe, probe_buffer().bytes, sizeof(info.probe));
  return info;
}

Probe probe(const Info &peer, std::string &why) {
  const Info &self = local_info();
  if (all_zero(self.boot_id, sizeof(self.boot_id)) ||
      std::memcmp(self.boot_id, peer.boot_id, sizeof(self.boot_id)) != 0) {
    why = "another host";
    return Probe::kOtherHost;
  }
  if (std::memcmp(peer.probe, kProbeMagic, sizeof(kProbeMagic)) != 0 || peer.pid == 0 ||
      peer.pid > static_cast<uint64_t>(INT32_MAX)) {
    why = "malformed same-host offer";
    return Probe::kMismatch;
  }
  Probe24 read{};
  iovec local{read.bytes, sizeof(read.bytes)};
  iovec remote{reinterpret_cast<void *>(static_cast<uintptr_t>(peer.probe_addr)), sizeof(read.bytes)};
  const ssize_t n = ::process_vm_readv(static_cast<pid_t>(peer.pid), &local, 1, &remote, 1, 0);
  if (n < 0) {
    why = std::string("process_vm_readv: ") + std::strerror(errno);
    return errno == EPERM ? Probe::kRefused : Probe::kMismatch;
  }
  if (static_cast<size_t>(n) != sizeof(read.bytes) || std::memcmp(read.bytes, peer.probe, sizeof(read.bytes)) != 0) {
    why = "the peer's probe buffer did not read back";
    return Probe::kMismatch;
  }
  return Probe::kReachable;
}

PeerMemory::PeerMemory(pid_t pid) : pid_(pid) {
  std::lock_guard<std::mutex> lock(mu_);
  reload();
}

void PeerMemory::reload() {
  readable_.clear();
  writable_.clear();
  const std::string path = "/proc/" + std::to_string(pid_) + "/maps";
  FILE *f = std::fopen(path.c_str(), "re");
  if (f == nullptr) return;
  char line[512];
  auto add = [](Spans &spans, uintptr_t start, uintptr_t end) {
    if (!spans.empty() && spans.back().second == start) {
      spans.back().second = end;
    } else {
      spans.emplace_back(start, end);
    }
  };
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    unsigned long start = 0, end = 0;
    char perms[8] = {};
    if (std::sscanf(line, "%lx-%lx %7s", &start, &end, perms) == 3 && start < end) {
      if (perms[0] == 'r') add(readable_, start, end);
      if (perms[1] == 'w') add(writable_, start, end);
    }
    // A line longer than the buffer: skip the rest of it.
    while (std::strchr(line, '\n') == nullptr && std::fgets(line, sizeof(line), f) != nullptr) {
    }
  }
  std::fclose(f);
}

bool PeerMemory::covered(const Spans &spans, const wire::Segment &s) {
  // The last span starting at or before the segment.
  auto it = std::upper_bound(spans.begin(), spans.end(), std::make_pair(static_cast<uintptr_t>(s.addr), UINTPTR_MAX));
  if (it == spans.begin()) return false;
  --it;
  return s.addr >= it->first && s.addr + s.length <= it->second;
}

bool PeerMemory::mapped(const std::vector<wire::Segment> &segments, bool for_write) {
  std::lock_guard<std::mutex> lock(mu_);
  for (int attempt = 0; attempt < 2; ++attempt) {
    const Spans &spans = for_write ? writable_ : readable_;
    const bool all = std::all_of(segments.begin(), segments.end(), [&](const wire::Segment &s) {
      return covered(spans, s);
    });
    if (all) return true;
    if (attempt == 0) reload();  // the peer may have mapped memory since
  }
  return false;
}

int PeerMemory::copy(const iovec *local, const iovec *remote, size_t count, bool from_peer) const {
  for (size_t at = 0; at < count; at += kMaxIov) {
    const size_t n = std::min(kMaxIov, count - at);
    size_t expected = 0;
    for (size_t i = at; i < at + n; ++i) expected += local[i].iov_len;
    const ssize_t done = from_peer ? ::process_vm_readv(pid_, local + at, n, remote + at, n, 0)
                                   : ::process_vm_writev(pid_, local + at, n, remote + at, n, 0);
    if (done < 0) return errno;
    if (static_cast<size_t>(done) != expected) return EFAULT;  // stopped at a fault
  }
  return 0;
}

struct CopyPool::Batch {
  size_t count = 0;
  const std::function<void(size_t)> *job = nullptr;
  std::atomic<size_t> next{0};
  std::mutex mu;
  std::condition_variable cv;
  size_t finished = 0;
};

CopyPool::CopyPool(size_t helpers)
    : helpers_(helpers != 0 ? helpers : std::max<size_t>(1, std::min<size_t>(std::thread::hardware_concurrency(), 8)) - 1) {}

CopyPool::~CopyPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (auto &t : threads_) t.join();
}

void CopyPool::work_on(Batch &batch) {
  for (;;) {
    const size_t i = batch.next.fetch_add(1, std::memory_order_relaxed);
    if (i >= batch.count) return;
    (*batch.job)(i);
    std::lock_guard<std::mutex> lock(batch.mu);
    if (++batch.finished == batch.count) batch.cv.notify_all();
  }
}

void CopyPool::helper_loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stopping_ || !batches_.empty(); });
    if (stopping_) return;
    std::shared_ptr<Batch> batch = batches_.front();
    // A batch whose every job has been claimed leaves the queue.
    if (batch->next.load(std::memory_order_relaxed) + 1 >= batch->count) batches_.pop_front();
    lock.unlock();
    work_on(*batch);
    lock.lock();
  }
}

void CopyPool::run(size_t count, const std::function<void(size_t)> &job) {
  if (count == 0) return;
  if (count == 1 || helpers_ == 0) {
    for (size_t i = 0; i < count; ++i) job(i);
    return;
  }
  auto batch = std::make_shared<Batch>();
  batch->count = count;
  batch->job = &job;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // A thread that cannot be had leaves the work to the caller.
    try {
      while (threads_.size() < helpers_) threads_.emplace_back([this] {
        name_this_thread("dd-copy");
        helper_loop();
      });
    } catch (const std::system_error &) {
    }
    batches_.push_back(batch);
  }
  cv_.notify_all();
  work_on(*batch);
  {
    std::lock_guard<std::mutex> lock(mu_);
    batches_.erase(std::remove(batches_.begin(), batches_.end(), batch), batches_.end());
  }
  std::unique_lock<std::mutex> lock(batch->mu);
  batch->cv.wait(lock, [&] { return batch->finished == batch->count; });
}

int copy_pairs(PeerMemory &memory, CopyPool *pool, const std::vector<iovec> &local,
               const std::vector<wire::Segment> &remote, bool from_peer) {
  uint64_t total = 0;
  for (const iovec &v : local) total += v.iov_len;
  const size_t threads = pool != nullptr ? pool->threads() : 1;
  const size_t parts = static_cast<size_t>(std::clamp<uint64_t>(total / kSplitBytes, 1, threads));
  // Each part: its own pairs, cut so every part carries about total / parts bytes.
  std::vector<std::vector<iovec>> mine(parts), theirs(parts);
  const uint64_t share = (total + parts - 1) / parts;
  size_t part = 0;
  uint64_t filled = 0;
  for (size_t i = 0; i < local.size(); ++i) {
    auto *l = static_cast<uint8_t *>(local[i].iov_base);
    uint64_t r = remote[i].addr;
    uint64_t left = local[i].iov_len;
    while (left > 0) {
      const uint64_t take = std::min(left, part + 1 < parts ? share - filled : left);
      mine[part].push_back({l, take});
      theirs[part].push_back({reinterpret_cast<void *>(static_cast<uintptr_t>(r)), take});
      l += take;
      r += take;
      left -= take;
      filled += take;
      if (filled == share && part + 1 < parts) {
        ++part;
        filled = 0;
      }
    }
  }
  std::atomic<int> error{0};
  const auto copy_part = [&](size_t p) {
    if (mine[p].empty()) return;
    const int e = memory.copy(mine[p].data(), theirs[p].data(), mine[p].size(), from_peer);
    int none = 0;
    if (e != 0) error.compare_exchange_strong(none, e);
  };
  if (pool != nullptr) {
    pool->run(parts, copy_part);
  } else {
    copy_part(0);
  }
  return error.load();
}

}  // namespace datadist::same_host
