#include "socket_util.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "transport/tls.h"

namespace datadist::net {

namespace {

constexpr size_t kMaxIov = 1024;
constexpr int kListenBacklog = 4096;

bool to_addr(const std::string &ip, uint16_t port, sockaddr_in &addr) {
  std::memset(&addr, 0, sizeof(addr));
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  return ::inet_pton(AF_INET, ip.c_str(), &addr.sin_addr) == 1;
}

// Drops `done` bytes from the front of an iovec array; returns the new start.
size_t advance(iovec *iov, size_t count, size_t start, size_t done) {
  while (start < count && done >= iov[start].iov_len) {
    done -= iov[start].iov_len;
    iov[start].iov_len = 0;  // consumed: a call again with the same array skips it
    ++start;
  }
  if (start < count) {
    iov[start].iov_base = static_cast<uint8_t *>(iov[start].iov_base) + done;
    iov[start].iov_len -= done;
  }
  return start;
}

}  // namespace

std::string errno_text() { return std::strerror(errno); }

int listen_tcp(const std::string &ip, uint16_t port, uint16_t &bound_port, std::string &error) {
  sockaddr_in addr;
  if (!to_addr(ip, port, addr)) {
    error = "not an IPv4 address: " + ip;
    return -1;
  }
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    error = errno_text();
    return -1;
  }
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  // A deep accept queue: hundreds of peers may link at once (the kernel
  // caps it at net.core.somaxconn); a full queue drops their SYNs, which
  // come again only after a second.
  if (::bind(fd, reinterpret_cast<sockaddr *>(&addr), sizeof(addr)) != 0 || ::listen(fd, kListenBacklog) != 0) {
    error = errno_text();
    ::close(fd);
    return -1;
  }
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr *>(&addr), &len);
  bound_port = ntohs(addr.sin_port);
  return fd;
}

int connect_tcp(const std::string &ip, uint16_t port, const std::string &local_ip, int timeout_ms, bool &timed_out) {
  timed_out = false;
  sockaddr_in addr;
  if (!to_addr(ip, port, addr)) return -1;
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return -1;
  sockaddr_in local;
  if (!local_ip.empty() && local_ip != "0.0.0.0" && to_addr(local_ip, 0, local) &&
      ::bind(fd, reinterpret_cast<sockaddr *>(&local), sizeof(local)) != 0) {
    ::close(fd);
    return -1;
  }
  if (::connect(fd, reinterpret_cast<sockaddr *>(&addr), sizeof(addr)) != 0) {
    if (errno != EINPROGRESS) {
      ::close(fd);
      return -1;
    }
    pollfd p{fd, POLLOUT, 0};
    int n;
    do {
      n = ::poll(&p, 1, timeout_ms);
    } while (n < 0 && errno == EINTR);
    int err = 0;
    socklen_t len = sizeof(err);
    if (n == 0) timed_out = true;
    if (n <= 0 || ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0 || err != 0) {
      ::close(fd);
      return -1;
    }
  }
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  return fd;
}

void tune_data_socket(int fd, unsigned user_timeout_ms) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  int idle = 5, interval = 2, count = 3;
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof(interval));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof(count));
  ::setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout_ms, sizeof(user_timeout_ms));
}

void set_receive_timeout(int fd, int timeout_ms) {
  timeval tv{timeout_ms / 1000, (timeout_ms % 1000) * 1000};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
}

bool read_full(int fd, void *buf, size_t len) {
  iovec iov{buf, len};
  return readv_full(fd, &iov, 1);
}

bool write_full(int fd, const void *buf, size_t len) {
  iovec iov{const_cast<void *>(buf), len};
  return writev_full(fd, &iov, 1);
}

bool readv_full(int fd, iovec *iov, size_t count) {
  size_t start = advance(iov, count, 0, 0);
  while (start < count) {
    ssize_t n = ::readv(fd, iov + start, static_cast<int>(std::min(count - start, kMaxIov)));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    start = advance(iov, count, start, static_cast<size_t>(n));
  }
  return true;
}

bool writev_full(int fd, iovec *iov, size_t count) {
  size_t start = advance(iov, count, 0, 0);
  while (start < count) {
    msghdr msg{};
    msg.msg_iov = iov + start;
    msg.msg_iovlen = std::min(count - start, kMaxIov);
    ssize_t n = ::sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    start = advance(iov, count, start, static_cast<size_t>(n));
  }
  return true;
}

ssize_t writev_now(int fd, const iovec *iov, size_t count) {
  msghdr msg{};
  msg.msg_iov = const_cast<iovec *>(iov);
  msg.msg_iovlen = std::min(count, kMaxIov);
  for (;;) {
    ssize_t n = ::sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n >= 0) return n;
    if (errno == EINTR) continue;
    return errno == EAGAIN || errno == EWOULDBLOCK ? 0 : -1;
  }
}

