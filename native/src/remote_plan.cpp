#include "remote_plan.h"

#include <algorithm>
#include <tuple>

namespace datadist {

namespace {

// Orders ranges by how far into a tensor they reach: by byte end when the
// slot size is known, else by slot and then end inside it.
std::tuple<unsigned __int128, uint64_t> reach(const wire::Range &r, uint64_t slot_size) {
  const unsigned __int128 end = static_cast<unsigned __int128>(r.offset) + r.length;
  if (slot_size != 0) return {static_cast<unsigned __int128>(r.slot) * slot_size + end, 0};
  return {r.slot, static_cast<uint64_t>(end)};
}

}  // namespace

FramePlanner::FramePlanner(const wire::Target &target, uint64_t frame_bytes, size_t frame_ranges)
    : target_(target), frame_bytes_(frame_bytes), frame_ranges_(frame_ranges) {}

void FramePlanner::add(uint8_t *local, uint32_t tensor, uint64_t slot, uint64_t offset, uint64_t length) {
  while (length > 0) {
    if (frames_.empty() || filled_ >= frame_bytes_ || frames_.back().ranges.size() >= frame_ranges_) {
      frames_.push_back(PlannedFrame{target_, {}, {}, {}});
      filled_ = 0;
    }
    PlannedFrame &frame = frames_.back();
    const uint64_t take = std::min(length, frame_bytes_ - filled_);
    const wire::Range range{tensor, 0, slot, offset, take};
    if (frames_.size() == 1 && frame.ranges.empty()) highest_tensor_ = farthest_ = range;
    if (range.tensor > highest_tensor_.tensor) highest_tensor_ = range;
    if (reach(range, target_.expected_slot_size) > reach(farthest_, target_.expected_slot_size)) farthest_ = range;
    frame.ranges.push_back(range);
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
  if (out.size() > 1 && target_.kind != wire::kRawAddress) {
    for (PlannedFrame &frame : out) frame.bounds = {highest_tensor_, farthest_};
  }
  return out;
}

}  // namespace datadist
