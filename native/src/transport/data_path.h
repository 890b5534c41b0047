// DataPath: a way an operation's bytes move. The frame carries them on the
// link's connections (the inline path, paths/inline/, every link's last),
// or names the initiator's memory and the peer copies it with one kernel
// call (same host), copies device memory it opened (CUDA IPC), or gets and
// puts it (UCX); or no frame goes, the initiator moving the bytes itself
// under the owner's grant (one-sided: move()).
//
// The link (link.h) keeps the control plane (framing and ordering, the
// open operations, the answers) and runs one sequence on each side for
// every path:
//  - initiator: a frame goes by the first path of the link's list that
//    carries it (carry()). An owner that answers that it cannot serve a
//    frame its path carried (LLM_FEATURE_NOT_ENABLED, no data) has it sent
//    again by the inline path, the path told first (refused()).
//  - owner: a frame goes to the path that serves it (serves()). The link
//    resolves this end's own ranges first; the path checks what the peer
//    named against what the peer proved (its mappings, exports or keys)
//    and moves the bytes; the link answers. Refusals are logged, counted
//    against their ordered transfer and answered by the link, once for
//    every path.
// A path owns its state and counters, and lets go of what it holds of the
// peer when the link is reaped. The list of paths a link has is settled by
// the handshake, where each kind of path takes its own part (paths/paths.h).
#ifndef DATADIST_TRANSPORT_DATA_PATH_H_
#define DATADIST_TRANSPORT_DATA_PATH_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "device/staging.h"
#include "transport/planned_frame.h"
#include "transport/socket_util.h"
#include "transport/target_resolver.h"
#include "transport/wire.h"

namespace datadist {

class IoLoop;
class Registry;
namespace cuda {
class Device;
}

// What a path may ask of the link it serves.
class PathHost {
 public:
  virtual ~PathHost() = default;
  virtual uint64_t peer_id() const = 0;
  virtual Registry &registry() = 0;
  virtual IoLoop &io_loop() = 0;
  // Sends a path message (wire::FrameType::kPathMessage) to the peer's end
  // of the link, after the messages sent before it; from any thread, while
  // the link is there (nothing once it is gone).
  virtual std::function<void(std::vector<uint8_t> body)> messenger() = 0;
};

// Fails the link with `why`, from any thread, while the link is there (a
// path's own transport lost the peer); nothing once it is gone.
using LinkFailer = std::function<void(const std::string &why)>;

// The bytes that follow a frame's header and body on the link's connection
// (a frame whose path carries its bytes): the path that serves the frame,
// or takes its answer, reads them before the connection reads its next
// frame. Good for the call it is given in, which sets how they are read.
class FrameData {
 public:
  virtual ~FrameData() = default;
  // The connection's I/O thread reads them into `to` (host memory) and
  // drops `drop` bytes after them; then `then` runs (false: the link stops
  // reading).
  virtual void into(std::vector<iovec> to, uint64_t drop, std::function<bool()> then) = 0;
  // A thread of the I/O loop's blocking pool reads them with `read`, from
  // the connection's stream (device memory, whose copies may wait), and
  // then the connection's next frames; `read` returning false: the stream
  // ended or failed, and the link fails.
  virtual void away(std::function<bool(net::Reader &in)> read) = 0;
};

// How a path carries one frame at the initiator.
struct Carried {
  // The frame carries its bytes on the connections (a write's after its
  // body, a read's after its answer): the inline path's frames.
  bool bytes_follow = false;
  // The trailer the path adds to the frame (wire::kPathTrailer; none when
  // empty): what the owner's path needs to reach the initiator's memory
  // (export handles, keys), read by the path numbered `trailer_path`.
  uint16_t trailer_path = 0;
  std::vector<uint8_t> trailer;
  // The owner may answer that it cannot serve the frame this way: it is
  // then sent again inline.
  bool may_resend = false;
};

// How a path ended a frame it served.
struct Moved {
  Status status = llm_datadist::LLM_SUCCESS;
  // The words the initiator is told when `status` is not LLM_SUCCESS.
  std::string why;
  // Logged before `why` with a refusal of the transfer.
  const char *context = "";
  // Not a refusal of the transfer: the initiator sends the frame again
  // inline (LLM_FEATURE_NOT_ENABLED; nothing moved, nothing logged, its
  // ordered transfer goes on).
  bool again_inline = false;
  // The peer's process is gone: the link fails, nothing is answered.
  bool peer_gone = false;
  // A read served by a path that carries bytes: its `data_bytes` of data,
  // this end's memory (of `device`, else host memory), follow the answer
  // on the connection; `pin` holds that memory until they have left.
  std::vector<iovec> data;
  uint64_t data_bytes = 0;
  std::shared_ptr<cuda::Device> device;
  std::shared_ptr<const void> pin;

