// LinkManager: the links of one engine to its peers, over every path. It
// listens for peers and runs both ends of the handshake (the acceptor's
// admit(), the initiator's link()), in which every kind of path the
// options turn on (paths/paths.h) offers and takes its own part, and which
// settles each link's ordered list of paths; inline on the connections
// takes what none carries. It makes, finds and unlinks links, fails those
// whose operations overran their deadline, and reaps those that went down.
//
// Threads: a Listener thread while listening (handshakes, see listener.h;
// it also answers the links it completes), the I/O loop's threads
// (io_loop.h: a fixed number for every link's frames, which also run the
// timer that fails links whose operations overran their deadline and reads
// answers nobody came for), and one housekeeping thread that reaps links
// that went down. Public methods may be called from any thread; shutdown()
// must be the last call.
//
// Bounds: at most kMaxLinks links (either end starting them); a listener
// grants each link at most its own connections_per_peer connections.
#ifndef DATADIST_TRANSPORT_LINK_MANAGER_H_
#define DATADIST_TRANSPORT_LINK_MANAGER_H_

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
#include "transport/deadline_timer.h"
#include "transport/link.h"
#include "transport/listener.h"
#include "transport/paths/paths.h"

namespace datadist {

struct TransportOptions {
  uint32_t connections_per_peer = 2;
  unsigned user_timeout_ms = 10000;
  // The paths this end offers.
  PathOptions paths;
  // Non-empty: every connection proves this shared secret both ways.
  std::string auth_key;
  // The time an accepted connection has to finish its handshake, and a
  // link to bring all its connections.
  int handshake_timeout_ms = 5000;
  // Where links whose path gave them an answer socket have answers to this
  // end's operations read; nullptr: they come on the link's connections.
  AnswerHub *answers = nullptr;
  // The I/O loop's threads; 0: one per core.
  uint32_t io_threads = 0;
  // Link encryption: every TCP connection of a link runs TLS 1.3 keyed from
  // auth_key, or authenticated by `certs` where set (one of them is), and
  // only peers that encrypt alike are linked.
  bool encrypt = false;
  std::shared_ptr<const tls::CertContexts> certs;
};

// Links per process, as upstream's limit; one more is refused with
// LLM_CLUSTER_NUM_EXCEED_LIMIT.
inline constexpr size_t kMaxLinks = 512;

class LinkManager : public LinkHost {
 public:
  LinkManager(uint64_t cluster_id, uint32_t role, Registry &registry, TransportOptions options);
  ~LinkManager() override;
  LinkManager(const LinkManager &) = delete;
  LinkManager &operator=(const LinkManager &) = delete;

  // Starts every kind of path (PathKind::start); the first that cannot
  // start fails it, with its reason. Before any link.
  Status start_paths();
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
  // The same, with how the link's connections are protected; false without a link.
  bool link_security(uint64_t peer_id, std::string &transport, Link::Security &security) const;
  size_t link_count() const;
  // Called, on no lock of the transport's, with the peer's cluster id when a
  // link is lost: it went down while in use, not removed by an unlink from
  // either end. Set before links exist.
  void set_loss_observer(std::function<void(uint64_t peer_id)> observer) { loss_observer_ = std::move(observer); }
  const std::function<void(uint64_t peer_id)> &loss_observer() const { return loss_observer_; }
  // What the link to `peer_id` runs on, and the ordered transfers its owner
  // side refuses; false without a link. For tests and diagnostics.
  struct LinkStats {
    size_t connections = 0;
    size_t refused_groups = 0;
    size_t local_sockets = 0;  // connections on Unix sockets
    bool answer_socket = false;
    Link::Security security;
    std::map<std::string, uint64_t> paths;  // Link::path_counters()
  };
  bool link_stats(uint64_t peer_id, LinkStats &stats) const;
  ListenerStats listener_stats() const;
  void set_role(uint32_t role) { role_ = role; }

  // Fails every link with `reason`, settles every operation, stops threads.
  void shutdown(Status reason);

  Registry &registry() override { return registry_; }
  void link_down(const std::shared_ptr<Link> &link) override;
  void detach(const std::shared_ptr<Link> &link) override;
  AnswerHub *answer_hub() override { return options_.answers; }
  IoLoop &io_loop() override { return io_loop_; }
  // The timer fires by then.
  void deadline_at(Clock::time_point when) override { timer_->at(when); }

