#include "raw_tcp.h"

#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
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

}  // namespace

RawTcpSink::RawTcpSink(const std::string &ip, char *dest, size_t bytes, int streams)
    : dest_(dest), share_(share_of(bytes, streams)), streams_(streams), fds_(static_cast<size_t>(streams), -1) {
  std::string error;
  listener_ = net::listen_tcp(ip, 0, port_, error);
  if (listener_ < 0) throw std::runtime_error("raw TCP sink cannot listen on " + ip + ": " + error);
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
      while (net::read_full(fd, share, share_) && net::write_full(fd, &ack, 1)) {
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

RawTcpSource::RawTcpSource(const std::string &ip, uint16_t port, const char *src, size_t bytes, int streams)
    : src_(src), share_(share_of(bytes, streams)) {
  for (int s = 0; s < streams; ++s) {
    bool timed_out = false;
    int fd = net::connect_tcp(ip, port, "", 10000, timed_out);
    if (fd < 0) {
      close();
      throw std::runtime_error("raw TCP source cannot connect to " + ip + ":" + std::to_string(port));
    }
    fds_.push_back(fd);
  }
}

RawTcpSource::~RawTcpSource() { close(); }

void RawTcpSource::send_round() {
  std::atomic<bool> ok{true};
  std::vector<std::thread> senders;
  for (size_t s = 0; s < fds_.size(); ++s) {
    senders.emplace_back([this, s, &ok] {
      char ack = 0;
      if (!net::write_full(fds_[s], src_ + s * share_, share_) || !net::read_full(fds_[s], &ack, 1)) ok = false;
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