  // A refusal of the operation (and the rest of its ordered transfer).
  static Moved refusal(Status status, std::string why, const char *context = "") {
    Moved m;
    m.status = status;
    m.why = std::move(why);
    m.context = context;
    return m;
  }
  // This end cannot serve the frame this way: sent again inline.
  static Moved inline_instead(std::string why) {
    Moved m = refusal(llm_datadist::LLM_FEATURE_NOT_ENABLED, std::move(why));
    m.again_inline = true;
    return m;
  }
};

// One frame a path serves: the peer's request, this end's ranges as the
// link resolved them (its pins keep the memory while bytes move), and the
// call that ends it.
struct ServedFrame {
  wire::Request req;
  bool write = false;  // the peer's write: this end's memory is the destination
  ResolvedTarget target;
  // Answers the frame; called once, from any thread but one that may not
  // let go of memory (the CUDA driver's): a read that releases a key may.
  // The frame's memory is let go when the last pointer to it goes.
  std::function<void(Moved)> done;
  // The link, alive while the frame is.
  std::shared_ptr<void> keep;
  // What the path read of the frame's trailer (DataPath::read_trailer).
  std::shared_ptr<const void> view;
  // The write's bytes on the connection, for a path that carries bytes;
  // good during serve() only, which sets how they are read.
  FrameData *data = nullptr;
};

// One-sided moves of host memory run whole on the thread that starts the
// operation for a read whose operation (all its frames) is at most
// kReadHereBytes, and for a write frame of at most kWriteHereBytes; the
// others go to the I/O loop's blocking pool. A read's caller waits for its
// bytes anyway, and holds a core already: handed to another thread, the
// move would first wait for that thread to get one, milliseconds on a busy
// host. A write's caller (a forward pushing its layers) goes on beside the
// move. Past those sizes the caller would wait on its own move too long.
constexpr uint64_t kReadHereBytes = 8 << 20;
constexpr uint64_t kWriteHereBytes = 64 << 10;
// Whether a one-sided move of `planned` (a write of `bytes`) runs on the
// calling thread.
inline bool moves_here(bool write, uint64_t bytes, const PlannedFrame &planned) {
  return write ? bytes <= kWriteHereBytes : planned.operation_bytes <= kReadHereBytes;
}

// How a path that moved an operation's bytes itself ended it (one-sided):
// LLM_SUCCESS, or a failure and the words the operation fails with.
using Settle = std::function<void(Status status, std::string why)>;

enum class Carry {
  kCarries,  // this path takes the frame
  kNext,     // not this path's: the next one in the list may
  kInline,   // this path should, and cannot: the inline path, no other
};

class DataPath {
 public:
  virtual ~DataPath() = default;
  // What Link::transport() says when the link's operations take this path.
  virtual const char *name() const = 0;
  // Called once by the link's start, before any frame.
  virtual void start(PathHost &host, LinkFailer fail) {
    (void)fail;
    host_ = &host;
  }

