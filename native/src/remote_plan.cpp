#include "remote_plan.h"

#include <algorithm>

namespace datadist {

FramePlanner::FramePlanner(const wire::Target &target, uint64_t frame_bytes, size_t frame_ranges)
    : target_(target), frame_bytes_(frame_bytes), frame_ranges_(frame_ranges) {}

void FramePlanner::add(uint8_t *local, uint32_t tensor, uint64_t slot, uint64_t offset, uint64_t length) {
  while (length > 0) {
    if (frames_.empty() || filled_ >= frame_bytes_ || frames_.back().ranges.size() >= frame_ranges_) {
      frames_.push_back(PlannedFrame{target_, {}, {}});
      filled_ = 0;
    }
    PlannedFrame &frame = frames_.back();
    const uint64_t take = std::min(length, frame_bytes_ - filled_);
    frame.ranges.push_back({tensor, 0, slot, offset, take});
    frame.local.push_back({local, take});
    filled_ += take;
    local += take;
    offset += take;
    length -= take;
  }
}

std::vector<PlannedFrame> FramePlanner::take() {
  std::vector<PlannedFrame> out;
  out.swap(frames_);
  filled_ = 0;
  return out;
}

}  // namespace datadist
