// Link: the established connection set to one peer engine, usable in both
// directions.
//
// Threads: a link has none of its own. The transport's I/O threads
// (io_loop.h) read each connection's frames as they come and write its
// frames as its socket takes them; a frame is also sent by the thread that
// makes it when the socket takes it at once. Device memory, whose copies
// may wait, is staged by the loop's blocking pool, which then reads or
// writes that frame's bytes. submit(), lookup(), fail() may be called from
// any thread. reap() is called once, by the transport's housekeeping
// thread, after fail(): it waits out every thread working for the link and
// only then settles every operation still open, so no byte of a settled
// operation can move afterwards.
// An operation is settled when its frame has left (or was skipped) and
// its answer has come (or the link died).
#ifndef DATADIST_TRANSPORT_LINK_H_
#define DATADIST_TRANSPORT_LINK_H_

#include <sys/uio.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "answer_hub.h"
#include "device/cuda_driver.h"
#include "registry.h"
#include "request.h"
#include "transport/data_path.h"
#include "transport/io_loop.h"
#include "transport/planned_frame.h"
#include "transport/socket_util.h"
#include "transport/target_resolver.h"
#include "transport/tls.h"
#include "transport/wire.h"

namespace datadist {

using Clock = std::chrono::steady_clock;

class Link;

// Refused ordered transfers a link remembers (owner side); past it, the
// oldest is forgotten. A transfer that is refused keeps sending for at most
// its in-flight layers, so only a very old one could come back.
inline constexpr size_t kMaxRefusedGroups = 1024;

// Ordered transfers remembered as refused (by their group); past
// kMaxRefusedGroups the oldest is forgotten. Not locked: its owner's lock
// guards it.
class RefusedGroups {
 public:
  void add(uint64_t group) {
    if (group == 0 || !set_.insert(group).second) return;
    order_.push_back(group);
    if (order_.size() > kMaxRefusedGroups) {
      set_.erase(order_.front());
      order_.pop_front();
    }
  }
  bool has(uint64_t group) const { return group != 0 && set_.count(group) != 0; }
  size_t size() const { return set_.size(); }

