#include "device/cuda_driver.h"

#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>

#include <cstdlib>
#include <mutex>

#include "error_detail.h"

namespace datadist::cuda {

using llm_datadist::LLM_FAILED;
using llm_datadist::LLM_FEATURE_NOT_ENABLED;
using llm_datadist::LLM_PARAM_INVALID;
using llm_datadist::LLM_SUCCESS;

namespace {

// Resolves `name` into `slot`; false (and `missing` names it) when absent.
template <typename Fn>
bool resolve(void *library, const char *name, Fn &slot, std::string &missing) {
  slot = reinterpret_cast<Fn>(dlsym(library, name));
  if (slot == nullptr && missing.empty()) missing = name;
  return slot != nullptr;
}

struct Loaded {
  Driver driver;
  std::string why;  // set when there is no driver
};

Loaded load() {
  Loaded out;
  const char *env = std::getenv(kDriverEnv);
  Driver &d = out.driver;
  d.path = env != nullptr && *env != '\0' ? env : "libcuda.so.1";
  void *library = dlopen(d.path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    const char *error = dlerror();
    out.why = "no CUDA driver: " + d.path + " could not be loaded (" + (error ? error : "unknown error") +
              "); install the NVIDIA driver, or name its library in $" + kDriverEnv;
    return out;
  }
  std::string missing;
  resolve(library, "cuInit", d.cuInit, missing);
  resolve(library, "cuDriverGetVersion", d.cuDriverGetVersion, missing);
  resolve(library, "cuDeviceGetCount", d.cuDeviceGetCount, missing);
  resolve(library, "cuDeviceGet", d.cuDeviceGet, missing);
  resolve(library, "cuDevicePrimaryCtxRetain", d.cuDevicePrimaryCtxRetain, missing);
  resolve(library, "cuDevicePrimaryCtxRelease_v2", d.cuDevicePrimaryCtxRelease, missing);
  resolve(library, "cuCtxSetCurrent", d.cuCtxSetCurrent, missing);
  resolve(library, "cuGetErrorString", d.cuGetErrorString, missing);
  resolve(library, "cuGetErrorName", d.cuGetErrorName, missing);
  resolve(library, "cuPointerGetAttributes", d.cuPointerGetAttributes, missing);
  resolve(library, "cuMemGetAddressRange_v2", d.cuMemGetAddressRange, missing);
  resolve(library, "cuMemAlloc_v2", d.cuMemAlloc, missing);
  resolve(library, "cuMemFree_v2", d.cuMemFree, missing);
  resolve(library, "cuMemAllocHost_v2", d.cuMemAllocHost, missing);
  resolve(library, "cuMemFreeHost", d.cuMemFreeHost, missing);
  resolve(library, "cuMemcpyHtoDAsync_v2", d.cuMemcpyHtoDAsync, missing);
  resolve(library, "cuMemcpyDtoHAsync_v2", d.cuMemcpyDtoHAsync, missing);
  resolve(library, "cuMemcpyDtoDAsync_v2", d.cuMemcpyDtoDAsync, missing);
  resolve(library, "cuMemcpy2DAsync_v2", d.cuMemcpy2DAsync, missing);
  resolve(library, "cuStreamCreate", d.cuStreamCreate, missing);
  resolve(library, "cuStreamDestroy_v2", d.cuStreamDestroy, missing);
  resolve(library, "cuStreamSynchronize", d.cuStreamSynchronize, missing);
  resolve(library, "cuLaunchHostFunc", d.cuLaunchHostFunc, missing);
  resolve(library, "cuStreamAddCallback", d.cuStreamAddCallback, missing);
  resolve(library, "cuStreamWaitEvent", d.cuStreamWaitEvent, missing);
  resolve(library, "cuIpcGetMemHandle", d.cuIpcGetMemHandle, missing);
  resolve(library, "cuIpcOpenMemHandle_v2", d.cuIpcOpenMemHandle, missing);
  resolve(library, "cuIpcCloseMemHandle", d.cuIpcCloseMemHandle, missing);
  resolve(library, "cuMemGetAllocationGranularity", d.cuMemGetAllocationGranularity, missing);
  resolve(library, "cuMemRelease", d.cuMemRelease, missing);
  resolve(library, "cuMemAddressReserve", d.cuMemAddressReserve, missing);
  resolve(library, "cuMemAddressFree", d.cuMemAddressFree, missing);
  resolve(library, "cuMemMap", d.cuMemMap, missing);
  resolve(library, "cuMemUnmap", d.cuMemUnmap, missing);
  resolve(library, "cuMemSetAccess", d.cuMemSetAccess, missing);
  resolve(library, "cuMemRetainAllocationHandle", d.cuMemRetainAllocationHandle, missing);
  resolve(library, "cuMemExportToShareableHandle", d.cuMemExportToShareableHandle, missing);
  resolve(library, "cuMemImportFromShareableHandle", d.cuMemImportFromShareableHandle, missing);
  if (!missing.empty()) {
    out.why = "the CUDA driver " + d.path + " has no " + missing + " (a driver for CUDA 12 or later is needed)";
    dlclose(library);
    return out;
  }
  // The library stays loaded for the life of the process: contexts and
  // pointers it handed out outlive any one engine.
  CUresult r = d.cuInit(0);
  if (r != CUDA_SUCCESS) {
    out.why = "the CUDA driver " + d.path + " did not initialize: " + d.describe(r);
    return out;
  }
  if (d.cuDriverGetVersion(&d.version) != CUDA_SUCCESS) d.version = 0;
  return out;
}

}  // namespace

std::string Device::describe(CUresult result) const { return driver_->describe(result); }

std::string Driver::describe(CUresult result) const {
  const char *name = nullptr;
  const char *text = nullptr;
  if (cuGetErrorName == nullptr || cuGetErrorName(result, &name) != CUDA_SUCCESS || name == nullptr) {
    return "CUDA error " + std::to_string(result);
  }
  std::string out = name;
  if (cuGetErrorString != nullptr && cuGetErrorString(result, &text) == CUDA_SUCCESS && text != nullptr) {
    out += std::string(" (") + text + ")";
  }
  return out;
}

const Driver *load_driver(std::string &why) {
  static const Loaded loaded = load();
  why = loaded.why;
  return loaded.why.empty() ? &loaded.driver : nullptr;
}

namespace {
// Said with every refusal for want of a driver or device: CacheDesc's
// placement defaults to DEVICE, as upstream's does.
constexpr const char kHostHint[] = "; for host memory give Placement.HOST in CacheDesc (its default is DEVICE)";
}  // namespace

Status Device::open(int ordinal, std::shared_ptr<Device> &out) {
  std::string why;
  const Driver *d = load_driver(why);
  if (d == nullptr) return refuse(LLM_FEATURE_NOT_ENABLED, "Placement DEVICE: " + why + kHostHint);
  int count = 0;
  CUresult r = d->cuDeviceGetCount(&count);
  if (r != CUDA_SUCCESS || count <= 0) {
    return refuse(LLM_FEATURE_NOT_ENABLED,
                  "Placement DEVICE: the CUDA driver " + d->path + " sees no device" +
                      (r != CUDA_SUCCESS ? ": " + d->describe(r) : std::string()) + kHostHint);
  }
  if (ordinal < 0 || ordinal >= count) {
    return refuse(LLM_FEATURE_NOT_ENABLED, words("Placement DEVICE: device_id ", ordinal, " is not a CUDA device: ",
                                                 "the driver sees ", count, count == 1 ? " device" : " devices",
                                                 " (set LLMConfig.device_id)"));
  }
  CUdevice device = 0;
  CUcontext context = nullptr;
  r = d->cuDeviceGet(&device, ordinal);
  if (r == CUDA_SUCCESS) r = d->cuDevicePrimaryCtxRetain(&context, device);
  if (r != CUDA_SUCCESS) {
    return refuse(LLM_FAILED, words("Placement DEVICE: device ", ordinal, "'s context: ", d->describe(r)));
  }
  out.reset(new Device(d, ordinal, context));
  return LLM_SUCCESS;
}

Device::~Device() {
  {
    std::lock_guard<std::mutex> lock(exports_mu_);
    drop_fd_exports(true);
  }
  // Every staging buffer has come back: the transfers using them pinned this device.
  staging_[0].reset();
  staging_[1].reset();
  std::string why;
  if (make_current(why)) {
    for (CUstream stream : streams_) driver_->cuStreamDestroy(stream);
  }
  CUdevice device = 0;
  if (driver_->cuDeviceGet(&device, ordinal_) == CUDA_SUCCESS) driver_->cuDevicePrimaryCtxRelease(device);
}

Status Device::allocate(size_t count, uint64_t size, std::vector<uint8_t *> &out) const {
  std::string why;
  if (!make_current(why)) return refuse(LLM_FAILED, "allocating device memory: " + why);
  std::vector<uint8_t *> made;
  for (size_t i = 0; i < count; ++i) {
    CUdeviceptr ptr = 0;
    const CUresult r = driver_->cuMemAlloc(&ptr, static_cast<size_t>(size));
    if (r != CUDA_SUCCESS) {
      free(made);
      return refuse(r == CUDA_ERROR_OUT_OF_MEMORY ? llm_datadist::LLM_DEVICE_OUT_OF_MEMORY : LLM_FAILED,
                    words("allocating ", count, " x ", size, " bytes on device ", ordinal_, ": ", describe(r)));
    }
    made.push_back(reinterpret_cast<uint8_t *>(static_cast<uintptr_t>(ptr)));
  }
  out = std::move(made);
  return LLM_SUCCESS;
}

void Device::free(const std::vector<uint8_t *> &addrs) const {
  std::string why;
  if (!make_current(why)) return;
  for (uint8_t *addr : addrs) driver_->cuMemFree(static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>(addr)));
}

