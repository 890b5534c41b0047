// Blocking socket helpers for the TCP transport. Every function retries on
// EINTR and never raises SIGPIPE.
#ifndef DATADIST_TRANSPORT_SOCKET_UTIL_H_
#define DATADIST_TRANSPORT_SOCKET_UTIL_H_

#include <sys/types.h>
#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace datadist::tls {
class Session;
}  // namespace datadist::tls

namespace datadist::net {

// A listening socket on ip:port (port 0 picks one); -1 on failure, with the
// reason in `error`.
int listen_tcp(const std::string &ip, uint16_t port, uint16_t &bound_port, std::string &error);

// Connects within timeout_ms; -1 on failure. `timed_out` tells a timeout
// from a refusal. `local_ip`, when not empty, is bound first.
int connect_tcp(const std::string &ip, uint16_t port, const std::string &local_ip, int timeout_ms, bool &timed_out);

// TCP_NODELAY, keepalive and TCP_USER_TIMEOUT so a dead peer is noticed in
// bounded time.
void tune_data_socket(int fd, unsigned user_timeout_ms);

// Bounds blocking reads (0 clears the bound).
void set_receive_timeout(int fd, int timeout_ms);

bool read_full(int fd, void *buf, size_t len);
bool write_full(int fd, const void *buf, size_t len);
// Reads or writes exactly the bytes the iovecs describe; the array is
// consumed (modified) on the way.
bool readv_full(int fd, iovec *iov, size_t count);
bool writev_full(int fd, iovec *iov, size_t count);
// One sendmsg that does not wait: the bytes the socket took (0 when it was
// full), or -1 on an error.
ssize_t writev_now(int fd, const iovec *iov, size_t count);
// Whether the peer has closed or shut down its end (its FIN or a reset has
// arrived), seen at once even with unread bytes still queued; never waits.
bool peer_closed(int fd);
// Drops the first `bytes` bytes of `iov` (already sent).
void drop_front(std::vector<iovec> &iov, size_t bytes);

std::string errno_text();

// Reads a connection's frames, buffered: a frame's header and body (and a
// small frame's data) usually come in with one system call. The reader
// waits in poll for input, never in a blocking read, so it sleeps until
// bytes come: a Unix socket's blocking read is also woken each time the
// peer consumes what this end sent. Reads of `kDirectBytes` or more that the
// buffer does not hold go straight into the caller's memory.
// The *_now forms never wait: they take what has come and say whether that
// was all (kDone), the rest is yet to come (kAgain: the iovecs or the count
// are consumed as far as they were filled), or the stream ended (kEnd).
// One thread at a time reads through a Reader; the descriptor stays the caller's.
// With a TLS session (set_tls, before the first read) the bytes come
// decrypted through it, and what the session holds counts as buffered.
class Reader {
 public:
  enum class Got { kDone, kAgain, kEnd };

  static constexpr size_t kBufferBytes = 32 * 1024;
  static constexpr size_t kDirectBytes = 8 * 1024;

  explicit Reader(int fd) : fd_(fd) {}
  // The session the stream is read through (it outlives the reader's reads).
  void set_tls(tls::Session *session) { tls_ = session; }
  Reader(const Reader &) = delete;
  Reader &operator=(const Reader &) = delete;

  // Each reads exactly what it asks for; false on end of stream or an error.
  bool read(void *buf, size_t len);
  bool readv(iovec *iov, size_t count);  // the array is consumed on the way
  bool discard(uint64_t len);
  Got readv_now(iovec *iov, size_t count);
  // Whether bytes already read wait in the buffer.
  bool buffered() const;
  Got discard_now(uint64_t &len);

 private:
  Got readv_impl(iovec *iov, size_t count, bool wait);
  Got discard_impl(uint64_t &len, bool wait);
  // Takes what has come into the empty buffer, waiting for input if `wait`.
  Got fill(bool wait);
  // Waits until the descriptor is readable (or closed).
  bool wait_readable();

  // One read from the socket (or the session): as recv(MSG_DONTWAIT).
  ssize_t take(void *buf, size_t len);

  const int fd_;
  tls::Session *tls_ = nullptr;
  std::vector<uint8_t> buf_;
  size_t begin_ = 0;
  size_t end_ = 0;
};

}  // namespace datadist::net

#endif  // DATADIST_TRANSPORT_SOCKET_UTIL_H_
