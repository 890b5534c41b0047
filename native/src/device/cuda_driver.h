// NVIDIA's CUDA driver, loaded at run time: the first use of a device cache
// opens libcuda.so.1 (or the file named by $DATADIST_AIO_CUDA_DRIVER) with
// dlopen and resolves the entry points of cuda_api.h. Without a driver or a
// device, DEVICE placement is refused with LLM_FEATURE_NOT_ENABLED and a
// message naming what is missing.
#ifndef DATADIST_DEVICE_CUDA_DRIVER_H_
#define DATADIST_DEVICE_CUDA_DRIVER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
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
  PFN_cuMemcpy2DAsync cuMemcpy2DAsync = nullptr;
  PFN_cuStreamCreate cuStreamCreate = nullptr;
  PFN_cuStreamDestroy cuStreamDestroy = nullptr;
  PFN_cuStreamSynchronize cuStreamSynchronize = nullptr;
  PFN_cuLaunchHostFunc cuLaunchHostFunc = nullptr;
  PFN_cuStreamAddCallback cuStreamAddCallback = nullptr;
  PFN_cuStreamWaitEvent cuStreamWaitEvent = nullptr;
  PFN_cuIpcGetMemHandle cuIpcGetMemHandle = nullptr;
  PFN_cuIpcOpenMemHandle cuIpcOpenMemHandle = nullptr;
  PFN_cuIpcCloseMemHandle cuIpcCloseMemHandle = nullptr;
  PFN_cuMemGetAllocationGranularity cuMemGetAllocationGranularity = nullptr;
  PFN_cuMemRelease cuMemRelease = nullptr;
  PFN_cuMemAddressReserve cuMemAddressReserve = nullptr;
  PFN_cuMemAddressFree cuMemAddressFree = nullptr;
  PFN_cuMemMap cuMemMap = nullptr;
  PFN_cuMemUnmap cuMemUnmap = nullptr;
  PFN_cuMemSetAccess cuMemSetAccess = nullptr;
  PFN_cuMemRetainAllocationHandle cuMemRetainAllocationHandle = nullptr;
  PFN_cuMemExportToShareableHandle cuMemExportToShareableHandle = nullptr;
  PFN_cuMemImportFromShareableHandle cuMemImportFromShareableHandle = nullptr;

  // "CUDA_ERROR_INVALID_VALUE (invalid argument)", from the driver's own names.
  std::string describe(CUresult result) const;
};

// The loaded and initialized driver, or null with why there is none. The
// first call decides for the life of the process.
const Driver *load_driver(std::string &why);

// One allocation of a device exported for another process of the host:
// by legacy CUDA IPC (its handle), or, for memory of cuMemCreate, as a POSIX
// file descriptor of this process that the Device keeps open; and where it
// lies in this process.
struct Export {
  CUipcMemHandle handle{};  // legacy IPC (fd < 0)
  int fd = -1;              // POSIX-fd export: the descriptor here
  uint64_t serial = 0;      // POSIX-fd export: tells a descriptor number reused after a close apart
  uint64_t base = 0;
  uint64_t size = 0;
};

// One copy of Device::copy: `n` bytes from `src` to `dst`, each a device
// address when its flag says so, else host memory of this process.
struct Copy {
  uint64_t dst = 0;
  uint64_t src = 0;
  uint64_t n = 0;
  bool dst_device = true;
  bool src_device = true;
};

class Device;

// Another process's allocation, opened here in a device's context
// (cuIpcOpenMemHandle, or a POSIX-fd export imported and mapped); closed
// (unmapped and released) by the destructor once nothing uses it.
class PeerAllocation {
 public:
  // Opens `handle` in `device`'s context and learns the size of what it
  // opened from the driver; null with `why` when the driver refuses.
  static std::shared_ptr<PeerAllocation> open(const std::shared_ptr<Device> &device, const CUipcMemHandle &handle,
                                              std::string &why);
  // Imports the allocation descriptor `fd` names (cuMemImportFromShareableHandle;
  // `fd` is closed either way), reserves addresses for `size` bytes of it,
  // maps them and gives `device` read-write access; the driver refuses a
  // size past the allocation's. Null with `why` when the driver refuses.
  static std::shared_ptr<PeerAllocation> import(const std::shared_ptr<Device> &device, int fd, uint64_t size,
                                                std::string &why);
  ~PeerAllocation();
  PeerAllocation(const PeerAllocation &) = delete;
  PeerAllocation &operator=(const PeerAllocation &) = delete;