CUstream Device::take_stream(std::string &why) const {
  if (!make_current(why)) return nullptr;
  {
    std::lock_guard<std::mutex> lock(streams_mu_);
    if (!streams_.empty()) {
      CUstream stream = streams_.back();
      streams_.pop_back();
      return stream;
    }
  }
  CUstream stream = nullptr;
  const CUresult r = driver_->cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING);
  if (r != CUDA_SUCCESS) {
    why = "cuStreamCreate: " + describe(r);
    return nullptr;
  }
  return stream;
}

void Device::give_stream(CUstream stream) const {
  std::lock_guard<std::mutex> lock(streams_mu_);
  streams_.push_back(stream);
}

namespace {

// What a host function of after_event owns: it runs once and deletes it.
struct AfterEvent {
  const Device *device;
  CUstream stream;
  std::function<void()> done;
};

void run_after_event(void *data) {
  std::unique_ptr<AfterEvent> after(static_cast<AfterEvent *>(data));
  after->done();
  // The host function is the stream's last work: nothing calls the driver here.
  after->device->give_stream(after->stream);
}

}  // namespace

bool Device::after_event(CUevent event, std::function<void()> done, std::string &why) const {
  CUstream stream = take_stream(why);
  if (stream == nullptr) return false;
  CUresult r = driver_->cuStreamWaitEvent(stream, event, 0);
  if (r != CUDA_SUCCESS) {
    why = "cuStreamWaitEvent: " + describe(r);
    give_stream(stream);  // nothing was queued
    return false;
  }
  auto after = std::make_unique<AfterEvent>(AfterEvent{this, stream, std::move(done)});
  r = driver_->cuLaunchHostFunc(stream, &run_after_event, after.get());
  if (r != CUDA_SUCCESS) {
    why = "cuLaunchHostFunc: " + describe(r);
    // The stream keeps the queued wait: it is not given back to others.
    return false;
  }
  after.release();  // the host function's now
  return true;
}

