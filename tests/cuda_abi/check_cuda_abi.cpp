// Compiles only against NVIDIA's cuda.h: the engine's own declarations of
// the driver API (native/src/device/cuda_api.h) must match it in every type,
// value and signature, or this file does not build. Nothing runs.
//
//   g++ -std=c++17 -fsyntax-only -I<dir of cuda.h> -Inative/src tests/cuda_abi/check_cuda_abi.cpp
#include <cuda.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "device/cuda_api.h"

namespace ours = datadist::cuda;

namespace {

// A type as the x86-64 calling convention passes it: a 4-byte enum and a
// 4-byte int travel alike; everything else as itself.
template <typename T, typename = void>
struct Passed {
  using type = T;
};
template <typename T>
struct Passed<T, std::enable_if_t<(std::is_enum_v<T> || std::is_integral_v<T>) && sizeof(T) == 4>> {
  using type = uint32_t;
};
template <typename T>
struct Passed<T *, std::enable_if_t<(std::is_enum_v<T> || std::is_integral_v<T>) && sizeof(T) == 4>> {
  using type = uint32_t *;
};
// The IPC handle: a 64-byte struct of chars on both sides, passed by value
// in memory alike (checked below to have the same size and alignment).
struct IpcHandle;
template <>
struct Passed<ours::CUipcMemHandle> {
  using type = IpcHandle;
};
template <>
struct Passed<::CUipcMemHandle> {
  using type = IpcHandle;
};
template <>
struct Passed<ours::CUipcMemHandle *> {
  using type = IpcHandle *;
};
template <>
struct Passed<::CUipcMemHandle *> {
  using type = IpcHandle *;
};

// The VMM structs, passed by pointer: the same layout on both sides
// (checked below).
struct AllocationProp;
struct AccessDesc;
template <>
struct Passed<const ours::CUmemAllocationProp *> {
  using type = const AllocationProp *;
};
template <>
struct Passed<const ::CUmemAllocationProp *> {
  using type = const AllocationProp *;
};
template <>
struct Passed<const ours::CUmemAccessDesc *> {
  using type = const AccessDesc *;
};
template <>
struct Passed<const ::CUmemAccessDesc *> {
  using type = const AccessDesc *;
};

// The 2D copy's parameters, passed by pointer: the same layout on both
// sides (checked below).
struct Memcpy2D;
template <>
struct Passed<const ours::CUDA_MEMCPY2D *> {
  using type = const Memcpy2D *;
};
template <>
struct Passed<const ::CUDA_MEMCPY2D *> {
  using type = const Memcpy2D *;
};

// A stream callback: a pointer on both sides (its own signature is checked below).
struct StreamCallback;
template <>
struct Passed<ours::CUstreamCallback> {
  using type = StreamCallback *;
};
template <>
struct Passed<::CUstreamCallback> {
  using type = StreamCallback *;
};

template <typename F>
struct Signature;
template <typename R, typename... A>
struct Signature<R (*)(A...)> {
  using type = typename Passed<R>::type (*)(typename Passed<A>::type...);
};

template <typename Ours, typename Theirs>
constexpr bool same_call = std::is_same_v<typename Signature<Ours>::type, typename Signature<Theirs>::type>;

}  // namespace

