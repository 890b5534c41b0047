// Raw TCP streams: the baseline the benchmark measures the engines against.
//
// A RawTcpSink listens, accepts `streams` connections and gives each a
// thread that reads its share of a destination buffer (stream s owns bytes
// [s * share, (s + 1) * share)) and answers every complete share with one
// byte. A RawTcpSource connects the same number of streams and, per round,
// sends each share from the source buffer on its own thread and waits for
// the answers. No framing, no descriptors: the most a transfer over these
// sockets can reach.
//
// With one stream a round runs on the caller's thread and the sink's
// receiving thread lives as long as the connection: a 4 KiB round is then
// the plain ping-pong a latency baseline needs (write, one-byte answer).
// `busy_poll` makes both ends spin on non-blocking reads instead of
// sleeping in the kernel: the round trip without the cost of waking a
// sleeping thread, at the price of a busy core per side while waiting.
//
// An `ip` of "unix" uses Unix stream sockets instead (an abstract address
// the sink picks; the source connects with that address and port 0): the
// round trip between two processes of one host without the TCP/IP stack.
#ifndef DATADIST_BENCH_RAW_TCP_H_
#define DATADIST_BENCH_RAW_TCP_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

namespace datadist::bench {

class RawTcpSink {
 public:
  // Listens on ip (port chosen by the kernel); throws std::runtime_error.
  RawTcpSink(const std::string &ip, char *dest, size_t bytes, int streams, bool busy_poll = false);
  ~RawTcpSink();
  RawTcpSink(const RawTcpSink &) = delete;
  RawTcpSink &operator=(const RawTcpSink &) = delete;

  uint16_t port() const { return port_; }
  // Where a source connects: the ip given, or the sink's abstract address.
  const std::string &address() const { return address_; }
  // Stops accepting and receiving; joins every thread.
  void close();

 private:
  void accept_loop();

  char *dest_;
  size_t share_;
  int streams_;
  bool busy_poll_;
  int listener_ = -1;
  uint16_t port_ = 0;
  std::string address_;
  std::thread acceptor_;
  std::vector<std::thread> receivers_;
  std::vector<int> fds_;
};

class RawTcpSource {
 public:
  RawTcpSource(const std::string &ip, uint16_t port, const char *src, size_t bytes, int streams,
               bool busy_poll = false);
  ~RawTcpSource();
  RawTcpSource(const RawTcpSource &) = delete;
  RawTcpSource &operator=(const RawTcpSource &) = delete;

  // Sends the whole source buffer once, split over the streams, and returns
  // when the sink has acknowledged every share; throws on a broken stream.
  void send_round();
  void close();

 private:
  const char *src_;
  size_t share_;
  bool busy_poll_;
  std::vector<int> fds_;
};

}  // namespace datadist::bench

#endif  // DATADIST_BENCH_RAW_TCP_H_