staging::Pool &Device::staging_pool(bool inbound) const {
  std::lock_guard<std::mutex> lock(staging_mu_);
  std::unique_ptr<staging::Pool> &pool = staging_[inbound ? 1 : 0];
  if (!pool) {
    auto alloc = [this](size_t bytes, std::string &why) -> uint8_t * {
      if (!make_current(why)) return nullptr;
      void *host = nullptr;
      const CUresult r = driver_->cuMemAllocHost(&host, bytes);
      if (r != CUDA_SUCCESS) {
        why = words("cuMemAllocHost of ", bytes, " bytes: ", describe(r));
        return nullptr;
      }
      return static_cast<uint8_t *>(host);
    };
    auto release = [this](uint8_t *host) {
      std::string why;
      if (make_current(why)) driver_->cuMemFreeHost(host);
    };
    pool = std::make_unique<staging::Pool>(staging::kChunkBytes, staging::kPoolBuffers, alloc, release);
  }
  return *pool;
}

StreamCopier::StreamCopier(const Device &device) : device_(device) {
  current_ = device.make_current(not_current_);
}

StreamCopier::~StreamCopier() {
  for (CUstream s : streams_) {
    if (s == nullptr) continue;
    // Idle before another transfer may take it.
    if (device_.driver().cuStreamSynchronize(s) == CUDA_SUCCESS) device_.give_stream(s);
  }
}

