#include "raw_tcp.h"

#include <errno.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <stdexcept>

#include "transport/socket_util.h"

namespace datadist::bench {

namespace {

size_t share_of(size_t bytes, int streams) {
  if (streams < 1 || bytes % static_cast<size_t>(streams) != 0) {
    throw std::invalid_argument("the buffer must split into equal shares over at least one stream");
  }
  return bytes / static_cast<size_t>(streams);
}

// read_full, spinning on non-blocking reads instead of sleeping in recv.
bool spin_read_full(int fd, char *buf, size_t len) {
  while (len > 0) {
    const ssize_t n = ::recv(fd, buf, len, MSG_DONTWAIT);
    if (n > 0) {
      buf += n;
      len -= static_cast<size_t>(n);
    } else if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
      return false;
    }
  }
  return true;
}

constexpr char kUnix[] = "unix";

// An abstract Unix address ("@name" as ss shows it).
sockaddr_un unix_address(const std::string &name, socklen_t &len) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (name.size() + 1 > sizeof(addr.sun_path)) throw std::invalid_argument("unix address too long: " + name);
  std::memcpy(addr.sun_path + 1, name.data(), name.size());
  len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  return addr;
}

int listen_unix(std::string &name) {
  static std::atomic<unsigned> counter{0};
  name = "datadist_aio-bench-" + std::to_string(::getpid()) + "-" + std::to_string(counter++);
  socklen_t len = 0;
  const sockaddr_un addr = unix_address(name, len);
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  if (::bind(fd, reinterpret_cast<const sockaddr *>(&addr), len) != 0 || ::listen(fd, 16) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

int connect_unix(const std::string &name) {
  socklen_t len = 0;
  const sockaddr_un addr = unix_address(name, len);
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd >= 0 && ::connect(fd, reinterpret_cast<const sockaddr *>(&addr), len) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

bool read_all(int fd, char *buf, size_t len, bool busy_poll) {
  return busy_poll ? spin_read_full(fd, buf, len) : net::read_full(fd, buf, len);
}

}  // namespace

RawTcpSink::RawTcpSink(const std::string &ip, char *dest, size_t bytes, int streams, bool busy_poll)
    : dest_(dest),
      share_(share_of(bytes, streams)),
      streams_(streams),
      busy_poll_(busy_poll),
      fds_(static_cast<size_t>(streams), -1) {
  std::string error;
  if (ip == kUnix) {
    std::string name;
    listener_ = listen_unix(name);
    error = net::errno_text();
    address_ = "unix:" + name;
  } else {
    listener_ = net::listen_tcp(ip, 0, port_, error);
    address_ = ip;
  }
  if (listener_ < 0) throw std::runtime_error("raw socket sink cannot listen on " + ip + ": " + error);
  acceptor_ = std::thread([this] { accept_loop(); });
}

RawTcpSink::~RawTcpSink() { close(); }

void RawTcpSink::accept_loop() {
  for (int s = 0; s < streams_; ++s) {
    int fd = ::accept(listener_, nullptr, nullptr);
    if (fd < 0) return;  // closed
    fds_[static_cast<size_t>(s)] = fd;
    char *share = dest_ + static_cast<size_t>(s) * share_;
    receivers_.emplace_back([fd, share, this] {
      const char ack = 'k';
      while (read_all(fd, share, share_, busy_poll_) && net::write_full(fd, &ack, 1)) {
      }
    });
  }
}

void RawTcpSink::close() {
  if (listener_ >= 0) {
    ::shutdown(listener_, SHUT_RDWR);
    if (acceptor_.joinable()) acceptor_.join();
    ::close(listener_);
    listener_ = -1;
  }
  for (int fd : fds_) {
    if (fd >= 0) ::shutdown(fd, SHUT_RDWR);
  }
  for (auto &t : receivers_) t.join();
  receivers_.clear();
  for (int &fd : fds_) {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
}

RawTcpSource::RawTcpSource(const std::string &ip, uint16_t port, const char *src, size_t bytes, int streams,
                           bool busy_poll)
    : src_(src), share_(share_of(bytes, streams)), busy_poll_(busy_poll) {
  for (int s = 0; s < streams; ++s) {
    bool timed_out = false;
    const bool unix_socket = ip.rfind("unix:", 0) == 0;
    int fd = unix_socket ? connect_unix(ip.substr(5)) : net::connect_tcp(ip, port, "", 10000, timed_out);
    if (fd < 0) {
      close();
      throw std::runtime_error("raw socket source cannot connect to " + ip + ":" + std::to_string(port));
    }
    fds_.push_back(fd);
  }
}

RawTcpSource::~RawTcpSource() { close(); }

void RawTcpSource::send_round() {
  if (fds_.size() == 1) {  // the ping-pong: no thread of its own
    char ack = 0;
    if (!net::write_full(fds_[0], src_, share_) || !read_all(fds_[0], &ack, 1, busy_poll_)) {
      throw std::runtime_error("the raw TCP stream broke");
    }
    return;
  }
  std::atomic<bool> ok{true};
  std::vector<std::thread> senders;
  for (size_t s = 0; s < fds_.size(); ++s) {
    senders.emplace_back([this, s, &ok] {
      char ack = 0;
      if (!net::write_full(fds_[s], src_ + s * share_, share_) || !read_all(fds_[s], &ack, 1, busy_poll_)) {
        ok = false;
      }
    });
  }
  for (auto &t : senders) t.join();
  if (!ok) throw std::runtime_error("a raw TCP stream broke");
}

void RawTcpSource::close() {
  for (int fd : fds_) ::close(fd);
  fds_.clear();
}

}  // namespace datadist::bench