void drop_front(std::vector<iovec> &iov, size_t bytes) {
  const size_t start = advance(iov.data(), iov.size(), 0, bytes);
  iov.erase(iov.begin(), iov.begin() + static_cast<std::ptrdiff_t>(start));
}

bool peer_closed(int fd) {
  pollfd p{fd, POLLRDHUP, 0};
  int n;
  do {
    n = ::poll(&p, 1, 0);
  } while (n < 0 && errno == EINTR);
  return n > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
}

bool Reader::wait_readable() {
  pollfd p{fd_, POLLIN, 0};
  for (;;) {
    const int n = ::poll(&p, 1, -1);
    if (n > 0) return true;
    if (n < 0 && errno != EINTR) return false;
  }
}

bool Reader::buffered() const { return begin_ < end_ || (tls_ != nullptr && tls_->pending()); }

ssize_t Reader::take(void *buf, size_t len) {
  if (tls_ != nullptr) return tls_->read_now(buf, len);
  return ::recv(fd_, buf, len, MSG_DONTWAIT);
}

Reader::Got Reader::fill(bool wait) {
  if (buf_.empty()) buf_.resize(kBufferBytes);
  begin_ = end_ = 0;
  // Waiting, poll first: a reader that has handled every byte it had
  // usually waits for the next frame, and a read that finds nothing would
  // be a wasted call (when frames queue up, one read takes several). A
  // session may hold bytes the socket no longer shows: it is read first.
  bool polled = tls_ != nullptr && tls_->pending();
  for (;;) {
    if (wait && !polled && !wait_readable()) return Got::kEnd;
    polled = false;
    const ssize_t n = take(buf_.data(), buf_.size());
    if (n > 0) {
      end_ = static_cast<size_t>(n);
      return Got::kDone;
    }
    if (n == 0) return Got::kEnd;
    if (errno == EINTR) {
      polled = true;
      continue;
    }
    if (errno != EAGAIN && errno != EWOULDBLOCK) return Got::kEnd;
    if (!wait) return Got::kAgain;
  }
}

bool Reader::read(void *buf, size_t len) {
  iovec iov{buf, len};
  return readv(&iov, 1);
}

bool Reader::readv(iovec *iov, size_t count) { return readv_impl(iov, count, true) == Got::kDone; }

Reader::Got Reader::readv_now(iovec *iov, size_t count) { return readv_impl(iov, count, false); }

bool Reader::discard(uint64_t len) { return discard_impl(len, true) == Got::kDone; }

Reader::Got Reader::discard_now(uint64_t &len) { return discard_impl(len, false); }

Reader::Got Reader::readv_impl(iovec *iov, size_t count, bool wait) {
  size_t start = advance(iov, count, 0, 0);
  while (start < count) {
    if (begin_ < end_) {
      const size_t take = std::min(iov[start].iov_len, end_ - begin_);
      std::memcpy(iov[start].iov_base, buf_.data() + begin_, take);
      begin_ += take;
      start = advance(iov, count, start, take);
      continue;
    }
    size_t left = 0;
    for (size_t i = start; i < count && left < kDirectBytes; ++i) left += iov[i].iov_len;
    if (left < kDirectBytes) {
      const Got got = fill(wait);
      if (got != Got::kDone) return got;
      continue;
    }
    ssize_t n;
    if (tls_ != nullptr) {
      n = tls_->read_now(iov[start].iov_base, iov[start].iov_len);
    } else {
      msghdr msg{};
      msg.msg_iov = iov + start;
      msg.msg_iovlen = std::min(count - start, kMaxIov);
      n = ::recvmsg(fd_, &msg, MSG_DONTWAIT);
    }
    if (n > 0) {
      start = advance(iov, count, start, static_cast<size_t>(n));
    } else if (n == 0) {
      return Got::kEnd;
    } else if (errno == EINTR) {
      continue;
    } else if (errno != EAGAIN && errno != EWOULDBLOCK) {
      return Got::kEnd;
    } else if (!wait) {
      return Got::kAgain;
    } else if (!wait_readable()) {
      return Got::kEnd;
    }
  }
  return Got::kDone;
}

Reader::Got Reader::discard_impl(uint64_t &len, bool wait) {
  while (len > 0) {
    if (begin_ < end_) {
      const size_t take = static_cast<size_t>(std::min<uint64_t>(len, end_ - begin_));
      begin_ += take;
      len -= take;
      continue;
    }
    const Got got = fill(wait);
    if (got != Got::kDone) return got;
  }
  return Got::kDone;
}

}  // namespace datadist::net