CUstream StreamCopier::stream(size_t lane, std::string &why) {
  if (!current_) {
    why = not_current_;
    return nullptr;
  }
  if (lane >= streams_.size()) streams_.resize(lane + 1, nullptr);
  if (streams_[lane] == nullptr) streams_[lane] = device_.take_stream(why);
  return streams_[lane];
}

namespace {
CUdeviceptr device_ptr(const uint8_t *p) { return static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>(p)); }
}  // namespace

bool StreamCopier::to_host(size_t lane, uint8_t *host, const uint8_t *device, size_t n, std::string &why) {
  CUstream s = stream(lane, why);
  if (s == nullptr) return false;
  const CUresult r = device_.driver().cuMemcpyDtoHAsync(host, device_ptr(device), n, s);
  if (r == CUDA_SUCCESS) return true;
  why = "cuMemcpyDtoHAsync: " + device_.describe(r);
  return false;
}

bool StreamCopier::to_device(size_t lane, uint8_t *device, const uint8_t *host, size_t n, std::string &why) {
  CUstream s = stream(lane, why);
  if (s == nullptr) return false;
  const CUresult r = device_.driver().cuMemcpyHtoDAsync(device_ptr(device), host, n, s);
  if (r == CUDA_SUCCESS) return true;
  why = "cuMemcpyHtoDAsync: " + device_.describe(r);
  return false;
}

bool StreamCopier::wait(size_t lane, std::string &why) {
  if (lane >= streams_.size() || streams_[lane] == nullptr) return true;  // nothing was queued on it
  ++waits_;
  const CUresult r = device_.driver().cuStreamSynchronize(streams_[lane]);
  if (r == CUDA_SUCCESS) return true;
  why = "cuStreamSynchronize: " + device_.describe(r);
  return false;
}

bool Device::make_current(std::string &why) const {
  // The context a thread last made current, per thread: most calls find it set.
  thread_local CUcontext current = nullptr;
  if (current == context_) return true;
  const CUresult r = driver_->cuCtxSetCurrent(context_);
  if (r != CUDA_SUCCESS) {
    why = "cuCtxSetCurrent: " + driver_->describe(r);
    return false;
  }
  current = context_;
  return true;
}

Status Device::check_range(uint64_t addr, uint64_t size, const std::string &what) const {
  unsigned int type = 0;
  int ordinal = -1;
  CUdeviceptr start = 0;
  size_t length = 0;
  CUpointer_attribute attributes[] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                                      CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, CU_POINTER_ATTRIBUTE_RANGE_SIZE};
  void *data[] = {&type, &ordinal, &start, &length};
  const CUresult r = driver_->cuPointerGetAttributes(4, attributes, data, static_cast<CUdeviceptr>(addr));
  if (r != CUDA_SUCCESS) {
    return refuse(LLM_PARAM_INVALID, words(what, ": the driver could not describe address ", addr, ": ",
                                           driver_->describe(r)));
  }
  if (type != CU_MEMORYTYPE_DEVICE) {
    return refuse(LLM_PARAM_INVALID, words(what, ": address ", addr, " is not CUDA device memory",
                                           type == CU_MEMORYTYPE_HOST ? " (it is host memory the driver pinned)"
                                                                      : " (the driver does not know it)",
                                           "; give Placement.HOST for host memory"));
  }
  if (ordinal != ordinal_) {
    return refuse(LLM_PARAM_INVALID, words(what, ": address ", addr, " is memory of device ", ordinal,
                                           ", not of device_id ", ordinal_));
  }
  // Memory of cuMemCreate may continue in the allocation mapped next to it
  // (one reserved range backed by several, as torch's expandable segments).
  uint64_t end = start + length;
  while (addr >= start && addr < end && end - addr < size) {
    unsigned int next_type = 0;
    int next_ordinal = -1;
    CUdeviceptr next_start = 0;
    size_t next_length = 0;
    void *next[] = {&next_type, &next_ordinal, &next_start, &next_length};
    if (driver_->cuPointerGetAttributes(4, attributes, next, static_cast<CUdeviceptr>(end)) != CUDA_SUCCESS ||
        next_type != CU_MEMORYTYPE_DEVICE || next_ordinal != ordinal_ || next_start != end || next_length == 0) {
      break;
    }
    end += next_length;
  }
  if (addr < start || addr >= end || end - addr < size) {
    return refuse(LLM_PARAM_INVALID, words(what, ": [", addr, ", +", size, ") runs past its allocation [", start,
                                           ", +", end - start, ")"));
  }
  return LLM_SUCCESS;
}