 private:
  // Answers a link whose connections all came (listener thread): refuses
  // it or makes it, then acks every connection.
  void admit(FormedLink &formed);
  // Whether a link from `formed.peer_id` may take the place of `existing`
  // (a link the peer started): with a secret, the newcomer proved it;
  // without one, only once `existing` is down. A live one is probed, so a
  // peer that went away unnoticed is found out and its next link admitted.
  bool may_replace(const std::shared_ptr<Link> &existing, const FormedLink &formed);
  // Every kind's part in one link's handshake with `peer_id`, one per kind
  // (nullptr where a kind takes none).
  using PathTalks = std::vector<std::unique_ptr<PathHandshake>>;
  PathTalks path_talks(uint64_t peer_id, bool acceptor);
  // The kinds' parts of a hello or the ack: `part` of each kind that takes
  // part, under the kind's number, where it is not empty.
  handshake::Parts parts_of(PathTalks &talks, const std::function<std::string(PathHandshake &)> &part);
  // Settles every kind's part from what the peer sent (the hellos' parts at
  // the acceptor, the ack's at the initiator): the kinds that yield last,
  // told whether one before them serves the peer's frames. Not LLM_SUCCESS
  // (with `why`) when the link cannot be made with them.
  Status settle_paths(PathTalks &talks, const FormedLink *hellos, const handshake::Parts *ack, std::string &why);
  // The link's paths, kind by kind in make_kinds' order.
  std::vector<std::shared_ptr<DataPath>> link_paths(PathTalks &talks);
  // Starts the timer (and the answer sweep's watch) unless it runs; false
  // when the kernel refuses them (mu_ held).
  bool start_timer_locked();
  // Makes a started link findable and counts it (mu_ held); false, leaving
  // it out, when it went down already (its peer closed it while it started):
  // link_down() found it in no table then, so no comm heard of the loss, and
  // a dead link kept in the table would refuse every operation toward the
  // peer for good.
  bool publish(uint64_t peer_id, const std::shared_ptr<Link> &link);
  // The initiator's side of one connection's handshake up to the ack: the
  // hello (with the paths' `parts`) and, with a secret, the challenge and
  // the proof. `transcript` gets what the acceptor's proof will cover.
  // `granted` is set when the acceptor answered that it keeps only that
  // many connections (this one past them).
  Status greet(int fd, uint64_t peer_id, uint64_t nonce, uint32_t index, uint32_t count, handshake::Parts parts,
               std::string &transcript, uint32_t &granted);
  // The TLS sessions of a link's connections `fds` (none when the link is
  // not encrypted or runs on local sockets): `server` at the acceptor.
  // Each is keyed from its connection's transcript and the ack's bytes.
  // Empty with `why` when OpenSSL refuses one.
  std::vector<std::unique_ptr<tls::Session>> secure(const std::vector<int> &fds, bool server,
                                                    const std::vector<std::string> &transcripts,
                                                    const std::string &ack, std::string &why);
  // Words for a link the two ends' encryption keeps from being made.
  std::string encryption_differs(uint64_t peer_id, bool peer_encrypts, bool peer_certificates) const;
  // Whether a peer's hello or ack flags say the same encryption as this end.
  bool encrypts_alike(uint32_t flags) const;
  void housekeeping_loop();
  // The timer fired (an I/O thread): reads the answers left unread, fails
  // the links whose operations overran their deadline, and sets the timer
  // for the next deadline of the others (none open: it stays disarmed).
  void on_timer();
  void reap_down_links();
  // Reaps the links to `peer_id` that went down (whatever their paths
  // started has ended) before a new link to that peer moves bytes.
  void reap_down_links_of(uint64_t peer_id);
  void reap(const std::vector<std::shared_ptr<Link>> &links);

  const uint64_t cluster_id_;
  std::atomic<uint32_t> role_;
  Registry &registry_;
  const TransportOptions options_;
  IoLoop io_loop_;  // outlives every link: shutdown() reaps them all
  // Every kind of path the options turn on (make_kinds), stopped by
  // shutdown() once every link is reaped.
  std::vector<std::unique_ptr<PathKind>> kinds_;
  // Deadlines and the answer sweep, in io_loop_ from the first link until
  // shutdown(); set once (mu_), before any link exists.
  std::shared_ptr<DeadlineTimer> timer_;
  class AnswerWatch;
  std::shared_ptr<AnswerWatch> answer_watch_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint64_t, std::shared_ptr<Link>> links_;
  std::set<uint64_t> linking_;
  std::vector<std::shared_ptr<Link>> down_;
  // Every link made and not reaped yet, whatever state it is in: shutdown()
  // reaps them all, so no link thread outlives the transport.
  std::vector<std::shared_ptr<Link>> made_;
  // Per peer, for links_made(); at most kMaxMadeCounts peers, those without
  // a link forgotten first.
  std::map<uint64_t, uint64_t> made_count_;
  uint64_t generation_ = 0;
  std::function<void(uint64_t)> loss_observer_;
  bool stopping_ = false;

  std::unique_ptr<Listener> listener_;
  uint16_t listen_port_ = 0;
  std::string listen_ip_;
  std::thread housekeeping_;
};

}  // namespace datadist

#endif  // DATADIST_TRANSPORT_LINK_MANAGER_H_