  // -- initiator ---------------------------------------------------------
  // Whether operations started here take this path now (the first active
  // path of the list names the link's transport).
  virtual bool active() const = 0;
  // Whether frames of this end's device memory go as frames naming it (no
  // bytes): 1 yes, 0 no, -1 not this path's to say (the next one's).
  virtual int device_by_reference() const { return -1; }
  // The most bytes one frame naming this end's device memory may name.
  virtual uint64_t device_frame_bytes() const { return wire::kMaxFrameData; }
  // Whether and how this path carries `planned`, whose memory is `device`'s
  // (or host memory); `exports_ok` is false for a frame sent again inline;
  // `body_bytes` is the request's body without the path's part.
  virtual Carry carry(const PlannedFrame &planned, const cuda::Device *device, bool exports_ok, size_t body_bytes,
                      Carried &out) = 0;
  // One-sided: whether this path moves `planned`'s bytes itself, with no
  // frame to the owner (the owner granted it the cache; the grant's
  // geometry is checked here as the owner would). When it takes the frame
  // (true), `settle` is called once, from any thread; else the frame goes
  // by carry() as before.
  virtual bool move(bool write, const PlannedFrame &planned, const std::shared_ptr<cuda::Device> &device,
                    const Settle &settle) {
    (void)write;
    (void)planned;
    (void)device;
    (void)settle;
    return false;
  }
  // The owner answered that it cannot serve a frame this path carried
  // (`why`, its words); the frame goes again inline.
  virtual void refused(const std::string &why) { (void)why; }
  // A path that carries bytes (Carried::bytes_follow): the answer to a read
  // it carried has come, and its `bytes` of data follow on the connection.
  // The path reads them from `data` into `to` (memory of `device`, else host
  // memory), then calls `done` with why they could not land ("" when they
  // did), whose result goes back to `data` (false: the link stops reading).
  virtual void take_data(FrameData &data, std::vector<iovec> to, std::shared_ptr<cuda::Device> device,
                         uint64_t bytes, std::function<bool(std::string failed)> done) {
    (void)to;
    (void)device;
    data.into({}, bytes, [done] { return done("the path carries no data"); });
  }
  // A path that carries bytes: sends a frame's data on `device` (a write it
  // carried, or, `answer`, a read it served) chunk by chunk through `sink`,
  // the connection.
  virtual staging::Result send_device(const cuda::Device &device, const std::vector<iovec> &data, bool answer,
                                      const staging::Sink &sink) {
    (void)device;
    (void)data;
    (void)answer;
    (void)sink;
    staging::Result r;
    r.outcome = staging::Outcome::kCopyFailed;
    r.why = "the path carries no data";
    return r;
  }

  // -- owner ---------------------------------------------------------------
  // Whether this path's frames carry their bytes (Carried::bytes_follow):
  // it is asked of those frames only (kWrite, kRead), the others of frames
  // naming the peer's memory (kWriteFrom, kReadInto; req.by_reference).
  virtual bool carries_bytes() const { return false; }
  // Whether this path serves the peer's frame (one of the kind above).
  virtual bool serves(const wire::Request &req) const = 0;
  // Reads the trailer of a frame it serves (`req.trailer`) into `view`,
  // which serve() gets with the frame; not empty: why the frame is
  // malformed (the link fails). A path that adds no trailer reads none.
  virtual std::string read_trailer(const wire::Request &req, std::shared_ptr<const void> &view) const {
    (void)view;
    return req.trailer.empty() ? std::string() : "a trailer for a path that takes none";
  }
  // Whether the link checks that the initiator is still there before the
  // path moves any byte (a kernel or device copy, which moves them at once).
  virtual bool checks_initiator_first() const { return false; }
  // Whether a frame this path serves is the link's work until answered: its
  // bytes land whatever becomes of the link once the path started them (a
  // kernel or device copy), so the link's reap waits for it and no byte
  // lands after the link's operations settled. False: the path's own reap
  // ends what it started (UCX closes the endpoint), and the frame is the
  // link's work only while it is answered.
  virtual bool reap_waits() const { return false; }
  // Checks and moves the frame's bytes; may return before they have moved.
  virtual void serve(std::shared_ptr<ServedFrame> frame) = 0;

  // -- both ----------------------------------------------------------------
  // A message (wire::FrameType::kPathMessage) this path sends first on the
  // link, before any other frame (true, its body in `body`): the same-host
  // path tells the peer it reaches its memory.
  virtual bool first_message(std::vector<uint8_t> &body) const {
    (void)body;
    return false;
  }
  // Called once the link runs (its connections read and write), after
  // start(): a path may send messages from here on.
  virtual void running() {}
  // A path message (kPathMessage) from the peer: whether this path takes it
  // (`ok` false: it was malformed, and the link fails).
  virtual bool takes(const std::vector<uint8_t> &body, bool &ok) {
    (void)body;
    (void)ok;
    return false;
  }

  // Adds this path's counters to `out` (+=, so paths may share a name).
  virtual void counters(std::map<std::string, uint64_t> &out) const = 0;
  // Called once, when the link is reaped: no thread of the link's works
  // any more; what the path holds of the peer goes.
  virtual void reap() {}

 protected:
  PathHost *host_ = nullptr;
};

}  // namespace datadist

#endif  // DATADIST_TRANSPORT_DATA_PATH_H_