namespace {

// Exports remembered per device; past it, all are forgotten and made again.
constexpr size_t kMaxExports = 4096;

}  // namespace

void Device::drop_fd_exports(bool all) const {
  for (auto it = exports_.begin(); it != exports_.end();) {
    bool drop = it->second.fd >= 0 && all;
    if (it->second.fd >= 0 && !all) {
      // Still the same mapping at its base?
      unsigned long long buffer = 0;
      CUpointer_attribute attribute = CU_POINTER_ATTRIBUTE_BUFFER_ID;
      void *data[] = {&buffer};
      drop = driver_->cuPointerGetAttributes(1, &attribute, data, static_cast<CUdeviceptr>(it->second.base)) !=
                 CUDA_SUCCESS ||
             buffer != it->first;
    }
    if (drop) {
      ::close(it->second.fd);
      it = exports_.erase(it);
    } else {
      ++it;
    }
  }
}

bool Device::piece_extent(uint64_t addr, unsigned long long buffer, uint64_t start, uint64_t length,
                          uint64_t &base, uint64_t &size, std::string &why) const {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = ordinal_;
  size_t granule = 0;
  const CUresult r = driver_->cuMemGetAllocationGranularity(&granule, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  if (r != CUDA_SUCCESS || granule == 0) {
    why = "cuMemGetAllocationGranularity: " + (r != CUDA_SUCCESS ? describe(r) : std::string("0 bytes"));
    return false;
  }
  auto same = [&](uint64_t at) {
    unsigned long long id = 0;
    CUpointer_attribute attribute = CU_POINTER_ATTRIBUTE_BUFFER_ID;
    void *data[] = {&id};
    return driver_->cuPointerGetAttributes(1, &attribute, data, static_cast<CUdeviceptr>(at)) == CUDA_SUCCESS &&
           id == buffer;
  };
  // Pieces are mapped at whole granules of the reported range.
  const uint64_t end = start + length;
  uint64_t lo = start + (addr - start) / granule * granule;
  while (lo - start >= granule && same(lo - granule)) lo -= granule;
  uint64_t hi = std::min(end, lo + granule);
  while (hi < end && same(hi)) hi = std::min(end, hi + granule);
  base = lo;
  size = hi - lo;
  return true;
}

bool Device::export_at(uint64_t addr, bool fds, Export &out, std::string &why) const {
  if (!make_current(why)) return false;
  unsigned int type = 0;
  int ordinal = -1;
  int capable = 0;
  unsigned long long buffer = 0;
  CUdeviceptr start = 0;
  size_t length = 0;
  CUpointer_attribute attributes[] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                                      CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, CU_POINTER_ATTRIBUTE_BUFFER_ID,
                                      CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, CU_POINTER_ATTRIBUTE_RANGE_SIZE};
  void *data[] = {&type, &ordinal, &capable, &buffer, &start, &length};
  const CUresult r = driver_->cuPointerGetAttributes(6, attributes, data, static_cast<CUdeviceptr>(addr));
  if (r != CUDA_SUCCESS) {
    why = "cuPointerGetAttributes: " + describe(r);
    return false;
  }
  if (type != CU_MEMORYTYPE_DEVICE || ordinal != ordinal_ || addr < start || addr - start >= length) {
    why = words("address ", addr, " is not inside an allocation of device ", ordinal_);
    return false;
  }
  if (capable == 0 && !fds) {
    why = "the allocation cannot be exported with legacy CUDA IPC";
    return false;
  }
  {
    std::lock_guard<std::mutex> lock(exports_mu_);
    auto it = exports_.find(buffer);
    if (it != exports_.end()) {
      const Export &known = it->second;
      // A descriptor export is of one piece of the range the driver reports.
      if (known.fd >= 0 ? addr >= known.base && addr - known.base < known.size
                        : known.base == start && known.size == length) {
        out = known;
        return true;
      }
    }
  }
  Export made;
  made.base = start;
  made.size = length;
  if (capable == 0 && !piece_extent(addr, buffer, start, length, made.base, made.size, why)) return false;
  if (capable != 0) {
    const CUresult e = driver_->cuIpcGetMemHandle(&made.handle, start);
    if (e != CUDA_SUCCESS) {
      why = "cuIpcGetMemHandle: " + describe(e);
      return false;
    }
  } else {
    // Memory of cuMemCreate: the physical allocation mapped here, as a
    // descriptor. The retained handle only serves the export.
    CUmemGenericAllocationHandle handle = 0;
    CUresult e = driver_->cuMemRetainAllocationHandle(&handle, reinterpret_cast<void *>(static_cast<uintptr_t>(made.base)));
    if (e != CUDA_SUCCESS) {
      why = "neither legacy CUDA IPC nor cuMemRetainAllocationHandle can export it: " + describe(e);
      return false;
    }
    int fd = -1;
    e = driver_->cuMemExportToShareableHandle(&fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    driver_->cuMemRelease(handle);
    if (e != CUDA_SUCCESS) {
      why = "cuMemExportToShareableHandle (POSIX file descriptor; cuMemCreate must request "
            "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR): " + describe(e);
      return false;
    }
    static std::atomic<uint64_t> serials{0};
    made.fd = fd;
    made.serial = serials.fetch_add(1, std::memory_order_relaxed) + 1;
  }
  std::lock_guard<std::mutex> lock(exports_mu_);
  if (made.fd >= 0) drop_fd_exports(false);
  auto it = exports_.find(buffer);
  if (it != exports_.end() && it->second.fd >= 0) ::close(it->second.fd);
  if (exports_.size() >= kMaxExports) {
    drop_fd_exports(true);
    exports_.clear();
  }
  exports_[buffer] = made;
  out = made;
  return true;
}

namespace {

// What a callback of copy_async owns: it runs once and deletes it.
struct AfterCopies {
  const Device *device;
  std::function<void(CUresult)> done;
};

void run_after_copies(CUstream stream, CUresult status, void *data) {
  std::unique_ptr<AfterCopies> after(static_cast<AfterCopies *>(data));
  // A stream that met an error stays out of use; `done` may let go of the
  // device, so the stream goes back first (this callback is its last work).
  if (status == CUDA_SUCCESS) after->device->give_stream(stream);
  after->done(status);
}

}  // namespace

namespace {

// Pitches past this are left to 1D copies (the driver bounds a 2D copy's
// pitch by CU_DEVICE_ATTRIBUTE_MAX_PITCH, 2^31 - 1 on current devices).
constexpr uint64_t kMaxPitch = (uint64_t{1} << 31) - 1;

// Whether `next` continues a run of rows that starts at `first`, `rows`
// rows before it, with pitches `src_pitch` and `dst_pitch`.
bool continues(const Copy &first, const Copy &next, uint64_t rows, uint64_t src_pitch, uint64_t dst_pitch) {
  return next.n == first.n && next.src_device == first.src_device && next.dst_device == first.dst_device &&
         next.src == first.src + rows * src_pitch && next.dst == first.dst + rows * dst_pitch;
}

}  // namespace

bool Device::queue_copies(CUstream stream, const std::vector<Copy> &copies, std::string &why) const {
  for (size_t i = 0; i < copies.size();) {
    const Copy &c = copies[i];
    // The run of strided rows starting here: the pitches the next copy sets.
    size_t rows = 1;
    uint64_t src_pitch = 0, dst_pitch = 0;
    if (i + 1 < copies.size() && copies[i + 1].src > c.src && copies[i + 1].dst > c.dst) {
      src_pitch = copies[i + 1].src - c.src;
      dst_pitch = copies[i + 1].dst - c.dst;
      if (src_pitch >= c.n && dst_pitch >= c.n && src_pitch <= kMaxPitch && dst_pitch <= kMaxPitch) {
        while (i + rows < copies.size() && continues(c, copies[i + rows], rows, src_pitch, dst_pitch)) ++rows;
      }
    }
    const size_t taken = rows;
    uint64_t n = c.n;
    if (rows > 1 && src_pitch == c.n && dst_pitch == c.n) {
      n = c.n * rows;  // contiguous at both ends: one copy
      rows = 1;
    }
    CUresult r;
    const char *name;
    if (rows > 1) {
      name = "cuMemcpy2DAsync";
      CUDA_MEMCPY2D p{};
      p.srcMemoryType = static_cast<int>(c.src_device ? CU_MEMORYTYPE_DEVICE : CU_MEMORYTYPE_HOST);
      p.dstMemoryType = static_cast<int>(c.dst_device ? CU_MEMORYTYPE_DEVICE : CU_MEMORYTYPE_HOST);
      if (c.src_device) {
        p.srcDevice = c.src;
      } else {
        p.srcHost = reinterpret_cast<const void *>(static_cast<uintptr_t>(c.src));
      }
      if (c.dst_device) {
        p.dstDevice = c.dst;
      } else {
        p.dstHost = reinterpret_cast<void *>(static_cast<uintptr_t>(c.dst));
      }
      p.srcPitch = src_pitch;
      p.dstPitch = dst_pitch;
      p.WidthInBytes = c.n;
      p.Height = rows;
      r = driver_->cuMemcpy2DAsync(&p, stream);
    } else if (c.dst_device && c.src_device) {
      name = "cuMemcpyDtoDAsync";
      r = driver_->cuMemcpyDtoDAsync(c.dst, c.src, n, stream);
    } else if (c.dst_device) {
      name = "cuMemcpyHtoDAsync";
      r = driver_->cuMemcpyHtoDAsync(c.dst, reinterpret_cast<const void *>(static_cast<uintptr_t>(c.src)), n, stream);
    } else {
      name = "cuMemcpyDtoHAsync";
      r = driver_->cuMemcpyDtoHAsync(reinterpret_cast<void *>(static_cast<uintptr_t>(c.dst)), c.src, n, stream);
    }
    if (r != CUDA_SUCCESS) {
      why = std::string(name) + ": " + describe(r);
      return false;
    }
    i += taken;
  }
  return true;
}

bool Device::copy_async(const std::vector<Copy> &copies, std::function<void(CUresult)> done, std::string &why) const {
  CUstream stream = take_stream(why);
  if (stream == nullptr) return false;
  if (queue_copies(stream, copies, why)) {
    auto after = std::make_unique<AfterCopies>(AfterCopies{this, std::move(done)});
    const CUresult r = driver_->cuStreamAddCallback(stream, &run_after_copies, after.get(), 0);
    if (r == CUDA_SUCCESS) {
      after.release();  // the callback's now
      return true;
    }
    why = "cuStreamAddCallback: " + describe(r);
  }
  // What was queued runs before the stream goes back, or its memory is let go.
  if (driver_->cuStreamSynchronize(stream) == CUDA_SUCCESS) give_stream(stream);
  return false;
}

bool Device::copy(const std::vector<Copy> &copies, std::string &why) const {
  CUstream stream = take_stream(why);
  if (stream == nullptr) return false;
  const bool ok = queue_copies(stream, copies, why);
  // Whatever was queued has run before the stream goes back, or the copy's
  // memory is given back.
  const CUresult s = driver_->cuStreamSynchronize(stream);
  if (s != CUDA_SUCCESS) {
    if (ok) why = "cuStreamSynchronize: " + describe(s);
    return false;
  }
  give_stream(stream);
  return ok;
}

std::shared_ptr<PeerAllocation> PeerAllocation::open(const std::shared_ptr<Device> &device,
                                                     const CUipcMemHandle &handle, std::string &why) {
  if (!device->make_current(why)) return nullptr;
  const Driver &driver = device->driver();
  CUdeviceptr ptr = 0;
  CUresult r = driver.cuIpcOpenMemHandle(&ptr, handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
  if (r != CUDA_SUCCESS) {
    why = "cuIpcOpenMemHandle: " + device->describe(r);
    return nullptr;
  }
  CUdeviceptr base = 0;
  size_t size = 0;
  r = driver.cuMemGetAddressRange(&base, &size, ptr);
  if (r != CUDA_SUCCESS || base != ptr) {
    why = "cuMemGetAddressRange of an opened allocation: " +
          (r != CUDA_SUCCESS ? device->describe(r) : std::string("not its base"));
    driver.cuIpcCloseMemHandle(ptr);
    return nullptr;
  }
  return std::shared_ptr<PeerAllocation>(new PeerAllocation(device, ptr, size, false, 0));
}

std::shared_ptr<PeerAllocation> PeerAllocation::import(const std::shared_ptr<Device> &device, int fd, uint64_t size,
                                                       std::string &why) {
  if (!device->make_current(why)) {
    ::close(fd);
    return nullptr;
  }
  const Driver &driver = device->driver();
  CUmemGenericAllocationHandle handle = 0;
  CUresult r = driver.cuMemImportFromShareableHandle(&handle, reinterpret_cast<void *>(static_cast<intptr_t>(fd)),
                                                     CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  ::close(fd);
  if (r != CUDA_SUCCESS) {
    why = "cuMemImportFromShareableHandle: " + device->describe(r);
    return nullptr;
  }
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device->ordinal();
  size_t granularity = 0;
  CUdeviceptr ptr = 0;
  const char *step = "cuMemGetAllocationGranularity";
  r = driver.cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  if (r == CUDA_SUCCESS && (size == 0 || granularity == 0 || size % granularity != 0)) {
    driver.cuMemRelease(handle);
    why = words("an exported allocation of ", size, " bytes, not a multiple of the granularity ", granularity);
    return nullptr;
  }
  if (r == CUDA_SUCCESS) {
    step = "cuMemAddressReserve";
    r = driver.cuMemAddressReserve(&ptr, static_cast<size_t>(size), granularity, 0, 0);
  }
  bool reserved = r == CUDA_SUCCESS;
  if (r == CUDA_SUCCESS) {
    step = "cuMemMap";
    r = driver.cuMemMap(ptr, static_cast<size_t>(size), 0, handle, 0);
  }
  bool mapped = r == CUDA_SUCCESS;
  if (r == CUDA_SUCCESS) {
    step = "cuMemSetAccess";
    CUmemAccessDesc access{};
    access.location = prop.location;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    r = driver.cuMemSetAccess(ptr, static_cast<size_t>(size), &access, 1);
  }
  if (r != CUDA_SUCCESS) {
    why = std::string(step) + ": " + device->describe(r);
    if (mapped) driver.cuMemUnmap(ptr, static_cast<size_t>(size));
    if (reserved) driver.cuMemAddressFree(ptr, static_cast<size_t>(size));
    driver.cuMemRelease(handle);
    return nullptr;
  }
  return std::shared_ptr<PeerAllocation>(new PeerAllocation(device, ptr, size, true, handle));
}

PeerAllocation::~PeerAllocation() {
  std::string why;
  if (!device_->make_current(why)) return;
  const Driver &driver = device_->driver();
  if (!imported_) {
    driver.cuIpcCloseMemHandle(static_cast<CUdeviceptr>(base_));
    return;
  }
  driver.cuMemUnmap(static_cast<CUdeviceptr>(base_), static_cast<size_t>(size_));
  driver.cuMemAddressFree(static_cast<CUdeviceptr>(base_), static_cast<size_t>(size_));
  driver.cuMemRelease(handle_);
}

}  // namespace datadist::cuda
