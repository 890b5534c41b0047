#include "cache_geometry.h"

#include "error_detail.h"

namespace datadist {

using llm_datadist::LLM_PARAM_INVALID;
using llm_datadist::LLM_SUCCESS;

uint64_t data_type_size(int32_t data_type) {
  switch (data_type) {
    case 2:   // DT_INT8
    case 4:   // DT_UINT8
    case 12:  // DT_BOOL
      return 1;
    case 1:   // DT_FLOAT16
    case 6:   // DT_INT16
    case 7:   // DT_UINT16
    case 27:  // DT_BF16
      return 2;
    case 0:  // DT_FLOAT
    case 3:  // DT_INT32
    case 8:  // DT_UINT32
      return 4;
    case 9:   // DT_INT64
    case 10:  // DT_UINT64
    case 11:  // DT_DOUBLE
      return 8;
    case 13:  // DT_STRING, two uint64 words
      return 16;
    default:
      return 0;
  }
}

Status compute_geometry(const CacheSpec &spec, Geometry &out) {
  const uint64_t item = data_type_size(spec.data_type);
  if (item == 0) return refuse(LLM_PARAM_INVALID, words("unknown data type code ", spec.data_type));
  if (spec.num_tensors == 0) return refuse(LLM_PARAM_INVALID, "num_tensors is 0");
  if (spec.shape.empty() || spec.shape.size() > 31) {
    return refuse(LLM_PARAM_INVALID, words("shape has ", spec.shape.size(), " dimensions, allowed 1 to 31"));
  }
  uint64_t size = item;
  for (size_t d = 0; d < spec.shape.size(); ++d) {
    const int64_t dim = spec.shape[d];
    if (dim <= 0) return refuse(LLM_PARAM_INVALID, words("shape[", d, "] is ", dim, ", must be > 0"));
    if (__builtin_mul_overflow(size, static_cast<uint64_t>(dim), &size)) {
      return refuse(LLM_PARAM_INVALID, "the tensor size overflows 64 bits");
    }
  }
  out.tensor_size = size;
  out.num_slots = static_cast<uint64_t>(spec.shape[0]);
  out.slot_size = size / out.num_slots;
  return LLM_SUCCESS;
}

}  // namespace datadist
