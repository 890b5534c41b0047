// TcpTransport: listens for peers, establishes and tears down links, and
// watches open operations for their deadlines.
//
// Threads: an accept thread while listening, and one housekeeping thread
// that reaps links that went down and fails links whose operations overran
// sync_kv_timeout. Public methods may be called from any thread; shutdown()
// must be the last call.
#ifndef DATADIST_TRANSPORT_TCP_TRANSPORT_H_
#define DATADIST_TRANSPORT_TCP_TRANSPORT_H_

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "registry.h"
#include "transport/link.h"

namespace datadist {

struct TransportOptions {
  uint32_t connections_per_peer = 2;
  unsigned user_timeout_ms = 10000;
  // Offer the same-host path (kernel copies) to peers on this host.
  bool same_host = true;
  // Non-empty: every connection proves this shared secret both ways.
  std::string auth_key;
};

class TcpTransport : public LinkHost {
 public:
  TcpTransport(uint64_t cluster_id, uint32_t role, Registry &registry, TransportOptions options);
  ~TcpTransport() override;
  TcpTransport(const TcpTransport &) = delete;
  TcpTransport &operator=(const TcpTransport &) = delete;

  // Starts listening; the bound port is listen_port().
  Status listen(const std::string &ip, uint16_t port);
  void stop_listening();
  uint16_t listen_port() const;
  const std::string &listen_ip() const { return listen_ip_; }

  Status link(uint64_t peer_id, const std::string &ip, uint16_t port, const std::string &local_ip, int timeout_ms);
  // Drops the link; without `force` the peer is asked to drop its end first
  // and the call waits (up to timeout_ms) until it has.
  Status unlink(uint64_t peer_id, bool force, int timeout_ms);
  std::shared_ptr<Link> find(uint64_t peer_id) const;
  // How many links with `peer_id` were ever established (either end
  // starting them): a link that came and went between two looks is seen.
  uint64_t links_made(uint64_t peer_id) const;
  // The peer's path as Link::transport() names it; nullptr without a link.
  const char *link_transport(uint64_t peer_id) const;
  size_t link_count() const;
  // Called, on no lock of the transport's, with the peer's cluster id when a
  // link is lost: it went down while in use, not removed by an unlink from
  // either end. Set before links exist.
  void set_loss_observer(std::function<void(uint64_t peer_id)> observer) { loss_observer_ = std::move(observer); }
  void set_role(uint32_t role) { role_ = role; }

  // Tells the housekeeping thread that operations with deadlines are open.
  void operations_started();
  // Fails every link with `reason`, settles every operation, stops threads.
  void shutdown(Status reason);

  Registry &registry() override { return registry_; }
  void link_down(const std::shared_ptr<Link> &link) override;
  void detach(const std::shared_ptr<Link> &link) override;
  same_host::CopyPool &copy_pool() override { return copy_pool_; }

 private:
  struct Forming {
    std::vector<int> fds;
    uint32_t role = 0;
    std::vector<std::string> transcripts;  // per connection, what its proofs cover
    bool offers_same_host = false;
    wire::SameHostInfo same_host{};
    size_t arrived = 0;
    Clock::time_point started;
  };

  void accept_loop(int listen_fd);
  void accept_one(int fd);
  void admit(uint64_t peer_id, uint64_t nonce);
  // The initiator's side of one connection's handshake up to the ack: the
  // hello and, with a secret, the challenge and the proof. `transcript`
  // gets what the acceptor's proof will cover.
  Status greet(int fd, uint64_t peer_id, uint64_t nonce, uint32_t index, uint32_t count, std::string &transcript);
  // Probes a peer that offered the same-host path; the memory to serve its
  // same-host frames with, or nullptr when it cannot be reached.
  std::shared_ptr<same_host::PeerMemory> reach(uint64_t peer_id, const wire::SameHostInfo &info);
  void housekeeping_loop();
  void reap_down_links();
  void reap(const std::vector<std::shared_ptr<Link>> &links);

  const uint64_t cluster_id_;
  std::atomic<uint32_t> role_;
  Registry &registry_;
  const TransportOptions options_;
  same_host::CopyPool copy_pool_;
  std::atomic<bool> refusal_logged_{false};  // the kernel refused same-host copies

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint64_t, std::shared_ptr<Link>> links_;
  std::set<uint64_t> linking_;
  std::map<std::pair<uint64_t, uint64_t>, Forming> forming_;
  std::vector<std::shared_ptr<Link>> down_;
  // Every link made and not reaped yet, whatever state it is in: shutdown()
  // reaps them all, so no link thread outlives the transport.
  std::vector<std::shared_ptr<Link>> made_;
  std::map<uint64_t, uint64_t> made_count_;  // per peer, for links_made()
  uint64_t generation_ = 0;
  std::function<void(uint64_t)> loss_observer_;
  bool stopping_ = false;
  bool housekeeper_idle_ = false;  // waiting with no deadline to watch

  int listen_fd_ = -1;
  uint16_t listen_port_ = 0;
  std::string listen_ip_;
  std::thread accept_thread_;
  std::thread housekeeping_;
};

}  // namespace datadist

#endif  // DATADIST_TRANSPORT_TCP_TRANSPORT_H_