#define CHECK_ENTRY(pfn, symbol) \
  static_assert(same_call<ours::pfn, decltype(&::symbol)>, #symbol ": the declaration differs from cuda.h")

CHECK_ENTRY(PFN_cuInit, cuInit);
CHECK_ENTRY(PFN_cuDriverGetVersion, cuDriverGetVersion);
CHECK_ENTRY(PFN_cuDeviceGetCount, cuDeviceGetCount);
CHECK_ENTRY(PFN_cuDeviceGet, cuDeviceGet);
CHECK_ENTRY(PFN_cuDevicePrimaryCtxRetain, cuDevicePrimaryCtxRetain);
CHECK_ENTRY(PFN_cuDevicePrimaryCtxRelease, cuDevicePrimaryCtxRelease_v2);
CHECK_ENTRY(PFN_cuCtxSetCurrent, cuCtxSetCurrent);
CHECK_ENTRY(PFN_cuGetErrorString, cuGetErrorString);
CHECK_ENTRY(PFN_cuGetErrorName, cuGetErrorName);
CHECK_ENTRY(PFN_cuPointerGetAttributes, cuPointerGetAttributes);
CHECK_ENTRY(PFN_cuMemGetAddressRange, cuMemGetAddressRange_v2);
CHECK_ENTRY(PFN_cuMemAlloc, cuMemAlloc_v2);
CHECK_ENTRY(PFN_cuMemFree, cuMemFree_v2);
CHECK_ENTRY(PFN_cuMemAllocHost, cuMemAllocHost_v2);
CHECK_ENTRY(PFN_cuMemFreeHost, cuMemFreeHost);
CHECK_ENTRY(PFN_cuMemcpyHtoDAsync, cuMemcpyHtoDAsync_v2);
CHECK_ENTRY(PFN_cuMemcpyDtoHAsync, cuMemcpyDtoHAsync_v2);
CHECK_ENTRY(PFN_cuMemcpyDtoDAsync, cuMemcpyDtoDAsync_v2);
CHECK_ENTRY(PFN_cuMemcpy2DAsync, cuMemcpy2DAsync_v2);
CHECK_ENTRY(PFN_cuStreamCreate, cuStreamCreate);
CHECK_ENTRY(PFN_cuStreamDestroy, cuStreamDestroy_v2);
CHECK_ENTRY(PFN_cuStreamSynchronize, cuStreamSynchronize);
CHECK_ENTRY(PFN_cuLaunchHostFunc, cuLaunchHostFunc);
CHECK_ENTRY(PFN_cuStreamAddCallback, cuStreamAddCallback);
CHECK_ENTRY(PFN_cuIpcGetMemHandle, cuIpcGetMemHandle);
CHECK_ENTRY(PFN_cuIpcOpenMemHandle, cuIpcOpenMemHandle_v2);
CHECK_ENTRY(PFN_cuIpcCloseMemHandle, cuIpcCloseMemHandle);
CHECK_ENTRY(PFN_cuMemGetAllocationGranularity, cuMemGetAllocationGranularity);
CHECK_ENTRY(PFN_cuMemRelease, cuMemRelease);
CHECK_ENTRY(PFN_cuMemAddressReserve, cuMemAddressReserve);
CHECK_ENTRY(PFN_cuMemAddressFree, cuMemAddressFree);
CHECK_ENTRY(PFN_cuMemMap, cuMemMap);
CHECK_ENTRY(PFN_cuMemUnmap, cuMemUnmap);
CHECK_ENTRY(PFN_cuMemSetAccess, cuMemSetAccess);
CHECK_ENTRY(PFN_cuMemRetainAllocationHandle, cuMemRetainAllocationHandle);
CHECK_ENTRY(PFN_cuMemExportToShareableHandle, cuMemExportToShareableHandle);
CHECK_ENTRY(PFN_cuMemImportFromShareableHandle, cuMemImportFromShareableHandle);

// Handle and value types.
static_assert(std::is_same_v<ours::CUdeviceptr, ::CUdeviceptr>, "CUdeviceptr");
static_assert(std::is_same_v<ours::CUdevice, ::CUdevice>, "CUdevice");
static_assert(std::is_same_v<ours::CUcontext, ::CUcontext>, "CUcontext");
static_assert(std::is_same_v<ours::CUstream, ::CUstream>, "CUstream");
static_assert(std::is_same_v<ours::CUevent, ::CUevent>, "CUevent");
static_assert(std::is_same_v<ours::CUhostFn, ::CUhostFn>, "CUhostFn");
static_assert(same_call<ours::CUstreamCallback, ::CUstreamCallback>, "CUstreamCallback");
static_assert(sizeof(ours::CUresult) == sizeof(::CUresult), "CUresult size");
static_assert(sizeof(ours::CUpointer_attribute) == sizeof(::CUpointer_attribute), "CUpointer_attribute size");
static_assert(sizeof(ours::CUipcMemHandle) == sizeof(::CUipcMemHandle) && CU_IPC_HANDLE_SIZE == 64 &&
                  alignof(ours::CUipcMemHandle) == alignof(::CUipcMemHandle) &&
                  std::is_trivially_copyable_v<ours::CUipcMemHandle>,
              "CUipcMemHandle layout");

static_assert(std::is_same_v<ours::CUmemGenericAllocationHandle, ::CUmemGenericAllocationHandle>,
              "CUmemGenericAllocationHandle");
static_assert(sizeof(ours::CUmemAllocationHandleType) == sizeof(::CUmemAllocationHandleType),
              "CUmemAllocationHandleType size");
#define CHECK_FIELD(ours_t, theirs_t, field)                                                     \
  static_assert(offsetof(ours_t, field) == offsetof(theirs_t, field) &&                          \
                    sizeof(ours_t::field) == sizeof(theirs_t::field),                             \
                #theirs_t "::" #field)
static_assert(sizeof(ours::CUmemLocation) == sizeof(::CUmemLocation), "CUmemLocation size");
CHECK_FIELD(ours::CUmemLocation, ::CUmemLocation, type);
CHECK_FIELD(ours::CUmemLocation, ::CUmemLocation, id);
static_assert(sizeof(ours::CUmemAllocationProp) == sizeof(::CUmemAllocationProp) &&
                  alignof(ours::CUmemAllocationProp) == alignof(::CUmemAllocationProp),
              "CUmemAllocationProp layout");
CHECK_FIELD(ours::CUmemAllocationProp, ::CUmemAllocationProp, type);
CHECK_FIELD(ours::CUmemAllocationProp, ::CUmemAllocationProp, requestedHandleTypes);
CHECK_FIELD(ours::CUmemAllocationProp, ::CUmemAllocationProp, location);
CHECK_FIELD(ours::CUmemAllocationProp, ::CUmemAllocationProp, win32HandleMetaData);
CHECK_FIELD(ours::CUmemAllocationProp, ::CUmemAllocationProp, allocFlags);
static_assert(sizeof(ours::CUmemAccessDesc) == sizeof(::CUmemAccessDesc) &&
                  alignof(ours::CUmemAccessDesc) == alignof(::CUmemAccessDesc),
              "CUmemAccessDesc layout");
CHECK_FIELD(ours::CUmemAccessDesc, ::CUmemAccessDesc, location);
CHECK_FIELD(ours::CUmemAccessDesc, ::CUmemAccessDesc, flags);
static_assert(sizeof(ours::CUDA_MEMCPY2D) == sizeof(::CUDA_MEMCPY2D) &&
                  alignof(ours::CUDA_MEMCPY2D) == alignof(::CUDA_MEMCPY2D),
              "CUDA_MEMCPY2D layout");
CHECK_FIELD(ours::CUDA_MEMCPY2D, ::CUDA_MEMCPY2D, srcXInBytes);
CHECK_FIELD(ours::CUDA_MEMCPY2D, ::CUDA_MEMCPY2D, srcY);
CHECK_FIELD(ours::CUDA_MEMCPY2D, ::CUDA_MEMCPY2D, srcMemoryType);
CHECK_FIELD(ours::CUDA_MEMCPY2D, ::CUDA_MEMCPY2D, srcHost);
CHECK_FIELD(ours::CUDA_MEMCPY2D, ::CUDA_MEMCPY2D, srcDevice);
CHECK_FIELD(ours::CUDA_MEMCPY2D, ::CUDA_MEMCPY2D, srcArray);
CHECK_FIELD(ours::CUDA_MEMCPY2D, ::CUDA_MEMCPY2D, srcPitch);
CHECK_FIELD(ours::CUDA_MEMCPY2D, ::CUDA_MEMCPY2D, dstXInBytes);
CHECK_FIELD(ours::CUDA_MEMCPY2D, ::CUDA_MEMCPY2D, dstY);
CHECK_FIELD(ours::CUDA_MEMCPY2D, ::CUDA_MEMCPY2D, dstMemoryType);
CHECK_FIELD(ours::CUDA_MEMCPY2D, ::CUDA_MEMCPY2D, dstHost);
CHECK_FIELD(ours::CUDA_MEMCPY2D, ::CUDA_MEMCPY2D, dstDevice);
CHECK_FIELD(ours::CUDA_MEMCPY2D, ::CUDA_MEMCPY2D, dstArray);
CHECK_FIELD(ours::CUDA_MEMCPY2D, ::CUDA_MEMCPY2D, dstPitch);
CHECK_FIELD(ours::CUDA_MEMCPY2D, ::CUDA_MEMCPY2D, WidthInBytes);
CHECK_FIELD(ours::CUDA_MEMCPY2D, ::CUDA_MEMCPY2D, Height);

// Values.
#define CHECK_VALUE(name) static_assert(static_cast<long long>(ours::name) == static_cast<long long>(::name), #name)
CHECK_VALUE(CUDA_SUCCESS);
CHECK_VALUE(CUDA_ERROR_INVALID_VALUE);
CHECK_VALUE(CUDA_ERROR_OUT_OF_MEMORY);
CHECK_VALUE(CUDA_ERROR_NOT_INITIALIZED);
CHECK_VALUE(CUDA_ERROR_NO_DEVICE);
CHECK_VALUE(CUDA_ERROR_INVALID_DEVICE);
CHECK_VALUE(CUDA_ERROR_INVALID_CONTEXT);
CHECK_VALUE(CUDA_ERROR_NOT_FOUND);
CHECK_VALUE(CUDA_ERROR_NOT_READY);
CHECK_VALUE(CU_POINTER_ATTRIBUTE_CONTEXT);
CHECK_VALUE(CU_POINTER_ATTRIBUTE_MEMORY_TYPE);
CHECK_VALUE(CU_POINTER_ATTRIBUTE_BUFFER_ID);
CHECK_VALUE(CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL);
CHECK_VALUE(CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE);
CHECK_VALUE(CU_POINTER_ATTRIBUTE_RANGE_START_ADDR);
CHECK_VALUE(CU_POINTER_ATTRIBUTE_RANGE_SIZE);
CHECK_VALUE(CU_MEMORYTYPE_HOST);
CHECK_VALUE(CU_MEMORYTYPE_DEVICE);
CHECK_VALUE(CU_STREAM_NON_BLOCKING);
CHECK_VALUE(CU_EVENT_DISABLE_TIMING);
CHECK_VALUE(CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
CHECK_VALUE(CUDA_ERROR_NOT_SUPPORTED);
CHECK_VALUE(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
CHECK_VALUE(CU_MEM_ALLOCATION_TYPE_PINNED);
CHECK_VALUE(CU_MEM_LOCATION_TYPE_DEVICE);
CHECK_VALUE(CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
CHECK_VALUE(CU_MEM_ALLOC_GRANULARITY_MINIMUM);
