// FramePlanner: which local bytes go to (or come from) which named ranges
// of a peer's cache, packed into frames. Small blocks share a frame; large
// ranges are split so frames stay bounded and spread over the link's
// connections.
#ifndef DATADIST_TRANSPORT_FRAME_PLANNER_H_
#define DATADIST_TRANSPORT_FRAME_PLANNER_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "transport/planned_frame.h"
#include "transport/wire.h"

namespace datadist {

class FramePlanner {
 public:
  explicit FramePlanner(const wire::Target &target, uint64_t frame_bytes = 8ull << 20, size_t frame_ranges = 2048);

  // Local bytes [local, local + length) pair with bytes
  // [slot * slot_size + offset, + length) of remote tensor `tensor`.
  void add(uint8_t *local, uint32_t tensor, uint64_t slot, uint64_t offset, uint64_t length);
  // `count` such pairs, the j-th at local + j * local_stride and offset +
  // j * stride, sent as strided ranges (strides >= length when count > 1).
  void add_strided(uint8_t *local, uint64_t local_stride, uint32_t tensor, uint64_t slot, uint64_t offset,
                   uint64_t stride, uint64_t count, uint64_t length);
  // The frames; when there are several, each carries the operation's
  // outermost ranges (highest tensor, farthest end) as bounds.
  std::vector<PlannedFrame> take();
  // `frame` again as frames of at most `frame_bytes` (the operation's
  // bounds kept, or set where it now takes several).
  static std::vector<PlannedFrame> split(const PlannedFrame &frame, uint64_t frame_bytes);

 private:
  wire::Target target_;
  uint64_t frame_bytes_;
  size_t frame_ranges_;
  // Opens a frame when the current one is full.
  PlannedFrame &frame_with_room();
  // Counts a range (the farthest one a strided range stands for) toward
  // the operation's bounds.
  void track(const wire::Range &range);

  uint64_t filled_ = 0;
  size_t elements_ = 0;  // ranges of the current frame once unrolled
  bool tracking_ = false;
  std::vector<PlannedFrame> frames_;
  wire::Range highest_tensor_{};
  wire::Range farthest_{};
};

}  // namespace datadist

#endif  // DATADIST_TRANSPORT_FRAME_PLANNER_H_
