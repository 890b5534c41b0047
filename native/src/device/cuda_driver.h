// NVIDIA's CUDA driver, loaded at run time: the first use of a device cache
// opens libcuda.so.1 (or the file named by $DATADIST_AIO_CUDA_DRIVER) with
// dlopen and resolves the entry points of cuda_api.h. Without a driver or a
// device, DEVICE placement is refused with LLM_FEATURE_NOT_ENABLED and a
// message naming what is missing.
#ifndef DATADIST_DEVICE_CUDA_DRIVER_H_
#define DATADIST_DEVICE_CUDA_DRIVER_H_

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "device/cuda_api.h"
#include "device/staging.h"
#include "llm_datadist/llm_error_codes.h"

namespace datadist::cuda {

using llm_datadist::Status;

constexpr const char kDriverEnv[] = "DATADIST_AIO_CUDA_DRIVER";

// The driver's entry points, resolved once per process.
struct Driver {
  std::string path;  // the file dlopen was given
  int version = 0;   // cuDriverGetVersion: 1000 * major + 10 * minor
  PFN_cuInit cuInit = nullptr;
  PFN_cuDriverGetVersion cuDriverGetVersion = nullptr;
  PFN_cuDeviceGetCount cuDeviceGetCount = nullptr;
  PFN_cuDeviceGet cuDeviceGet = nullptr;
  PFN_cuDevicePrimaryCtxRetain cuDevicePrimaryCtxRetain = nullptr;
  PFN_cuDevicePrimaryCtxRelease cuDevicePrimaryCtxRelease = nullptr;
  PFN_cuCtxSetCurrent cuCtxSetCurrent = nullptr;
  PFN_cuGetErrorString cuGetErrorString = nullptr;
  PFN_cuGetErrorName cuGetErrorName = nullptr;
  PFN_cuPointerGetAttributes cuPointerGetAttributes = nullptr;
  PFN_cuMemGetAddressRange cuMemGetAddressRange = nullptr;
  PFN_cuMemAlloc cuMemAlloc = nullptr;
  PFN_cuMemFree cuMemFree = nullptr;
  PFN_cuMemAllocHost cuMemAllocHost = nullptr;
  PFN_cuMemFreeHost cuMemFreeHost = nullptr;
  PFN_cuMemcpyHtoDAsync cuMemcpyHtoDAsync = nullptr;
  PFN_cuMemcpyDtoHAsync cuMemcpyDtoHAsync = nullptr;
  PFN_cuMemcpyDtoDAsync cuMemcpyDtoDAsync = nullptr;
  PFN_cuStreamCreate cuStreamCreate = nullptr;
  PFN_cuStreamDestroy cuStreamDestroy = nullptr;
  PFN_cuStreamSynchronize cuStreamSynchronize = nullptr;
  PFN_cuLaunchHostFunc cuLaunchHostFunc = nullptr;
  PFN_cuIpcGetMemHandle cuIpcGetMemHandle = nullptr;
  PFN_cuIpcOpenMemHandle cuIpcOpenMemHandle = nullptr;
  PFN_cuIpcCloseMemHandle cuIpcCloseMemHandle = nullptr;

  // "CUDA_ERROR_INVALID_VALUE (invalid argument)", from the driver's own names.
  std::string describe(CUresult result) const;
};

// The loaded and initialized driver, or null with why there is none. The
// first call decides for the life of the process.
const Driver *load_driver(std::string &why);

// One device's primary context (the one torch and the CUDA runtime use),
// retained while the object lives.
class Device {
 public:
  ~Device();
  Device(const Device &) = delete;
  Device &operator=(const Device &) = delete;

  // Loads the driver and retains device `ordinal`'s primary context;
  // otherwise LLM_FEATURE_NOT_ENABLED (no driver, no such device) or
  // LLM_FAILED (the driver refused), with the reason in the error detail.
  static Status open(int ordinal, std::shared_ptr<Device> &out);

  const Driver &driver() const { return *driver_; }
  int ordinal() const { return ordinal_; }

  // Makes the context current on the calling thread, as every thread that
  // calls the driver needs; false with `why` when the driver refuses.
  bool make_current(std::string &why) const;
  std::string describe(CUresult result) const;

  // LLM_SUCCESS when [addr, addr + size) is memory of this device inside one
  // allocation; otherwise LLM_PARAM_INVALID naming `what` and what it is.
  Status check_range(uint64_t addr, uint64_t size, const std::string &what) const;

  // `count` allocations of `size` bytes each (all or none);
  // LLM_DEVICE_OUT_OF_MEMORY or LLM_FAILED with the reason otherwise.
  Status allocate(size_t count, uint64_t size, std::vector<uint8_t *> &out) const;
  void free(const std::vector<uint8_t *> &addrs) const;

  // A stream of the engine's for this device, made current on the calling
  // thread first; null with `why` when the driver refuses. Give it back
  // once the work queued on it is done.
  CUstream take_stream(std::string &why) const;
  void give_stream(CUstream stream) const;

  // The device's staging buffers, pinned host memory (cuMemAllocHost) made
  // on first need: one pool for bytes leaving device memory, one for bytes
  // coming in, so a transfer waiting for a buffer to receive into never
  // waits behind one that is sending (see staging.h).
  staging::Pool &staging_pool(bool inbound) const;

 private:
  Device(const Driver *driver, int ordinal, CUcontext context)
      : driver_(driver), ordinal_(ordinal), context_(context) {}

  const Driver *driver_;
  int ordinal_;
  CUcontext context_;
  mutable std::mutex streams_mu_;
  mutable std::vector<CUstream> streams_;  // idle streams
  mutable std::mutex staging_mu_;
  mutable std::unique_ptr<staging::Pool> staging_[2];  // out, in
};

// The driver's copies for staging: lane i is a stream of the device's,
// taken on first use and given back, once idle, by the destructor. Makes
// the device's context current on the constructing thread, which is the
// only one that may use it.
class StreamCopier : public staging::Copier {
 public:
  explicit StreamCopier(const Device &device);
  ~StreamCopier() override;
  StreamCopier(const StreamCopier &) = delete;
  StreamCopier &operator=(const StreamCopier &) = delete;

  bool to_host(size_t lane, uint8_t *host, const uint8_t *device, size_t n, std::string &why) override;
  bool to_device(size_t lane, uint8_t *device, const uint8_t *host, size_t n, std::string &why) override;
  bool wait(size_t lane, std::string &why) override;

 private:
  CUstream stream(size_t lane, std::string &why);

  const Device &device_;
  bool current_ = false;
  std::string not_current_;
  std::vector<CUstream> streams_;
};

}  // namespace datadist::cuda

#endif  // DATADIST_DEVICE_CUDA_DRIVER_H_
