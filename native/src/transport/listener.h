// Listener: accepts connections and runs the acceptor's side of their
// handshakes (hello, and with a secret the challenge and the proof), then
// gathers the connections of each link until all have come.
//
// Threads: one listener thread does all of it, every connection
// non-blocking, each with its own deadline (handshake_timeout_ms from its
// accept); a connection that has not finished its handshake by then is
// closed, however it trickles its bytes. A link whose connections have not
// all come by its deadline (from its first one) is dropped. Nothing here
// blocks on a peer. At most max_waiting connections wait for their
// handshake and max_forming links for their connections: a newcomer over
// either cap pushes the oldest out. accept errors that say the process or
// the kernel is short of something (EMFILE, ENFILE, ENOBUFS, ENOMEM) pause
// accepting (10 ms, doubling to 1 s) and never end it.
//
// start() and stop() are called by the owner, not concurrently; stats()
// from any thread. The link callback runs on the listener thread and owns
// the descriptors it is given.
#ifndef DATADIST_TRANSPORT_LISTENER_H_
#define DATADIST_TRANSPORT_LISTENER_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "transport/handshake.h"
#include "transport/wire.h"

namespace datadist {

struct ListenerOptions {
  uint64_t cluster_id = 0;
  std::string auth_key;            // non-empty: every connection proves it first
  uint32_t connections_per_link = 2;  // what the listener grants, whatever a hello asks
  unsigned user_timeout_ms = 10000;
  int handshake_timeout_ms = 5000;
  size_t max_waiting = 256;
  size_t max_forming = 256;
};

// The connections of one link, every handshake done: what the acceptor
// needs to answer them. `fds` are blocking again.
struct FormedLink {
  uint64_t peer_id = 0;
  uint64_t nonce = 0;
  uint32_t role = 0;
  bool authenticated = false;  // the initiator proved the secret
  bool encrypted = false;  // the hello says kEncrypted
  bool certificates = false;  // ... and kCertificates
  uint32_t asked = 0;  // the hello's conn_count; fds.size() is what was granted
  std::vector<int> fds;
  std::vector<std::string> transcripts;  // per connection, what the acceptor's proof covers
  // Per connection, the paths' parts of its hello.
  std::vector<handshake::Parts> parts;
};

struct ListenerStats {
  size_t waiting = 0;        // connections in their handshake now
  size_t forming = 0;        // links waiting for more connections now
  uint64_t accepted = 0;     // connections accepted, ever
  uint64_t evicted = 0;      // closed to make room for newer ones
  uint64_t expired = 0;      // closed at their deadline (connections and links)
  uint64_t accept_pauses = 0;  // accept errors that paused accepting
};

class Listener {
 public:
  using OnLink = std::function<void(FormedLink &)>;
  Listener(ListenerOptions options, OnLink on_link);
  ~Listener();
  Listener(const Listener &) = delete;
  Listener &operator=(const Listener &) = delete;

  // Binds ip:port (0 picks one) and starts the thread; false with `error`.
  bool start(const std::string &ip, uint16_t port, std::string &error);
  // Joins the thread and closes every connection not handed over. Idempotent.
  void stop();
  uint16_t port() const { return port_; }
  ListenerStats stats() const;

 private:
  using Clock = std::chrono::steady_clock;
  enum class Stage { kHello, kProof };
  struct Waiting {
    int fd = -1;
    Clock::time_point deadline;
    Stage stage = Stage::kHello;
    std::string in;  // the frame being read: header, then body
    wire::FrameHeader header{};
    bool have_header = false;
    handshake::Hello hello;
    std::string transcript;
  };
  struct Forming {
    FormedLink link;
    Clock::time_point deadline;
    size_t arrived = 0;
  };
  // What became of a waiting connection: it waits for more bytes, it left
  // the waiting set (closed or handed on), or its handshake is done.
  enum class Next { kWait, kDone, kGreeted };

  void run();
  void accept_ready(Clock::time_point now);
  void admit_connection(int fd, Clock::time_point now);
  // Reads what the connection has; kWait or kDone.
  Next progress(Waiting &w, Clock::time_point now);
  Next hello_read(Waiting &w, const std::string &body);
  Next proof_read(Waiting &w, const std::string &body);
  // The handshake of `w` is done: its connection joins its link.
  void greeted(Waiting &w, Clock::time_point now);
  // Sends `bytes` without waiting (a handshake frame to a socket that holds
  // nothing else), then closes `fd`.
  static void answer_and_close(int fd, const std::string &bytes);
  void expire(Clock::time_point now);
  void close_everything();

  const ListenerOptions options_;
  const OnLink on_link_;
  int listen_fd_ = -1;
  int wake_fd_ = -1;
  uint16_t port_ = 0;
  std::thread thread_;
  std::atomic<bool> stopping_{false};

  // Listener thread only.
  uint64_t next_seq_ = 0;
  std::map<uint64_t, Waiting> waiting_;  // by arrival: the first is the oldest
  std::map<std::pair<uint64_t, uint64_t>, Forming> forming_;  // by (peer id, link nonce)
  std::chrono::milliseconds pause_{0};
  Clock::time_point paused_until_{};

  std::atomic<size_t> waiting_count_{0};
  std::atomic<size_t> forming_count_{0};
  std::atomic<uint64_t> accepted_{0};
  std::atomic<uint64_t> evicted_{0};
  std::atomic<uint64_t> expired_{0};
  std::atomic<uint64_t> accept_pauses_{0};
};

}  // namespace datadist

#endif  // DATADIST_TRANSPORT_LISTENER_H_
