// What a cache is: its description as the user gave it and the byte geometry
// the engine derives from it. All layouts slice dimension 0 of the shape:
// batch slot b (contiguous caches) and block b (blocks caches) of tensor t
// are bytes [b * slot_size, (b + 1) * slot_size) of tensor t.
#ifndef DATADIST_CACHE_GEOMETRY_H_
#define DATADIST_CACHE_GEOMETRY_H_

#include <cstdint>
#include <vector>

#include "llm_datadist/llm_error_codes.h"

namespace datadist {

using llm_datadist::Status;

enum class Placement : uint32_t { kHost = 0, kDevice = 1 };

struct CacheSpec {
  uint32_t num_tensors = 0;
  std::vector<int64_t> shape;
  int32_t data_type = 0;
  Placement placement = Placement::kHost;
  bool is_blocks = false;
};

struct Geometry {
  uint64_t tensor_size = 0;  // bytes of one tensor
  uint64_t slot_size = 0;    // bytes of one batch slot or block
  uint64_t num_slots = 0;    // shape[0]
};

// Bytes of one element of a data type code, 0 for an unknown code.
uint64_t data_type_size(int32_t data_type);

// LLM_PARAM_INVALID unless the shape has 1 to 31 positive dims, the data type
// is known, num_tensors > 0 and the sizes fit in 64 bits.
Status compute_geometry(const CacheSpec &spec, Geometry &out);

}  // namespace datadist

#endif  // DATADIST_CACHE_GEOMETRY_H_
