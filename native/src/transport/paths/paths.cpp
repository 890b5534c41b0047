#include "transport/paths/paths.h"

#include "transport/paths/device/cuda_ipc_path.h"
#include "transport/paths/inline/inline_path.h"
#include "transport/paths/same_host/same_host_kind.h"
#include "transport/paths/same_host/same_host_path.h"
#include "transport/paths/test/test_path.h"
#include "transport/paths/ucx/ucx_data_path.h"
#include "transport/paths/ucx/ucx_kind.h"

namespace datadist {

std::vector<std::unique_ptr<PathKind>> make_kinds(const PathOptions &options, const PathServices &services) {
  std::vector<std::unique_ptr<PathKind>> kinds;
  if (options.ucx || options.ucx_auto) kinds.push_back(std::make_unique<ucx::UcxKind>(options.ucx, options.one_sided, services.io_loop));
  if (options.same_host) {
    kinds.push_back(std::make_unique<same_host::SameHostKind>(options.one_sided, services.answers != nullptr));
  }
  if (options.test_path) kinds.push_back(std::make_unique<test_path::TestKind>(services.registry));
  return kinds;
}

std::shared_ptr<DataPath> inline_path() { return std::make_shared<InlinePath>(); }

void zero_counters(std::map<std::string, uint64_t> &out) {
  InlinePath::zero_counters(out);
  UcxDataPath::zero_counters(out);
  CudaIpcPath::zero_counters(out);
  SameHostPath::zero_counters(out);
}

}  // namespace datadist
