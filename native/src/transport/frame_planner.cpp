#include "transport/frame_planner.h"

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

PlannedFrame &FramePlanner::frame_with_room() {
  if (frames_.empty() || filled_ >= frame_bytes_ || frames_.back().ranges.size() >= frame_ranges_ ||
      elements_ >= wire::kMaxElements) {
    frames_.push_back(PlannedFrame{target_, {}, {}, {}, {}});
    filled_ = 0;
    elements_ = 0;
  }
  return frames_.back();
}

void FramePlanner::track(const wire::Range &range) {
  if (!tracking_) {
    highest_tensor_ = farthest_ = range;
    tracking_ = true;
    return;
  }
  if (range.tensor > highest_tensor_.tensor) highest_tensor_ = range;
  if (reach(range, target_.expected_slot_size) > reach(farthest_, target_.expected_slot_size)) farthest_ = range;
}

void FramePlanner::add(uint8_t *local, uint32_t tensor, uint64_t slot, uint64_t offset, uint64_t length) {
  while (length > 0) {
    PlannedFrame &frame = frame_with_room();
    const uint64_t take = std::min(length, frame_bytes_ - filled_);
    const wire::Range range{tensor, 0, slot, offset, take};
    frame.ranges.push_back(range);
    if (!frame.strides.empty()) frame.strides.push_back({1, 0, 0, 0});
    frame.local.push_back({local, take});
    track(range);
    filled_ += take;
    ++elements_;
    local += take;
    offset += take;
    length -= take;
  }
}

void FramePlanner::add_strided(uint8_t *local, uint64_t local_stride, uint32_t tensor, uint64_t slot,
                               uint64_t offset, uint64_t stride, uint64_t count, uint64_t length) {
  if (count == 1 || length > frame_bytes_) {
    for (uint64_t j = 0; j < count; ++j) add(local + j * local_stride, tensor, slot, offset + j * stride, length);
    return;
  }
  while (count > 0) {
    PlannedFrame &frame = frame_with_room();
    const uint64_t room = std::max<uint64_t>(1, (frame_bytes_ - filled_) / length);
    const uint64_t take = std::min({count, room, static_cast<uint64_t>(wire::kMaxElements - elements_)});
    if (frame.strides.empty()) frame.strides.assign(frame.ranges.size(), wire::Stride{1, 0, 0, 0});
    frame.ranges.push_back(wire::Range{tensor, 0, slot, offset, length});
    frame.strides.push_back({static_cast<uint32_t>(take), 0, stride, local_stride});
    for (uint64_t j = 0; j < take; ++j) frame.local.push_back({local + j * local_stride, length});
    track(frame.ranges.back());
    track(wire::Range{tensor, 0, slot, offset + (take - 1) * stride, length});
    filled_ += take * length;
    elements_ += take;
    local += take * local_stride;
    offset += take * stride;
    count -= take;
  }
}

std::vector<PlannedFrame> FramePlanner::take() {
  std::vector<PlannedFrame> out;
  out.swap(frames_);
  filled_ = 0;
  elements_ = 0;
  tracking_ = false;
  if (out.size() > 1 && target_.kind != wire::kRawAddress) {
    for (PlannedFrame &frame : out) frame.bounds = {highest_tensor_, farthest_};
  }
  return out;
}

std::vector<PlannedFrame> FramePlanner::split(const PlannedFrame &frame, uint64_t frame_bytes) {
  FramePlanner planner(frame.target, frame_bytes, wire::kMaxRanges);
  size_t element = 0;
  for (size_t i = 0; i < frame.ranges.size(); ++i) {
    const wire::Range &r = frame.ranges[i];
    auto *local = static_cast<uint8_t *>(frame.local[element].iov_base);
    const wire::Stride *s = frame.strides.empty() ? nullptr : &frame.strides[i];
    if (s == nullptr || s->count <= 1) {
      planner.add(local, r.tensor, r.slot, r.offset, r.length);
      ++element;
    } else {
      planner.add_strided(local, s->segment_stride, r.tensor, r.slot, r.offset, s->stride, s->count, r.length);
      element += s->count;
    }
  }
  std::vector<PlannedFrame> out = planner.take();
  if (!frame.bounds.empty()) {
    for (PlannedFrame &piece : out) piece.bounds = frame.bounds;
  }
  return out;
}

}  // namespace datadist
