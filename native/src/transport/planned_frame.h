// PlannedFrame: one frame of an operation as the initiator planned it (the
// planner, frame_planner.h, makes them; a link sends them).
#ifndef DATADIST_TRANSPORT_PLANNED_FRAME_H_
#define DATADIST_TRANSPORT_PLANNED_FRAME_H_

#include <sys/uio.h>

#include <vector>

#include "transport/wire.h"

namespace datadist {

struct PlannedFrame {
  wire::Target target{};
  std::vector<wire::Range> ranges;
  // Source (write) or destination (read): one per range, or, with strides,
  // one per range each stands for, in order.
  std::vector<iovec> local;
  std::vector<wire::Range> bounds;  // the whole operation's outermost ranges
  std::vector<wire::Stride> strides;  // none, or one per range (segment_stride: the local stride)
  // The bytes of every frame of its operation together (Link::submit).
  uint64_t operation_bytes = 0;
};

}  // namespace datadist

#endif  // DATADIST_TRANSPORT_PLANNED_FRAME_H_