 private:
  std::unordered_set<uint64_t> set_;
  std::deque<uint64_t> order_;
};

// What a link needs from the transport that owns it.
class LinkHost {
 public:
  virtual ~LinkHost() = default;
  virtual Registry &registry() = 0;
  // The link has failed or was closed; the host reaps it.
  virtual void link_down(const std::shared_ptr<Link> &link) = 0;
  // The peer unlinks: forget the link now (it closes right after).
  virtual void detach(const std::shared_ptr<Link> &link) = 0;
  // Where the link's answer socket is watched; nullptr: the link has none.
  virtual AnswerHub *answer_hub() { return nullptr; }
  // The threads that read and write the link's frames.
  virtual IoLoop &io_loop() = 0;
  // An operation with this deadline was opened: the host fails the link
  // if it is still open then (overdue()). Called on no lock of the link's.
  virtual void deadline_at(Clock::time_point) {}
};

// A same-host link may have an answer socket beside its connections: each
// end sends its answers without data there, and the other end's hub (see
// answer_hub.h) reads them on the thread that waits for them. An answer the
// socket cannot take at once goes on the connection as before, so either
// end reads answers from both.
//
// The link is the control plane: framing and ordering, the open operations
// and their deadlines, and one sequence per side for every data path
// (data_path.h); `paths` are the link's in the order operations started
// here try them, and the link adds the inline path after them (paths.h,
// inline_path()), which carries every frame. `answers` is the link's
// answer socket (a Unix seqpacket socket; the link owns it), or -1.
class Link : public std::enable_shared_from_this<Link>,
             public AnswerReader,
             public IoHandler,
             private PathHost {
 public:
  // `sessions`: empty, or one TLS session per connection that carries its
  // bytes (established already, or an acceptor's, whose handshake the I/O
  // threads run before anything else on that connection).
  Link(uint64_t peer_id, uint32_t peer_role, bool initiated_here, std::vector<int> fds, LinkHost *host,
       std::vector<std::shared_ptr<DataPath>> paths = {}, int answers = -1,
       std::vector<std::unique_ptr<tls::Session>> sessions = {});
  ~Link();
  Link(const Link &) = delete;
  Link &operator=(const Link &) = delete;

  // Puts the connections in the I/O loop; false (the link is then to be
  // failed) when the loop cannot take one.
  bool start();
  uint64_t peer_id() const override { return peer_id_; }
  uint32_t peer_role() const { return peer_role_; }
  bool initiated_here() const { return initiated_here_; }
  bool is_down() const { return down_.load(std::memory_order_acquire); }
  // How operations started here move their bytes: the name of the first
  // of its paths that they take now ("ucx", "same_host"), else "tcp".
  const char *transport() const;

  // Sends the frames of one operation; each settles `result_index` of
  // `request` (one hold per frame is taken here). `pin` stays alive until
  // every frame has settled. `device`: the frames' local memory is that
  // device's. Each frame goes by the first of the link's paths that carries
  // it (the last, inline on the connections, carries any); one whose owner
  // answers that it cannot serve it that way goes again inline.
  // Frames of a group (their target's `group` is not 0) all take the same
  // connection, so the peer sees them in order.
  void submit(bool write, std::vector<PlannedFrame> frames, const std::shared_ptr<Request> &request,
              size_t result_index, Clock::time_point deadline, std::shared_ptr<const void> pin,
              std::shared_ptr<cuda::Device> device = nullptr);

  // Whether operations on this end's device memory go as frames naming it
  // (no bytes on the connections), as far as the link knows now, and the
  // most bytes one such frame may name.
  bool device_frames_by_reference() const;
  uint64_t device_frame_bytes() const;

  // Asks the peer for the geometry of a cache; blocks up to timeout_ms.
  Status lookup(const wire::Target &target, wire::LookupReply &reply, int timeout_ms);
  // Asks the peer a question that names nothing and does not wait: if no
  // answer has come by `deadline`, the link is overdue (the host fails it).
  // False when the link is down or a probe is already out.
  bool probe(Clock::time_point deadline);
  // Whether the peer has closed any of the link's connections (its FIN or a
  // reset has arrived), though this end's readers may not have seen it yet.
  bool peer_closed() const;
  // Asks the peer to drop its end and waits up to timeout_ms for it.
  Status request_unlink(int timeout_ms);

  // Marks the link down with `reason` (the status its open operations
  // get), shuts its connections and asks the host to reap it. Idempotent.
  void fail(Status reason, const std::string &why);
  // Idempotent; returns once no thread works for the link.
  void reap();

  // True if an open operation is past its deadline.
  bool overdue(Clock::time_point now) const;
  // A connection's TLS handshake must end by `deadline` (an acceptor's:
  // the peer starts it); set before start(). handshake_overdue() is true
  // once it is past and one has not.
  void set_handshake_deadline(Clock::time_point deadline) { handshake_deadline_ = deadline; }
  bool handshake_overdue(Clock::time_point now) const;
  // The earliest deadline of the open operations (and of an unfinished TLS
  // handshake); time_point::max() when there is none.
  Clock::time_point next_deadline() const;
  size_t open_operations() const;
  size_t connection_count() const { return conns_.size(); }
  // Connections that run on Unix sockets (a same-host link that moved to them).
  size_t local_socket_count() const;
  // Whether the link reads answers from an answer socket.
  bool has_answer_socket() const;
  // How its connections are protected: those in TLS, the cipher suite of
  // the first whose handshake ended (empty: none yet), and those whose
  // records the kernel carries (kTLS) both ways.
  struct Security {
    size_t encrypted = 0;
    std::string cipher;
    size_t ktls = 0;
  };
  Security security() const;

  // Reads the answers waiting on the answer socket (AnswerReader); the
  // link's own reads (at its end, before a timeout) count as kLink.
  void read_answers(AnswerHub::Reader by) override;
  // A connection's socket became readable or writable (IoHandler; `tag` is its index).
  void on_ready(uint64_t tag, uint32_t events) override;
  size_t refused_group_count() const;
  // Adds the counters of the link's own staging and of its paths to `out`,
  // by name, counted since the link formed (paths.h's zero_counters names
  // those of paths the link does not have).
  void path_counters(std::map<std::string, uint64_t> &out) const;

 private:
  struct OutFrame {
    wire::FrameHeader header{};
    std::vector<uint8_t> body;
    std::vector<iovec> data;
    std::shared_ptr<const void> pin;
    uint64_t op_id = 0;  // set for frames this end is waiting an answer to
    bool close_after = false;  // the last frame before this end closes
    size_t sent = 0;  // bytes a direct send already put on the socket
    // Set when `data` are addresses of this device: the I/O loop's
    // blocking pool has `path` (which carried or served the frame) stage
    // them (never a direct send).
    std::shared_ptr<cuda::Device> device;
    DataPath *path = nullptr;
  };
  // A path message (wire::FrameType::kPathMessage) carrying `body`.
  static OutFrame path_message(std::vector<uint8_t> body);

  // Where the frame being read is.
  enum class Stage { kHeader, kBody, kData };
  // What reading a connection's input came to.
  enum class InputEnd { kWait, kAway, kStop };

  struct Connection {
    Connection(int socket, std::unique_ptr<tls::Session> session)
        : fd(socket), tls(std::move(session)), secured(tls == nullptr || tls->established()), in(socket) {
      in.set_tls(tls.get());
    }
    const int fd;
    // Set when the connection carries TLS: every byte goes through it.
    const std::unique_ptr<tls::Session> tls;
    // Its handshake has ended (or it has none): frames may be read and written (mu).
    bool secured;
    bool handshake_writes = false;  // the handshake waits to write (mu)
    std::mutex mu;  // guards the output queue and the fields marked (mu)
    std::deque<OutFrame> queue;
    bool busy = false;  // a thread is writing a frame to fd (mu)
    bool running = false;  // an I/O thread runs the connection's handler, which arms it at its end (mu)
    bool away = false;  // the blocking pool reads the input (mu)
    uint32_t armed = 0;  // the events the I/O loop waits for (mu)
    uint64_t io_id = 0;  // the connection's place in the I/O loop
    // Input: read by the connection's handler, or by the blocking pool
    // while `away`; one at a time.
    net::Reader in;
    Stage stage = Stage::kHeader;
    wire::FrameHeader header{};
    std::vector<uint8_t> body;
    iovec part{};  // what is left of the header or body
    std::vector<iovec> data;  // where the rest of the frame's data go
    uint64_t drop = 0;  // data bytes to read and drop after `data`
    std::function<bool()> then;  // once the data are in; false: the link stops reading
    std::function<bool()> receive;  // set by a frame whose data the blocking pool reads
  };

  // The bytes after the frame the connection just read, for the path that
  // serves it or takes its answer (data_path.h).
  class ConnectionData final : public FrameData {
   public:
    ConnectionData(Link &link, Connection &conn) : link_(link), conn_(conn) {}
    void into(std::vector<iovec> to, uint64_t drop, std::function<bool()> then) override;
    void away(std::function<bool(net::Reader &in)> read) override;

   private:
    Link &link_;
    Connection &conn_;
  };

  // A request answered by one frame (lookup, unlink), waited for by its caller.
  struct LookupState {
    wire::LookupReply reply{};
    Status status = llm_datadist::LLM_SUCCESS;
    bool done = false;
  };

  struct OpenOp {
    std::shared_ptr<Request> request;
    size_t result_index = 0;
    Clock::time_point deadline;
    std::shared_ptr<const void> pin;
    std::vector<iovec> recv;  // where answered data lands
    uint64_t recv_bytes = 0;
    bool sent = false;
    bool answered = false;
    bool skipped = false;
    Status status = llm_datadist::LLM_SUCCESS;
    wire::FrameType answer_type = wire::FrameType::kWriteAck;  // the only answer it takes
    std::shared_ptr<cuda::Device> device;  // set when `recv` is memory of this device
    std::string reason;  // the peer's words for a refusal
    std::string failed_here;  // why this end failed it (a device copy)
    std::shared_ptr<LookupState> lookup;  // set for lookups
    // A frame a path carried that its owner may not serve that way: the
    // frame as planned, sent again inline if so.
    std::shared_ptr<PlannedFrame> resend;
    DataPath *path = nullptr;  // the path that carried the frame
    bool write = false;
  };

  // Registers and sends one planned frame (its hold on `request` taken);
  // `exports_ok`: it may go as a same-host frame naming device exports.
  void send_planned(bool write, PlannedFrame &planned, const std::shared_ptr<Request> &request, size_t result_index,
                    Clock::time_point deadline, const std::shared_ptr<const void> &pin,
                    const std::shared_ptr<cuda::Device> &device, bool exports_ok);
  // Queues a frame on the connection, in order, for the I/O loop to write.
  // A frame of at most kDirectBytes (not the last before closing) is sent
  // by the calling thread instead when the connection is idle (nothing
  // queued or being written); what the socket does not take at once is
  // left to the loop. Saves a wake-up on small requests and answers.
  void enqueue(Connection &conn, OutFrame frame);
  // Has the I/O loop wait for what the connection wants now: input unless
  // the blocking pool reads it, output while frames are queued and none is
  // being written (conn.mu held). Left to the handler when one runs. Fails
  // the link when the loop refuses.
  void arm_locked(Connection &conn);
  // Reads and handles the connection's frames until the socket has no more
  // for now (kWait), a frame's input went to the blocking pool (kAway), or
  // the link stopped reading (kStop).
  InputEnd read_input(Connection &conn);
  // The frame's data go into `to`, then `drop` bytes are dropped, then `then` runs.
  static void expect_data(Connection &conn, std::vector<iovec> to, uint64_t drop, std::function<bool()> then);
  // The blocking pool is to read the rest of the frame (`receive`: false
  // when the link stops), then the connection's input until it has no more.
  static void hand_off(Connection &conn, std::function<bool()> receive);
  void receive_away(Connection &conn, std::function<bool()> receive);
  // Back to reading a frame's header.
  static void next_frame(Connection &conn);
  // Runs a step of the connection's TLS handshake (its handler's thread);
  // false when it failed (the link is failed then).
  bool secure(Connection &conn);
  // What the connection's socket takes now of `iov` (as net::writev_now),
  // and all of it, waiting (as net::writev_full): through its TLS session
  // where it has one.
  static ssize_t send_now(Connection &conn, const iovec *iov, size_t count);
  static bool send_all(Connection &conn, iovec *iov, size_t count);
  // Why the connection's input ended, for the link's failure: its TLS
  // session's words when a record failed, else `otherwise`.
  static std::string input_end(const Connection &conn, const char *otherwise);
  // Writes the connection's queued frames without waiting (an I/O thread),
  // until the socket is full or the queue empty; a frame on device memory
  // goes to the blocking pool, which sends it whole.
  void write_queued(Connection &conn);
  // The blocking pool's part: sends a staged frame, then goes back to the queue.
  void write_staged(Connection &conn, OutFrame frame);
  // Whether the frame's operation was cancelled before a byte of it left
  // (then settled as skipped).
  bool cancelled_before_send(const OutFrame &frame);
  // Counts a thread working for the link (false once it is being reaped:
  // the thread must not touch it); reap() waits for the count to drop.
  bool begin_work();
  void end_work();
  // The bytes of a frame, in the order they go out.
  static std::vector<iovec> frame_bytes(OutFrame &frame);
  // Writes the rest of `frame`, blocking; false once the link must stop writing.
  bool finish(Connection &conn, OutFrame &frame);
  // finish() for a frame whose data are device memory: its path copies each
  // chunk into a staging buffer, then it is sent. A copy that fails before
  // the header left fails the operation (or answers the peer with the
  // failure); after, a request is padded and failed here, and an answer
  // fails the link.
  bool finish_staged(Connection &conn, OutFrame &frame);
  // The peer closed a connection after this end asked it to unlink: it
  // closes only once it has dropped its end (and acked on the connection
  // the question took, which another connection's close may overtake), so
  // the question is answered.
  void unlink_answered();
  // Fails an open operation here (its status, unless it has one) with `why`.
  void fail_here(uint64_t op_id, Status status, std::string why);
  // Settles the sending side of a frame written whole (`ok`) or not; false
  // once the link must stop writing.
  bool after_send(OutFrame &frame, bool ok);
  Connection &next_connection();

  bool handle_frame(Connection &conn, const wire::FrameHeader &header, std::vector<uint8_t> &body);
  void serve_lookup(Connection &conn, const wire::FrameHeader &header, const wire::Request &req);
  // A read through a key was served: the owner releases the key once every tensor was read.
  void note_read(const wire::Request &req);
  // The peer's frame, the owner's one sequence for every path: resolves
  // this end's ranges, has `path` check and move the bytes (with `view`,
  // what it read of the frame's trailer, and the bytes that follow the
  // frame, if any), then answers (end_served).
  void serve_by_path(Connection &conn, const wire::FrameHeader &header, wire::Request req, bool write,
                     const std::shared_ptr<DataPath> &path, std::shared_ptr<const void> view);
  // The answer to a frame `path` served: a refusal logged and counted
  // against its ordered transfer (unless the frame goes again inline), a
  // read through a key noted, a read's data after it, the link failed
  // where the peer is gone.
  void end_served(Connection &conn, uint64_t op_id, const ServedFrame &frame, DataPath &path, Moved moved);
  // The path that serves the peer's frame; null if none.
  std::shared_ptr<DataPath> path_serving(const wire::Request &req) const;
  // PathHost.
  Registry &registry() override { return host_->registry(); }
  IoLoop &io_loop() override { return host_->io_loop(); }
  std::function<void(std::vector<uint8_t> body)> messenger() override;
  // Puts the connections in the I/O loop (start()'s first part).
  bool start_connections();
  // A frame a path moved itself was refused here: the rest of its ordered
  // transfer is refused here too (`group` 0: none); and whether it was.
  void refuse_moved(uint64_t group);
  bool moved_refused(uint64_t group) const;
  // An answer from a connection (its data to be read from it) or from the
  // answer socket (`conn` is null).
  bool take_answer(const wire::FrameHeader &header, std::vector<uint8_t> &body, Connection *conn);
  // Sends an answer without data on the answer socket if it takes it now,
  // else on `conn`.
  void send_answer(Connection &conn, OutFrame frame);
  void read_answers_locked(AnswerHub::Reader by);  // answer_mu_ held
  // Stops reading the answer socket and tells the peer (whose answers then
  // come on the connections); answer_mu_ held.
  void close_answers_locked();
  // Sends a question frame; its state is done once answered (or the link is down).
  std::shared_ptr<LookupState> send_question(wire::FrameType type, const std::vector<uint8_t> &body,
                                             Clock::time_point deadline);
  // Sends a question frame and waits for its answer.
  Status ask(wire::FrameType type, const std::vector<uint8_t> &body, int timeout_ms, wire::LookupReply *reply);
  // resolve_request, refusing the rest of a group once one of it was refused.
  Status resolve_in_group(const wire::Request &req, ResolvedTarget &target);
  // The served operation's MemoryUse of each registered cache it pins, each
  // cut by failing this link; LLM_KV_CACHE_NOT_EXIST if one was withdrawn
  // meanwhile.
  Status take_uses(ResolvedTarget &target);
  void refuse_group(uint64_t group);
  // An operation this end serves fails: `why` (logged after `context`) is
  // what the initiator is told, in `out`, and the rest of its ordered
  // transfer `group` is refused too (0: none). Returns `status`.
  Status refuse_served(uint64_t group, Status status, std::string &out, std::string why, const char *context = "");
  // Whether the initiator gave up on the link (its timeout or its cancel
  // closed it) before its operation was served: the link then fails, and
  // no byte moves for it, however long this end was held up before it came
  // to the request.
  bool initiator_gone(const Connection &conn);
  // Marks a side of an open operation done; settles it when both are.
  void mark(uint64_t op_id, bool sent, bool answered, Status status, bool skipped = false, std::string reason = {});
  // An answer to op `op_id` with `status`; a refusal carries `why` as its body.
  static OutFrame answer(wire::FrameType type, uint64_t op_id, Status status, const std::string &why);
  // `ended`: the words for an operation the link's end failed (when the peer gave none).
  void settle(OpenOp &op, const std::string &ended = {});
  // Why the link's open operations end, in words (mu_ held).
  std::string ended_message() const;

  const uint64_t peer_id_;
  const uint32_t peer_role_;
  const bool initiated_here_;
  LinkHost *host_;
  const std::vector<std::shared_ptr<DataPath>> paths_;
  std::vector<std::unique_ptr<Connection>> conns_;
  const int answer_fd_;
  mutable std::mutex answer_mu_;  // one reader of the answer socket at a time
  uint64_t answer_id_ = 0;  // in the hub's set while not 0
  std::atomic<bool> down_{false};
  std::atomic<bool> closing_{false};  // this end asked the peer to unlink
  Clock::time_point handshake_deadline_ = Clock::time_point::max();  // set before start()
  std::atomic<uint64_t> next_conn_{0};

  mutable std::mutex mu_;
  std::condition_variable answered_cv_;
  uint64_t next_op_ = 1;
  std::unordered_map<uint64_t, OpenOp> open_;
  Status down_reason_ = llm_datadist::LLM_LINK_FAILED;
  std::string down_why_;  // what fail() was told, for the operations it ends
  // Owner side: groups refused, the oldest forgotten past kMaxRefusedGroups.
  RefusedGroups refused_groups_;
  // Initiator side: ordered transfers of this end's that a path moving
  // bytes itself refused.
  RefusedGroups moved_refused_;
  std::shared_ptr<LookupState> probe_;  // the probe out, if any
  // Operations (and their bytes) this end sent as frames, and the peer's it served.
  std::atomic<uint64_t> framed_ops_{0}, framed_bytes_{0}, served_ops_{0}, served_bytes_{0};
  bool reaping_ = false;  // no thread may start any more
  size_t working_ = 0;  // I/O threads and blocking jobs working for the link (mu_)
  std::condition_variable work_done_cv_;
  bool reaped_ = false;
};

}  // namespace datadist

#endif  // DATADIST_TRANSPORT_LINK_H_
