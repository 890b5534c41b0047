// Planning of push and pull operations: which layers of a local cache pair
// with which of a peer's (the frames themselves: transport/frame_planner.h).
#ifndef DATADIST_REMOTE_PLAN_H_
#define DATADIST_REMOTE_PLAN_H_

#include <cstdint>

#include "transport/frame_planner.h"

namespace datadist {

// Layers moved by one call: local layer `local_first + l` pairs with remote
// layer `remote_first + l` for l < count; layer i is tensors
// [i * per_layer, (i + 1) * per_layer).
struct LayerSpan {
  uint32_t local_first = 0;
  uint32_t remote_first = 0;
  uint32_t count = 0;
  uint32_t per_layer = 2;
};

}  // namespace datadist

#endif  // DATADIST_REMOTE_PLAN_H_
