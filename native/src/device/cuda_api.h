// The part of NVIDIA's CUDA driver API the engine calls, declared here so
// that nothing CUDA is needed to build: the driver (libcuda.so.1) is loaded
// at run time (cuda_driver.h). Types, values and signatures are the
// driver's; tests/cuda_abi/check_cuda_abi.cpp checks each one against
// NVIDIA's cuda.h.
#ifndef DATADIST_DEVICE_CUDA_API_H_
#define DATADIST_DEVICE_CUDA_API_H_

#include <cstddef>
#include <cstdint>

// The driver's opaque handle types, by the driver's own tag names (so that
// a handle here and one from cuda.h are the same type).
struct CUctx_st;
struct CUstream_st;
struct CUevent_st;
struct CUarray_st;

namespace datadist::cuda {

// The driver's enums (CUresult, CUpointer_attribute) travel as 32-bit ints.
using CUresult = int;
using CUdevice = int;
using CUdeviceptr = unsigned long long;
using CUcontext = CUctx_st *;
using CUstream = CUstream_st *;
using CUevent = CUevent_st *;
using CUhostFn = void (*)(void *user_data);
using CUstreamCallback = void (*)(CUstream stream, CUresult status, void *user_data);
using CUpointer_attribute = int;

struct CUipcMemHandle {
  char reserved[64];
};

// A 2D copy (cuMemcpy2DAsync): Height rows of WidthInBytes bytes, each
// row a pitch after the one before it, at both ends.
struct CUDA_MEMCPY2D {
  size_t srcXInBytes;
  size_t srcY;
  int srcMemoryType;  // CUmemorytype
  const void *srcHost;
  CUdeviceptr srcDevice;
  CUarray_st *srcArray;
  size_t srcPitch;
  size_t dstXInBytes;
  size_t dstY;
  int dstMemoryType;  // CUmemorytype
  void *dstHost;
  CUdeviceptr dstDevice;
  CUarray_st *dstArray;
  size_t dstPitch;
  size_t WidthInBytes;
  size_t Height;
};

// Virtual memory management (cuMemCreate and its kin).
using CUmemGenericAllocationHandle = unsigned long long;
using CUmemAllocationHandleType = int;
using CUmemAllocationGranularity_flags = int;

struct CUmemLocation {
  int type;  // CUmemLocationType
  int id;
};

struct CUmemAllocationProp {
  int type;                                        // CUmemAllocationType
  CUmemAllocationHandleType requestedHandleTypes;  // a bit mask
  CUmemLocation location;
  void *win32HandleMetaData;
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
  } allocFlags;
};

struct CUmemAccessDesc {
  CUmemLocation location;
  int flags;  // CUmemAccess_flags
};

// CUresult values the engine tells apart.
constexpr CUresult CUDA_SUCCESS = 0;
constexpr CUresult CUDA_ERROR_INVALID_VALUE = 1;
constexpr CUresult CUDA_ERROR_OUT_OF_MEMORY = 2;
constexpr CUresult CUDA_ERROR_NOT_INITIALIZED = 3;
constexpr CUresult CUDA_ERROR_NO_DEVICE = 100;
constexpr CUresult CUDA_ERROR_INVALID_DEVICE = 101;
constexpr CUresult CUDA_ERROR_INVALID_CONTEXT = 201;
constexpr CUresult CUDA_ERROR_NOT_FOUND = 500;
constexpr CUresult CUDA_ERROR_NOT_READY = 600;
constexpr CUresult CUDA_ERROR_NOT_SUPPORTED = 801;

// CUpointer_attribute values.
constexpr CUpointer_attribute CU_POINTER_ATTRIBUTE_CONTEXT = 1;
constexpr CUpointer_attribute CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2;
constexpr CUpointer_attribute CU_POINTER_ATTRIBUTE_BUFFER_ID = 7;
constexpr CUpointer_attribute CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9;
constexpr CUpointer_attribute CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 10;
constexpr CUpointer_attribute CU_POINTER_ATTRIBUTE_RANGE_START_ADDR = 11;
constexpr CUpointer_attribute CU_POINTER_ATTRIBUTE_RANGE_SIZE = 12;

// CUmemorytype values.
constexpr unsigned int CU_MEMORYTYPE_HOST = 1;
constexpr unsigned int CU_MEMORYTYPE_DEVICE = 2;

constexpr unsigned int CU_STREAM_NON_BLOCKING = 1;
constexpr unsigned int CU_EVENT_DISABLE_TIMING = 2;
constexpr unsigned int CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1;

constexpr CUmemAllocationHandleType CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1;
constexpr int CU_MEM_ALLOCATION_TYPE_PINNED = 1;
constexpr int CU_MEM_LOCATION_TYPE_DEVICE = 1;
constexpr int CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3;
constexpr CUmemAllocationGranularity_flags CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0;

