// The inline path: a frame carries its bytes on the link's connections (a
// kWrite's after its body, a kRead's after its answer), on TCP, or on the
// Unix sockets a same-host link moved to. Every link has it, last in its
// list (paths.h, inline_path()): it carries every frame the paths before
// it do not, works wherever the link does, and needs no handshake.
//
// Host memory is read and written on the connection directly. Device
// memory goes through pinned host buffers (device/staging.h), a chunk's
// copy overlapping the socket, on a thread of the I/O loop's blocking pool
// (the copies may wait). The link frames it all; this path says what a
// frame carries, reads a write's bytes and a read's answer into their
// memory, and stages device memory either way.
#ifndef DATADIST_TRANSPORT_PATHS_INLINE_INLINE_PATH_H_
#define DATADIST_TRANSPORT_PATHS_INLINE_INLINE_PATH_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "transport/data_path.h"

namespace datadist {

class InlinePath : public DataPath {
 public:
  // What Link::transport() says of a link whose operations take no other path.
  const char *name() const override { return "tcp"; }
  bool active() const override { return true; }
  Carry carry(const PlannedFrame &planned, const cuda::Device *device, bool exports_ok, size_t body_bytes,
              Carried &out) override;
  void take_data(FrameData &data, std::vector<iovec> to, std::shared_ptr<cuda::Device> device, uint64_t bytes,
                 std::function<bool(std::string failed)> done) override;
  staging::Result send_device(const cuda::Device &device, const std::vector<iovec> &data, bool answer,
                              const staging::Sink &sink) override;

  // Every frame that carries its bytes (kWrite, kRead).
  bool carries_bytes() const override { return true; }
  bool serves(const wire::Request &req) const override {
    (void)req;
    return true;
  }
  void serve(std::shared_ptr<ServedFrame> frame) override;

  // staged_frames: this end's frames on device memory whose bytes went
  // staged (written, or their read's data taken); staged_bytes_served: the
  // peer's bytes this end staged as owner; device_stream_waits: the waits
  // for a stream that blocked a thread of this end's while serving the
  // peer's (per chunk).
  void counters(std::map<std::string, uint64_t> &out) const override;
  static void zero_counters(std::map<std::string, uint64_t> &out);

 private:
  // Reads `bytes` of the stream from `in` into the device ranges `to`;
  // false (and `why`) when the copy failed, the rest of the bytes then read
  // and dropped. `io_ok` is false when the connection failed. `serving`:
  // for an operation of the peer's (its waits for the stream are counted).
  bool receive_staged(net::Reader &in, const cuda::Device &device, const std::vector<iovec> &to, uint64_t bytes,
                      bool serving, bool &io_ok, std::string &why);

  std::atomic<uint64_t> staged_frames_{0}, staged_bytes_served_{0}, device_stream_waits_{0};
};

}  // namespace datadist

#endif  // DATADIST_TRANSPORT_PATHS_INLINE_INLINE_PATH_H_