  uint64_t base() const { return base_; }
  uint64_t size() const { return size_; }
  bool imported() const { return imported_; }
  const std::shared_ptr<Device> &device() const { return device_; }

 private:
  PeerAllocation(std::shared_ptr<Device> device, uint64_t base, uint64_t size, bool imported,
                 CUmemGenericAllocationHandle handle)
      : device_(std::move(device)), base_(base), size_(size), imported_(imported), handle_(handle) {}
  const std::shared_ptr<Device> device_;
  const uint64_t base_;
  const uint64_t size_;
  const bool imported_;                        // import(): mapped here, else opened IPC
  const CUmemGenericAllocationHandle handle_;  // import(): the imported allocation
};

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

  // The export of the allocation that holds `addr`, made once per
  // allocation (the driver's buffer id tells a freed and remade one apart):
  // legacy IPC where the driver can; else, with `fds`, memory of cuMemCreate
  // made with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR as a descriptor (of
  // the physical allocation mapped at `addr`, which may be one of several
  // side by side). False with `why` where neither works (an opened IPC
  // mapping, cuMemCreate memory without that handle type). Any thread.
  bool export_at(uint64_t addr, bool fds, Export &out, std::string &why) const;

  // Runs `copies` in order on a stream of the engine's and waits for them;
  // false with `why` (the driver's words) when one is refused or fails.
  bool copy(const std::vector<Copy> &copies, std::string &why) const;

  // Queues `copies` in order on a stream of the engine's and returns at
  // once; `done` runs once they have all run, told CUDA_SUCCESS or the
  // error the stream met (describe() it elsewhere), on the driver's thread:
  // it may not call the driver, nor let go of anything whose release does
  // (hand such work to a thread of one's own). The stream goes back once
  // `done` has run well. False with `why` (the driver's words) when a copy
  // or the callback is refused: what was queued has then run, and `done`
  // is never called. The caller keeps this Device alive until `done` has
  // run (`done` may hold it). Any thread.
  bool copy_async(const std::vector<Copy> &copies, std::function<void(CUresult)> done, std::string &why) const;

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

  // Calls `done` once the work `event` last recorded (before this call) has
  // completed: a stream of the engine's waits for the event
  // (cuStreamWaitEvent), then runs `done` as a host function on the
  // driver's thread (so `done` may not call the driver); the stream goes
  // back once `done` has run. No thread of the engine's waits meanwhile.
  // False with `why` (the driver's words) when the driver refuses the event
  // or the host function; `done` is then never called. The caller keeps
  // this Device alive until `done` has run (`done` may hold it). Any thread.
  bool after_event(CUevent event, std::function<void()> done, std::string &why) const;

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
  mutable std::mutex exports_mu_;
  mutable std::unordered_map<unsigned long long, Export> exports_;  // by the driver's buffer id
  // Queues `copies` on `stream`; false with `why` at the first one refused.
  // A run of copies of one size and kind whose sources and destinations
  // each step by one pitch (strided rows) goes as one 2D copy; a run
  // contiguous at both ends, as one copy.
  bool queue_copies(CUstream stream, const std::vector<Copy> &copies, std::string &why) const;
  // Closes the descriptors of exports whose memory is no longer mapped where
  // it was (freed, or unmapped and remade); `all`: every one. Lock held.
  void drop_fd_exports(bool all) const;
  // The physical allocation (cuMemCreate) mapped at `addr`: the granules
  // around it, inside the range [start, start + length) the driver reports,
  // that carry its buffer id `buffer`. That range can hold several
  // allocations mapped side by side, and cuMemMap takes one whole one.
  bool piece_extent(uint64_t addr, unsigned long long buffer, uint64_t start, uint64_t length, uint64_t &base,
                    uint64_t &size, std::string &why) const;
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
  // The waits for a stream so far (a thread of the caller's blocked in each).
  size_t waits() const { return waits_; }

 private:
  CUstream stream(size_t lane, std::string &why);

  const Device &device_;
  bool current_ = false;
  std::string not_current_;
  std::vector<CUstream> streams_;
  size_t waits_ = 0;
};

}  // namespace datadist::cuda

#endif  // DATADIST_DEVICE_CUDA_DRIVER_H_