// One pointer type per entry point, named after the function; the loader
// resolves the symbol given in cuda_driver.cpp (the _v2 one where the
// driver has two).
using PFN_cuInit = CUresult (*)(unsigned int flags);
using PFN_cuDriverGetVersion = CUresult (*)(int *version);
using PFN_cuDeviceGetCount = CUresult (*)(int *count);
using PFN_cuDeviceGet = CUresult (*)(CUdevice *device, int ordinal);
using PFN_cuDevicePrimaryCtxRetain = CUresult (*)(CUcontext *ctx, CUdevice device);
using PFN_cuDevicePrimaryCtxRelease = CUresult (*)(CUdevice device);
using PFN_cuCtxSetCurrent = CUresult (*)(CUcontext ctx);
using PFN_cuGetErrorString = CUresult (*)(CUresult error, const char **text);
using PFN_cuGetErrorName = CUresult (*)(CUresult error, const char **text);
using PFN_cuPointerGetAttributes = CUresult (*)(unsigned int count, CUpointer_attribute *attributes, void **data,
                                                CUdeviceptr ptr);
using PFN_cuMemGetAddressRange = CUresult (*)(CUdeviceptr *base, size_t *size, CUdeviceptr ptr);
using PFN_cuMemAlloc = CUresult (*)(CUdeviceptr *ptr, size_t size);
using PFN_cuMemFree = CUresult (*)(CUdeviceptr ptr);
using PFN_cuMemAllocHost = CUresult (*)(void **ptr, size_t size);
using PFN_cuMemFreeHost = CUresult (*)(void *ptr);
using PFN_cuMemcpyHtoDAsync = CUresult (*)(CUdeviceptr dst, const void *src, size_t size, CUstream stream);
using PFN_cuMemcpyDtoHAsync = CUresult (*)(void *dst, CUdeviceptr src, size_t size, CUstream stream);
using PFN_cuMemcpyDtoDAsync = CUresult (*)(CUdeviceptr dst, CUdeviceptr src, size_t size, CUstream stream);
using PFN_cuMemcpy2DAsync = CUresult (*)(const CUDA_MEMCPY2D *copy, CUstream stream);
using PFN_cuStreamCreate = CUresult (*)(CUstream *stream, unsigned int flags);
using PFN_cuStreamDestroy = CUresult (*)(CUstream stream);
using PFN_cuStreamSynchronize = CUresult (*)(CUstream stream);
using PFN_cuLaunchHostFunc = CUresult (*)(CUstream stream, CUhostFn fn, void *user_data);
using PFN_cuStreamAddCallback = CUresult (*)(CUstream stream, CUstreamCallback callback, void *user_data,
                                              unsigned int flags);
using PFN_cuStreamWaitEvent = CUresult (*)(CUstream stream, CUevent event, unsigned int flags);
using PFN_cuIpcGetMemHandle = CUresult (*)(CUipcMemHandle *handle, CUdeviceptr ptr);
using PFN_cuIpcOpenMemHandle = CUresult (*)(CUdeviceptr *ptr, CUipcMemHandle handle, unsigned int flags);
using PFN_cuIpcCloseMemHandle = CUresult (*)(CUdeviceptr ptr);
using PFN_cuMemGetAllocationGranularity = CUresult (*)(size_t *granularity, const CUmemAllocationProp *prop,
                                                       CUmemAllocationGranularity_flags option);
using PFN_cuMemRelease = CUresult (*)(CUmemGenericAllocationHandle handle);
using PFN_cuMemAddressReserve = CUresult (*)(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                             unsigned long long flags);
using PFN_cuMemAddressFree = CUresult (*)(CUdeviceptr ptr, size_t size);
using PFN_cuMemMap = CUresult (*)(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                                  unsigned long long flags);
using PFN_cuMemUnmap = CUresult (*)(CUdeviceptr ptr, size_t size);
using PFN_cuMemSetAccess = CUresult (*)(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count);
using PFN_cuMemRetainAllocationHandle = CUresult (*)(CUmemGenericAllocationHandle *handle, void *addr);
using PFN_cuMemExportToShareableHandle = CUresult (*)(void *shareable, CUmemGenericAllocationHandle handle,
                                                      CUmemAllocationHandleType type, unsigned long long flags);
using PFN_cuMemImportFromShareableHandle = CUresult (*)(CUmemGenericAllocationHandle *handle, void *os_handle,
                                                        CUmemAllocationHandleType type);

}  // namespace datadist::cuda

#endif  // DATADIST_DEVICE_CUDA_API_H_
