/* A stand-in for NVIDIA's CUDA driver (libcuda.so.1) over host memory, for
 * tests on machines without a GPU. It exports the part of the driver API
 * that the engine calls, with the driver's names, signatures and result
 * codes, and keeps the driver's documented rules strictly enough that code
 * which breaks one fails here as it would on a GPU:
 *
 * - device memory is a memfd mapped twice: PROT_NONE at the address handed
 *   out (host code that dereferences a device pointer faults) and
 *   read-write at a private shadow address only the copy functions use;
 * - every stream has a worker thread that runs its operations in order, and
 *   asynchronous copies read their source when they run, not when queued;
 * - each thread has its own current context;
 * - IPC handles name the exporter's memfd, which another process opens
 *   through /proc/<pid>/fd/<n>.
 *
 * It proves the caller's logic, never NVIDIA's. See README.md. */
#define _GNU_SOURCE

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#ifdef STANDIN_WITH_CUDA_H
#include <cuda.h>
#else
#include "standin_cuda_types.h"
#endif

#define STANDIN_API __attribute__((visibility("default")))

/* Test hooks: not part of the driver. */
STANDIN_API int standin_cuda_live_allocations(void);
STANDIN_API unsigned long long standin_cuda_bytes_copied(void);
STANDIN_API unsigned long long standin_cuda_copies_2d(void);
STANDIN_API int standin_cuda_live_vmm_allocations(void);

_Static_assert(sizeof(CUipcMemHandle) == 64, "CUipcMemHandle is 64 bytes");
_Static_assert(sizeof(CUdeviceptr) == 8, "CUdeviceptr is 64 bits");

enum {
  kMaxDevices = 64,
  kDriverVersion = 12040,
  kContextMagic = 0x43747853,  /* "Sctx" */
  kStreamMagic = 0x6d727453,   /* "Strm" */
  kEventMagic = 0x74767453,    /* "Stvt" */
  kIpcMagic = 0x31495053,      /* "SPI1" */
  kIpcVersion = 1,
};

#define MEMFD_PREFIX "standin-cuda-"

/* ------------------------------------------------------------------ */
/* Initialisation, devices and contexts                                */
/* ------------------------------------------------------------------ */

struct CUctx_st {
  uint32_t magic;
  int device;
  atomic_int retained; /* primary context retain count */
  atomic_int sticky;   /* a sticky error (CUDA_ERROR_ILLEGAL_ADDRESS), 0 if none */
};

static pthread_mutex_t g_init_lock = PTHREAD_MUTEX_INITIALIZER;
static atomic_int g_initialized;
static int g_device_count;
static size_t g_capacity; /* bytes of device memory per device */
static bool g_ipc = true; /* legacy IPC export of cuMemAlloc memory (STANDIN_CUDA_IPC) */
static struct CUctx_st g_ctx[kMaxDevices];
static pthread_mutex_t g_ctx_lock = PTHREAD_MUTEX_INITIALIZER;

static _Thread_local struct CUctx_st *t_ctx;
static _Thread_local int t_in_host_fn;

/* The first check of every entry point except the error strings,
 * cuDriverGetVersion and cuGetProcAddress. */
static CUresult enter(void) {
  if (!atomic_load(&g_initialized)) return CUDA_ERROR_NOT_INITIALIZED;
  /* The driver forbids CUDA calls from a host function. */
  if (t_in_host_fn) return CUDA_ERROR_NOT_PERMITTED;
  return CUDA_SUCCESS;
}

/* As enter(), for calls that need a current context. */
static CUresult enter_ctx(struct CUctx_st **out) {
  CUresult r = enter();
  if (r != CUDA_SUCCESS) return r;
  struct CUctx_st *ctx = t_ctx;
  if (ctx == NULL || atomic_load(&ctx->retained) == 0) return CUDA_ERROR_INVALID_CONTEXT;
  int sticky = atomic_load(&ctx->sticky);
  if (sticky != 0) return (CUresult)sticky;
  *out = ctx;
  return CUDA_SUCCESS;
}

static bool parse_env_number(const char *name, long fallback, long lo, long hi, long *out) {
  const char *text = getenv(name);
  if (text == NULL || *text == '\0') {
    *out = fallback;
    return true;
  }
  char *end = NULL;
  errno = 0;
  long value = strtol(text, &end, 10);
  if (errno != 0 || end == text || *end != '\0' || value < lo || value > hi) return false;
  *out = value;
  return true;
}

STANDIN_API CUresult CUDAAPI cuInit(unsigned int Flags) {
  if (Flags != 0) return CUDA_ERROR_INVALID_VALUE;
  if (atomic_load(&g_initialized)) return t_in_host_fn ? CUDA_ERROR_NOT_PERMITTED : CUDA_SUCCESS;
  pthread_mutex_lock(&g_init_lock);
  CUresult r = CUDA_SUCCESS;
  if (!atomic_load(&g_initialized)) {
    long devices = 0;
    long megabytes = 0;
    long ipc = 1;
    if (!parse_env_number("STANDIN_CUDA_DEVICES", 1, 0, kMaxDevices, &devices) ||
        !parse_env_number("STANDIN_CUDA_MEMORY_MB", 1024, 1, 1L << 24, &megabytes) ||
        !parse_env_number("STANDIN_CUDA_IPC", 1, 0, 1, &ipc)) {
      r = CUDA_ERROR_INVALID_VALUE;
    } else {
      g_ipc = ipc != 0;
      g_device_count = (int)devices;
      g_capacity = (size_t)megabytes << 20;
      for (int i = 0; i < kMaxDevices; ++i) {
        g_ctx[i].magic = kContextMagic;
        g_ctx[i].device = i;
        atomic_store(&g_ctx[i].retained, 0);
        atomic_store(&g_ctx[i].sticky, 0);
      }
      atomic_store(&g_initialized, 1);
    }
  }
  pthread_mutex_unlock(&g_init_lock);
  return r;
}

STANDIN_API CUresult CUDAAPI cuDriverGetVersion(int *driverVersion) {
  if (driverVersion == NULL) return CUDA_ERROR_INVALID_VALUE;
  *driverVersion = kDriverVersion;
  return CUDA_SUCCESS;
}

STANDIN_API CUresult CUDAAPI cuDeviceGetCount(int *count) {
  CUresult r = enter();
  if (r != CUDA_SUCCESS) return r;
  if (count == NULL) return CUDA_ERROR_INVALID_VALUE;
  *count = g_device_count;
  return CUDA_SUCCESS;
}

STANDIN_API CUresult CUDAAPI cuDeviceGet(CUdevice *device, int ordinal) {
  CUresult r = enter();
  if (r != CUDA_SUCCESS) return r;
  if (device == NULL) return CUDA_ERROR_INVALID_VALUE;
  if (g_device_count == 0) return CUDA_ERROR_NO_DEVICE;
  if (ordinal < 0 || ordinal >= g_device_count) return CUDA_ERROR_INVALID_DEVICE;
  *device = ordinal;
  return CUDA_SUCCESS;
}

STANDIN_API CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
  CUresult r = enter();
  if (r != CUDA_SUCCESS) return r;
  if (pctx == NULL) return CUDA_ERROR_INVALID_VALUE;
  if (dev < 0 || dev >= g_device_count) return CUDA_ERROR_INVALID_DEVICE;
  struct CUctx_st *ctx = &g_ctx[dev];
  pthread_mutex_lock(&g_ctx_lock);
  /* A primary context retained again after its last release starts afresh. */
  if (atomic_load(&ctx->retained) == 0) atomic_store(&ctx->sticky, 0);
  atomic_fetch_add(&ctx->retained, 1);
  pthread_mutex_unlock(&g_ctx_lock);
  *pctx = ctx;
  return CUDA_SUCCESS;
}

STANDIN_API CUresult CUDAAPI cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
  CUresult r = enter();
  if (r != CUDA_SUCCESS) return r;
  if (dev < 0 || dev >= g_device_count) return CUDA_ERROR_INVALID_DEVICE;
  struct CUctx_st *ctx = &g_ctx[dev];
  pthread_mutex_lock(&g_ctx_lock);
  if (atomic_load(&ctx->retained) == 0) {
    r = CUDA_ERROR_INVALID_CONTEXT;
  } else {
    atomic_fetch_sub(&ctx->retained, 1);
  }
  pthread_mutex_unlock(&g_ctx_lock);
  return r;
}

static struct CUctx_st *known_context(CUcontext ctx) {
  for (int i = 0; i < g_device_count; ++i) {
    if (ctx == &g_ctx[i]) return &g_ctx[i];
  }
  return NULL;
}

STANDIN_API CUresult CUDAAPI cuCtxSetCurrent(CUcontext ctx) {
  CUresult r = enter();
  if (r != CUDA_SUCCESS) return r;
  if (ctx == NULL) {
    t_ctx = NULL;
    return CUDA_SUCCESS;
  }
  struct CUctx_st *known = known_context(ctx);
  if (known == NULL || atomic_load(&known->retained) == 0) return CUDA_ERROR_INVALID_CONTEXT;
  t_ctx = known;
  return CUDA_SUCCESS;
}

STANDIN_API CUresult CUDAAPI cuCtxGetCurrent(CUcontext *pctx) {
  CUresult r = enter();
  if (r != CUDA_SUCCESS) return r;
  if (pctx == NULL) return CUDA_ERROR_INVALID_VALUE;
  *pctx = t_ctx;
  return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------ */
/* Error strings                                                        */
/* ------------------------------------------------------------------ */

struct error_text {
  int code;
  const char *name;
  const char *text;
};

static const struct error_text k_errors[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "an argument is not valid or out of range"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "not enough memory for the allocation"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "the driver has not been initialised (cuInit)"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "there is no CUDA device"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "the ordinal names no device"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "no usable context is current on this thread"},
    {CUDA_ERROR_MAP_FAILED, "CUDA_ERROR_MAP_FAILED", "the shared memory could not be mapped"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "the handle is not a valid one"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "not found"},
    {CUDA_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY", "the work is not finished yet"},
    {CUDA_ERROR_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS",
     "queued work touched device memory that was freed or never allocated"},
    {CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
     "the host memory is already registered"},
    {CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
     "the host memory is not registered"},
    {CUDA_ERROR_NOT_PERMITTED, "CUDA_ERROR_NOT_PERMITTED", "the call is not permitted here"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "the operation is not supported"},
};

static const struct error_text *find_error(CUresult error) {
  for (size_t i = 0; i < sizeof k_errors / sizeof k_errors[0]; ++i) {
    if (k_errors[i].code == (int)error) return &k_errors[i];
  }
  return NULL;
}

STANDIN_API CUresult CUDAAPI cuGetErrorString(CUresult error, const char **pStr) {
  if (pStr == NULL) return CUDA_ERROR_INVALID_VALUE;
  const struct error_text *e = find_error(error);
  *pStr = e != NULL ? e->text : NULL;
  return e != NULL ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

STANDIN_API CUresult CUDAAPI cuGetErrorName(CUresult error, const char **pStr) {
  if (pStr == NULL) return CUDA_ERROR_INVALID_VALUE;
  const struct error_text *e = find_error(error);
  *pStr = e != NULL ? e->name : NULL;
  return e != NULL ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* ------------------------------------------------------------------ */
/* The memory table                                                     */
/* ------------------------------------------------------------------ */

enum region_kind {
  REGION_DEVICE,          /* cuMemAlloc */
  REGION_IPC,             /* cuIpcOpenMemHandle */
  REGION_HOST_ALLOC,      /* cuMemAllocHost */
  REGION_HOST_REGISTERED, /* cuMemHostRegister */
  REGION_VMM,             /* one cuMemMap of a physical allocation into a reservation */
};

struct vmm_alloc;

struct region {
  struct region *next;
  enum region_kind kind;
  uintptr_t base;         /* the caller's address (a CUdeviceptr for device kinds) */
  size_t size;            /* the caller's size */
  size_t map_size;        /* bytes mapped at base (device kinds, host alloc) */
  unsigned char *shadow;  /* device kinds: the read-write view */
  int fd;                 /* REGION_DEVICE: the memfd, kept open for IPC */
  struct CUctx_st *ctx;
  uint64_t id;            /* device kinds: the memfd's random id */
  unsigned long long buffer_id;
  pid_t exporter;         /* REGION_IPC */
  int opens;              /* REGION_IPC: opens not closed yet */
  struct vmm_alloc *alloc; /* REGION_VMM: what is mapped */
  bool access;            /* REGION_VMM: cuMemSetAccess gave read or read-write access */
};

/* Writers first, so that a steady stream of copies cannot starve a free. */
static pthread_rwlock_t g_mem_lock = PTHREAD_RWLOCK_WRITER_NONRECURSIVE_INITIALIZER_NP;
static struct region *g_regions;
static size_t g_used[kMaxDevices];
static atomic_ullong g_bytes_copied;
static atomic_ullong g_next_buffer_id = 1;

static size_t page_size(void) {
  static atomic_size_t cached;
  size_t page = atomic_load_explicit(&cached, memory_order_relaxed);
  if (page == 0) {
    page = (size_t)sysconf(_SC_PAGESIZE);
    atomic_store_explicit(&cached, page, memory_order_relaxed);
  }
  return page;
}

static bool round_to_pages(size_t n, size_t *out) {
  size_t page = page_size();
  if (n > SIZE_MAX - (page - 1)) return false;
  *out = (n + page - 1) & ~(page - 1);
  return true;
}

static bool is_device_kind(const struct region *r) {
  return r->kind == REGION_DEVICE || r->kind == REGION_IPC || r->kind == REGION_VMM;
}

/* The device region holding `p` (base <= p < base + size). Lock held. */
static struct region *device_region_at(uintptr_t p) {
  for (struct region *r = g_regions; r != NULL; r = r->next) {
    if (is_device_kind(r) && p >= r->base && p - r->base < r->size) return r;
  }
  return NULL;
}

static struct region *region_with_base(uintptr_t base, enum region_kind kind);

/* The shadow bytes behind [p, p + n) when all of it lies in one live device
 * allocation (or in mappings side by side of one reservation, each with
 * access), else NULL. Lock held. */
static unsigned char *device_bytes(CUdeviceptr p, size_t n) {
  for (struct region *r = g_regions; r != NULL; r = r->next) {
    if (!is_device_kind(r) || p < r->base) continue;
    uintptr_t offset = (uintptr_t)p - r->base;
    if (offset > r->size || (offset == r->size && n != 0)) continue; /* not in this one */
    if (r->kind == REGION_VMM) {
      /* Mappings side by side in one reservation are one range of
       * addresses (their shadows lie side by side too); each needs access. */
      if (!r->access) return NULL;
      size_t covered = r->size - offset;
      const struct region *at = r;
      while (covered < n) {
        const struct region *next = region_with_base(at->base + at->size, REGION_VMM);
        if (next == NULL || !next->access || next->shadow != at->shadow + at->size) return NULL;
        covered += next->size;
        at = next;
      }
      return r->shadow + offset;
    }
    if (n > r->size - offset) return NULL; /* runs past its end */
    return r->shadow + offset;
  }
  return NULL;
}

/* The range the driver reports for an address of r (cuMemGetAddressRange,
 * the RANGE_START_ADDR and RANGE_SIZE attributes). For cuMemMap pieces it is
 * every piece of r's reservation mapped side by side with r, not r alone: NVIDIA's driver was
 * seen to report more than one piece of torch's expandable segments (the
 * size so reported, given to cuMemMap, was refused), so an exporter must
 * find a piece's own extent another way (its buffer id). Lock held. */
struct vmm_reserve;
static struct vmm_reserve *reserve_holding(uintptr_t p, size_t n);

static void reported_range(const struct region *r, uintptr_t *base, size_t *size) {
  uintptr_t lo = r->base, hi = r->base + r->size;
  if (r->kind == REGION_VMM) {
    const struct vmm_reserve *res = reserve_holding(r->base, r->size);
    for (bool grew = true; grew;) {
      grew = false;
      for (const struct region *o = g_regions; o != NULL; o = o->next) {
        if (o->kind != REGION_VMM || reserve_holding(o->base, o->size) != res) continue;
        if (o->base + o->size == lo) lo = o->base, grew = true;
        if (o->base == hi) hi = o->base + o->size, grew = true;
      }
    }
  }
  *base = lo;
  *size = hi - lo;
}

static bool ranges_overlap(uintptr_t a, size_t an, uintptr_t b, size_t bn) {
  if (an == 0) an = 1;
  if (bn == 0) bn = 1;
  return a < b + bn && b < a + an;
}

/* True when a host argument [p, p + n) touches device memory. Lock held. */
static bool host_range_is_device(const void *p, size_t n) {
  for (struct region *r = g_regions; r != NULL; r = r->next) {
    if (is_device_kind(r) && ranges_overlap((uintptr_t)p, n, r->base, r->map_size)) return true;
  }
  return false;
}

static void insert_region(struct region *r) {
  r->next = g_regions;
  g_regions = r;
}

static void unlink_region(struct region *r) {
  for (struct region **link = &g_regions; *link != NULL; link = &(*link)->next) {
    if (*link == r) {
      *link = r->next;
      return;
    }
  }
}

static struct region *region_with_base(uintptr_t base, enum region_kind kind) {
  for (struct region *r = g_regions; r != NULL; r = r->next) {
    if (r->kind == kind && r->base == base) return r;
  }
  return NULL;
}

STANDIN_API int standin_cuda_live_allocations(void) {
  int live = 0;
  pthread_rwlock_rdlock(&g_mem_lock);
  for (struct region *r = g_regions; r != NULL; r = r->next) {
    if (is_device_kind(r)) ++live;
  }
  pthread_rwlock_unlock(&g_mem_lock);
  return live;
}

STANDIN_API unsigned long long standin_cuda_bytes_copied(void) { return atomic_load(&g_bytes_copied); }

/* 2D copies queued (cuMemcpy2DAsync_v2 calls that succeeded), for tests. */
static atomic_ullong g_copies_2d;
STANDIN_API unsigned long long standin_cuda_copies_2d(void) { return atomic_load(&g_copies_2d); }

static uint64_t random_id(void) {
  uint64_t id = 0;
  if (getrandom(&id, sizeof id, GRND_NONBLOCK) != (ssize_t)sizeof id || id == 0) {
    static atomic_ullong counter;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    id = ((uint64_t)ts.tv_nsec << 20) ^ (uint64_t)ts.tv_sec ^ ((uint64_t)getpid() << 40) ^
         (atomic_fetch_add(&counter, 1) + 1);
  }
  return id;
}

static void memfd_name(char *out, size_t n, uint64_t id) {
  snprintf(out, n, MEMFD_PREFIX "%016llx", (unsigned long long)id);
}

/* Maps the memfd twice: PROT_NONE where the caller sees it, read-write at
 * the shadow. */
static bool map_device(int fd, size_t map_size, uintptr_t *base, unsigned char **shadow) {
  void *none = mmap(NULL, map_size, PROT_NONE, MAP_SHARED, fd, 0);
  if (none == MAP_FAILED) return false;
  void *rw = mmap(NULL, map_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (rw == MAP_FAILED) {
    munmap(none, map_size);
    return false;
  }
  *base = (uintptr_t)none;
  *shadow = rw;
  return true;
}

static void unmap_device(struct region *r) {
  munmap((void *)r->base, r->map_size);
  munmap(r->shadow, r->map_size);
  if (r->fd >= 0) close(r->fd);
}

STANDIN_API CUresult CUDAAPI cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) {
  struct CUctx_st *ctx = NULL;
  CUresult r = enter_ctx(&ctx);
  if (r != CUDA_SUCCESS) return r;
  if (dptr == NULL || bytesize == 0) return CUDA_ERROR_INVALID_VALUE;
  size_t map_size = 0;
  if (!round_to_pages(bytesize, &map_size)) return CUDA_ERROR_OUT_OF_MEMORY;
  const int device = ctx->device;

  pthread_rwlock_wrlock(&g_mem_lock);
  bool fits = map_size <= g_capacity && g_used[device] <= g_capacity - map_size;
  if (fits) g_used[device] += map_size;
  pthread_rwlock_unlock(&g_mem_lock);
  if (!fits) return CUDA_ERROR_OUT_OF_MEMORY;

  struct region *reg = calloc(1, sizeof *reg);
  int fd = -1;
  if (reg != NULL) {
    reg->id = random_id();
    char name[64];
    memfd_name(name, sizeof name, reg->id);
    fd = memfd_create(name, MFD_CLOEXEC);
  }
  if (fd < 0 || ftruncate(fd, (off_t)map_size) != 0 || !map_device(fd, map_size, &reg->base, &reg->shadow)) {
    if (fd >= 0) close(fd);
    free(reg);
    pthread_rwlock_wrlock(&g_mem_lock);
    g_used[device] -= map_size;
    pthread_rwlock_unlock(&g_mem_lock);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  reg->kind = REGION_DEVICE;
  reg->size = bytesize;
  reg->map_size = map_size;
  reg->fd = fd;
  reg->ctx = ctx;
  reg->buffer_id = atomic_fetch_add(&g_next_buffer_id, 1);
  reg->exporter = getpid();
  pthread_rwlock_wrlock(&g_mem_lock);
  insert_region(reg);
  pthread_rwlock_unlock(&g_mem_lock);
  *dptr = (CUdeviceptr)reg->base;
  return CUDA_SUCCESS;
}

STANDIN_API CUresult CUDAAPI cuMemFree_v2(CUdeviceptr dptr) {
  struct CUctx_st *ctx = NULL;
  CUresult r = enter_ctx(&ctx);
  if (r != CUDA_SUCCESS) return r;
  pthread_rwlock_wrlock(&g_mem_lock);
  struct region *reg = region_with_base((uintptr_t)dptr, REGION_DEVICE);
  if (reg != NULL) {
    unlink_region(reg);
    g_used[reg->ctx->device] -= reg->map_size;
  }
  pthread_rwlock_unlock(&g_mem_lock);
  if (reg == NULL) return CUDA_ERROR_INVALID_VALUE;
  unmap_device(reg);
  free(reg);
  return CUDA_SUCCESS;
}

STANDIN_API CUresult CUDAAPI cuMemGetAddressRange_v2(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr) {
  CUresult r = enter();
  if (r != CUDA_SUCCESS) return r;
  pthread_rwlock_rdlock(&g_mem_lock);
  struct region *reg = device_region_at((uintptr_t)dptr);
  if (reg != NULL) {
    uintptr_t base = 0;
    size_t size = 0;
    reported_range(reg, &base, &size);
    if (pbase != NULL) *pbase = (CUdeviceptr)base;
    if (psize != NULL) *psize = size;
  }
  pthread_rwlock_unlock(&g_mem_lock);
  return reg != NULL ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}

STANDIN_API CUresult CUDAAPI cuMemAllocHost_v2(void **pp, size_t bytesize) {
  struct CUctx_st *ctx = NULL;
  CUresult r = enter_ctx(&ctx);
  if (r != CUDA_SUCCESS) return r;
  if (pp == NULL || bytesize == 0) return CUDA_ERROR_INVALID_VALUE;
  size_t map_size = 0;
  if (!round_to_pages(bytesize, &map_size)) return CUDA_ERROR_OUT_OF_MEMORY;
  struct region *reg = calloc(1, sizeof *reg);
  if (reg == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
  void *p = mmap(NULL, map_size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    free(reg);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  reg->kind = REGION_HOST_ALLOC;
  reg->base = (uintptr_t)p;
  reg->size = bytesize;
  reg->map_size = map_size;
  reg->fd = -1;
  reg->ctx = ctx;
  reg->buffer_id = atomic_fetch_add(&g_next_buffer_id, 1);
  pthread_rwlock_wrlock(&g_mem_lock);
  insert_region(reg);
  pthread_rwlock_unlock(&g_mem_lock);
  *pp = p;
  return CUDA_SUCCESS;
}

STANDIN_API CUresult CUDAAPI cuMemFreeHost(void *p) {
  struct CUctx_st *ctx = NULL;
  CUresult r = enter_ctx(&ctx);
  if (r != CUDA_SUCCESS) return r;
  pthread_rwlock_wrlock(&g_mem_lock);
  struct region *reg = region_with_base((uintptr_t)p, REGION_HOST_ALLOC);
  if (reg != NULL) unlink_region(reg);
  pthread_rwlock_unlock(&g_mem_lock);
  if (reg == NULL) return CUDA_ERROR_INVALID_VALUE;
  munmap((void *)reg->base, reg->map_size);
  free(reg);
  return CUDA_SUCCESS;
}

/* True when every page of [p, p + n) is mapped in this process. */
static bool host_range_mapped(const void *p, size_t n) {
  size_t page = page_size();
  uintptr_t start = (uintptr_t)p & ~(uintptr_t)(page - 1);
  uintptr_t end = (uintptr_t)p + n;
  if (end < (uintptr_t)p) return false;
  unsigned char vec[1024];
  while (start < end) {
    size_t pages = (end - start + page - 1) / page;
    if (pages > sizeof vec) pages = sizeof vec;
    if (mincore((void *)start, pages * page, vec) != 0) return false;
    start += pages * page;
  }
  return true;
}

STANDIN_API CUresult CUDAAPI cuMemHostRegister_v2(void *p, size_t bytesize, unsigned int Flags) {
  struct CUctx_st *ctx = NULL;
  CUresult r = enter_ctx(&ctx);
  if (r != CUDA_SUCCESS) return r;
  const unsigned int known =
      CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP | CU_MEMHOSTREGISTER_IOMEMORY |
      CU_MEMHOSTREGISTER_READ_ONLY;
  if (p == NULL || bytesize == 0 || (Flags & ~known) != 0) return CUDA_ERROR_INVALID_VALUE;
  if (Flags & CU_MEMHOSTREGISTER_IOMEMORY) return CUDA_ERROR_NOT_SUPPORTED;
  if ((uintptr_t)p + bytesize < (uintptr_t)p || !host_range_mapped(p, bytesize)) return CUDA_ERROR_INVALID_VALUE;
  struct region *reg = calloc(1, sizeof *reg);
  if (reg == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
  reg->kind = REGION_HOST_REGISTERED;
  reg->base = (uintptr_t)p;
  reg->size = bytesize;
  reg->fd = -1;
  reg->ctx = ctx;
  reg->buffer_id = atomic_fetch_add(&g_next_buffer_id, 1);
  pthread_rwlock_wrlock(&g_mem_lock);
  for (struct region *other = g_regions; other != NULL; other = other->next) {
    if (is_device_kind(other)) {
      if (ranges_overlap(reg->base, bytesize, other->base, other->map_size)) r = CUDA_ERROR_INVALID_VALUE;
    } else if (ranges_overlap(reg->base, bytesize, other->base, other->size)) {
      r = CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
    }
    if (r != CUDA_SUCCESS) break;
  }
  if (r == CUDA_SUCCESS) insert_region(reg);
  pthread_rwlock_unlock(&g_mem_lock);
  if (r != CUDA_SUCCESS) free(reg);
  return r;
}

STANDIN_API CUresult CUDAAPI cuMemHostUnregister(void *p) {
  struct CUctx_st *ctx = NULL;
  CUresult r = enter_ctx(&ctx);
  if (r != CUDA_SUCCESS) return r;
  if (p == NULL) return CUDA_ERROR_INVALID_VALUE;
  pthread_rwlock_wrlock(&g_mem_lock);
  struct region *reg = region_with_base((uintptr_t)p, REGION_HOST_REGISTERED);
  if (reg != NULL) unlink_region(reg);
  pthread_rwlock_unlock(&g_mem_lock);
  if (reg == NULL) return CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
  free(reg);
  return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------ */
/* Pointer attributes                                                   */
/* ------------------------------------------------------------------ */

STANDIN_API CUresult CUDAAPI cuPointerGetAttributes(unsigned int numAttributes, CUpointer_attribute *attributes,
                                                    void **data, CUdeviceptr ptr) {
  CUresult r = enter();
  if (r != CUDA_SUCCESS) return r;
  if (numAttributes == 0 || attributes == NULL || data == NULL) return CUDA_ERROR_INVALID_VALUE;
  for (unsigned int i = 0; i < numAttributes; ++i) {
    if (data[i] == NULL) return CUDA_ERROR_INVALID_VALUE;
    switch (attributes[i]) {
      case CU_POINTER_ATTRIBUTE_CONTEXT:
      case CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
      case CU_POINTER_ATTRIBUTE_DEVICE_POINTER:
      case CU_POINTER_ATTRIBUTE_HOST_POINTER:
      case CU_POINTER_ATTRIBUTE_BUFFER_ID:
      case CU_POINTER_ATTRIBUTE_IS_MANAGED:
      case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL:
      case CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE:
      case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR:
      case CU_POINTER_ATTRIBUTE_RANGE_SIZE:
      case CU_POINTER_ATTRIBUTE_MAPPED:
        break;
      default:
        return CUDA_ERROR_INVALID_VALUE;
    }
  }

  /* What is known of ptr; the defaults are the driver's for an unknown one. */
  unsigned int memory_type = 0;
  int ordinal = -2;
  CUcontext context = NULL;
  CUdeviceptr device_pointer = 0;
  void *host_pointer = NULL;
  unsigned long long buffer_id = 0;
  CUdeviceptr start = 0;
  size_t size = 0;
  int ipc_capable = 0;
  int mapped = 0;

  pthread_rwlock_rdlock(&g_mem_lock);
  for (struct region *reg = g_regions; reg != NULL; reg = reg->next) {
    if ((uintptr_t)ptr < reg->base || (uintptr_t)ptr - reg->base >= reg->size) continue;
    memory_type = is_device_kind(reg) ? CU_MEMORYTYPE_DEVICE : CU_MEMORYTYPE_HOST;
    ordinal = reg->ctx->device;
    context = reg->ctx;
    device_pointer = ptr;
    host_pointer = is_device_kind(reg) ? NULL : (void *)(uintptr_t)ptr;
    buffer_id = reg->buffer_id;
    uintptr_t range_base = 0;
    reported_range(reg, &range_base, &size);
    start = (CUdeviceptr)range_base;
    ipc_capable = reg->kind == REGION_DEVICE && g_ipc;
    mapped = 1;
    break;
  }
  pthread_rwlock_unlock(&g_mem_lock);

  for (unsigned int i = 0; i < numAttributes; ++i) {
    switch (attributes[i]) {
      case CU_POINTER_ATTRIBUTE_CONTEXT:
        *(CUcontext *)data[i] = context;
        break;
      case CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
        *(unsigned int *)data[i] = memory_type;
        break;
      case CU_POINTER_ATTRIBUTE_DEVICE_POINTER:
        *(CUdeviceptr *)data[i] = device_pointer;
        break;
      case CU_POINTER_ATTRIBUTE_HOST_POINTER:
        *(void **)data[i] = host_pointer;
        break;
      case CU_POINTER_ATTRIBUTE_BUFFER_ID:
        *(unsigned long long *)data[i] = buffer_id;
        break;
      case CU_POINTER_ATTRIBUTE_IS_MANAGED:
        *(int *)data[i] = 0;
        break;
      case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL:
        *(int *)data[i] = ordinal;
        break;
      case CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE:
        *(int *)data[i] = ipc_capable;
        break;
      case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR:
        *(CUdeviceptr *)data[i] = start;
        break;
      case CU_POINTER_ATTRIBUTE_RANGE_SIZE:
        *(size_t *)data[i] = size;
        break;
      case CU_POINTER_ATTRIBUTE_MAPPED:
        *(int *)data[i] = mapped;
        break;
      default:
        break;
    }
  }
  return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------ */
/* Operations: copies, memset, host functions, event records and waits */
/* ------------------------------------------------------------------ */

enum op_kind { OP_HTOD, OP_DTOH, OP_DTOD, OP_MEMSET, OP_HOST_FN, OP_CALLBACK, OP_RECORD, OP_WAIT };

struct op {
  struct op *next;
  enum op_kind kind;
  CUdeviceptr dst_dev;
  CUdeviceptr src_dev;
  void *dst_host;
  const void *src_host;
  size_t n;
  unsigned char value;
  CUhostFn fn;
  CUstreamCallback callback;
  CUstream stream; /* the stream a callback is given */
  CUresult status; /* what a callback is given: the stream's error when it runs */
  void *user_data;
  struct CUevent_st *event;
  uint64_t seq;
};

/* Resolves both ends of a copy or memset to bytes this library may touch.
 * g_mem_lock held. */
static CUresult resolve(const struct op *op, unsigned char **dst, const unsigned char **src) {
  switch (op->kind) {
    case OP_HTOD:
      if (op->n != 0 && op->src_host == NULL) return CUDA_ERROR_INVALID_VALUE;
      if (host_range_is_device(op->src_host, op->n)) return CUDA_ERROR_INVALID_VALUE;
      *src = op->src_host;
      *dst = device_bytes(op->dst_dev, op->n);
      return *dst != NULL ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    case OP_DTOH:
      if (op->n != 0 && op->dst_host == NULL) return CUDA_ERROR_INVALID_VALUE;
      if (host_range_is_device(op->dst_host, op->n)) return CUDA_ERROR_INVALID_VALUE;
      *dst = op->dst_host;
      *src = device_bytes(op->src_dev, op->n);
      return *src != NULL ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    case OP_DTOD:
      *dst = device_bytes(op->dst_dev, op->n);
      *src = device_bytes(op->src_dev, op->n);
      return *dst != NULL && *src != NULL ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    case OP_MEMSET:
      *src = NULL;
      *dst = device_bytes(op->dst_dev, op->n);
      return *dst != NULL ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    default:
      return CUDA_ERROR_INVALID_VALUE;
  }
}

static CUresult check_copy(const struct op *op) {
  unsigned char *dst = NULL;
  const unsigned char *src = NULL;
  pthread_rwlock_rdlock(&g_mem_lock);
  CUresult r = resolve(op, &dst, &src);
  pthread_rwlock_unlock(&g_mem_lock);
  return r;
}

/* Runs a copy or memset: resolves its ends again (the memory may have been
 * freed since it was queued) and moves the bytes. */
static CUresult run_copy(const struct op *op) {
  unsigned char *dst = NULL;
  const unsigned char *src = NULL;
  pthread_rwlock_rdlock(&g_mem_lock);
  CUresult r = resolve(op, &dst, &src);
  if (r == CUDA_SUCCESS && op->n != 0) {
    if (op->kind == OP_MEMSET) {
      memset(dst, op->value, op->n);
    } else {
      memmove(dst, src, op->n);
      atomic_fetch_add(&g_bytes_copied, (unsigned long long)op->n);
    }
  }
  pthread_rwlock_unlock(&g_mem_lock);
  return r;
}

/* ------------------------------------------------------------------ */
/* Events                                                               */
/* ------------------------------------------------------------------ */

struct CUevent_st {
  uint32_t magic;
  struct CUevent_st *next_live;
  unsigned int flags;
  atomic_int refs; /* the handle's, one per queued record or wait, one per caller inside */
  pthread_mutex_t lock;
  pthread_cond_t cond;
  uint64_t recorded; /* records made so far */
  uint64_t reached;  /* the latest record a stream has reached */
};

static pthread_mutex_t g_events_lock = PTHREAD_MUTEX_INITIALIZER;
static struct CUevent_st *g_events;

static CUresult get_event(CUevent handle, struct CUevent_st **out) {
  pthread_mutex_lock(&g_events_lock);
  struct CUevent_st *found = NULL;
  for (struct CUevent_st *e = g_events; e != NULL; e = e->next_live) {
    if (e == handle) {
      found = e;
      atomic_fetch_add(&e->refs, 1);
      break;
    }
  }
  pthread_mutex_unlock(&g_events_lock);
  *out = found;
  return found != NULL ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

static void put_event(struct CUevent_st *e) {
  if (atomic_fetch_sub(&e->refs, 1) != 1) return;
  pthread_mutex_destroy(&e->lock);
  pthread_cond_destroy(&e->cond);
  e->magic = 0;
  free(e);
}

static void event_reach(struct CUevent_st *e, uint64_t seq) {
  pthread_mutex_lock(&e->lock);
  if (e->reached < seq) e->reached = seq;
  pthread_cond_broadcast(&e->cond);
  pthread_mutex_unlock(&e->lock);
}

static void event_wait(struct CUevent_st *e, uint64_t seq) {
  pthread_mutex_lock(&e->lock);
  while (e->reached < seq) pthread_cond_wait(&e->cond, &e->lock);
  pthread_mutex_unlock(&e->lock);
}

static uint64_t event_latest(struct CUevent_st *e) {
  pthread_mutex_lock(&e->lock);
  uint64_t seq = e->recorded;
  pthread_mutex_unlock(&e->lock);
  return seq;
}

/* ------------------------------------------------------------------ */
/* Streams                                                              */
/* ------------------------------------------------------------------ */

struct CUstream_st {
  uint32_t magic;
  struct CUstream_st *next_live;
  struct CUctx_st *ctx;
  unsigned int flags;
  int users; /* callers inside that hold it (g_streams_lock) */
  pthread_t thread;
  pthread_mutex_t lock;
  pthread_cond_t work; /* queue no longer empty, or stopping */
  pthread_cond_t done; /* an operation finished */
  struct op *head;
  struct op *tail;
  uint64_t enqueued;
  uint64_t completed;
  bool stopping;
  CUresult error; /* sticky: the first operation that failed */
};

static pthread_mutex_t g_streams_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_streams_idle = PTHREAD_COND_INITIALIZER;
static struct CUstream_st *g_streams;

static CUresult get_stream(CUstream handle, struct CUstream_st **out) {
  pthread_mutex_lock(&g_streams_lock);
  struct CUstream_st *found = NULL;
  for (struct CUstream_st *s = g_streams; s != NULL; s = s->next_live) {
    if (s == handle) {
      found = s;
      ++s->users;
      break;
    }
  }
  pthread_mutex_unlock(&g_streams_lock);
  *out = found;
  return found != NULL ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

static void put_stream(struct CUstream_st *s) {
  pthread_mutex_lock(&g_streams_lock);
  if (--s->users == 0) pthread_cond_broadcast(&g_streams_idle);
  pthread_mutex_unlock(&g_streams_lock);
}

static void fail_stream(struct CUstream_st *s, CUresult r) {
  pthread_mutex_lock(&s->lock);
  if (s->error == CUDA_SUCCESS) s->error = r;
  pthread_mutex_unlock(&s->lock);
  /* As on a GPU, a faulting operation leaves the context unusable. */
  int expected = 0;
  atomic_compare_exchange_strong(&s->ctx->sticky, &expected, (int)r);
}

static void run_host_fn(const struct op *op) {
  t_in_host_fn = 1;
  if (op->kind == OP_CALLBACK) {
    op->callback(op->stream, op->status, op->user_data);
  } else {
    op->fn(op->user_data);
  }
  t_in_host_fn = 0;
}

/* Runs one operation on the calling thread. */
static CUresult run_op(const struct op *op) {
  switch (op->kind) {
    case OP_HTOD:
    case OP_DTOH:
    case OP_DTOD:
    case OP_MEMSET:
      return run_copy(op) == CUDA_SUCCESS ? CUDA_SUCCESS : CUDA_ERROR_ILLEGAL_ADDRESS;
    case OP_HOST_FN:
    case OP_CALLBACK:
      run_host_fn(op);
      return CUDA_SUCCESS;
    case OP_RECORD:
      event_reach(op->event, op->seq);
      return CUDA_SUCCESS;
    case OP_WAIT:
      event_wait(op->event, op->seq);
      return CUDA_SUCCESS;
  }
  return CUDA_SUCCESS;
}

static void free_op(struct op *op) {
  if (op->event != NULL) put_event(op->event);
  free(op);
}

static void *stream_worker(void *arg) {
  struct CUstream_st *s = arg;
  for (;;) {
    pthread_mutex_lock(&s->lock);
    while (s->head == NULL && !s->stopping) pthread_cond_wait(&s->work, &s->lock);
    struct op *op = s->head;
    if (op == NULL) {
      pthread_mutex_unlock(&s->lock);
      break;
    }
    s->head = op->next;
    if (s->head == NULL) s->tail = NULL;
    /* A callback is told the error the stream met before it, or the
     * context's (a fault on another stream leaves it unusable too). */
    if (op->kind == OP_CALLBACK) {
      op->status = s->error != CUDA_SUCCESS ? s->error : (CUresult)atomic_load(&s->ctx->sticky);
    }
    pthread_mutex_unlock(&s->lock);

    CUresult r = run_op(op);
    if (r != CUDA_SUCCESS) fail_stream(s, r);
    free_op(op);

    pthread_mutex_lock(&s->lock);
    ++s->completed;
    pthread_cond_broadcast(&s->done);
    pthread_mutex_unlock(&s->lock);
  }
  return NULL;
}

static void enqueue(struct CUstream_st *s, struct op *op) {
  op->next = NULL;
  pthread_mutex_lock(&s->lock);
  if (s->tail != NULL) {
    s->tail->next = op;
  } else {
    s->head = op;
  }
  s->tail = op;
  ++s->enqueued;
  pthread_cond_signal(&s->work);
  pthread_mutex_unlock(&s->lock);
}

/* Waits until s has finished what was queued before; its sticky error. */
static CUresult drain(struct CUstream_st *s) {
  pthread_mutex_lock(&s->lock);
  const uint64_t target = s->enqueued;
  while (s->completed < target) pthread_cond_wait(&s->done, &s->lock);
  CUresult r = s->error;
  pthread_mutex_unlock(&s->lock);
  return r;
}

/* The NULL stream is the legacy default stream: what runs on it first waits
 * for the work already queued on the context's blocking streams (those not
 * made with CU_STREAM_NON_BLOCKING). */
static CUresult legacy_sync(struct CUctx_st *ctx) {
  pthread_mutex_lock(&g_streams_lock);
  size_t count = 0;
  for (struct CUstream_st *s = g_streams; s != NULL; s = s->next_live) {
    if (s->ctx == ctx && !(s->flags & CU_STREAM_NON_BLOCKING)) ++count;
  }
  struct CUstream_st **held = count != 0 ? calloc(count, sizeof *held) : NULL;
  if (count != 0 && held == NULL) {
    pthread_mutex_unlock(&g_streams_lock);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  size_t n = 0;
  for (struct CUstream_st *s = g_streams; s != NULL && n < count; s = s->next_live) {
    if (s->ctx == ctx && !(s->flags & CU_STREAM_NON_BLOCKING)) {
      ++s->users;
      held[n++] = s;
    }
  }
  pthread_mutex_unlock(&g_streams_lock);
  CUresult result = CUDA_SUCCESS;
  for (size_t i = 0; i < n; ++i) {
    CUresult r = drain(held[i]);
    if (result == CUDA_SUCCESS) result = r;
    put_stream(held[i]);
  }
  free(held);
  return result;
}

/* Queues op on hStream, or runs it now in the caller on the NULL stream.
 * Takes op (and the event reference it holds) in every case. */
static CUresult submit(struct CUctx_st *ctx, CUstream hStream, struct op *op) {
  if (hStream == NULL) {
    CUresult r = legacy_sync(ctx);
    if (op->kind == OP_CALLBACK) {
      /* A callback always runs, told what the stream met. */
      op->status = r;
      run_op(op);
      free_op(op);
      return CUDA_SUCCESS;
    }
    /* A record always runs: an event must not wait for a point never reached. */
    if (r == CUDA_SUCCESS || op->kind == OP_RECORD) {
      CUresult ran = run_op(op);
      if (r == CUDA_SUCCESS) r = ran;
    }
    free_op(op);
    return r;
  }
  struct CUstream_st *s = NULL;
  CUresult r = get_stream(hStream, &s);
  if (r != CUDA_SUCCESS) {
    free_op(op);
    return r;
  }
  enqueue(s, op);
  put_stream(s);
  return CUDA_SUCCESS;
}

STANDIN_API CUresult CUDAAPI cuStreamCreate(CUstream *phStream, unsigned int Flags) {
  struct CUctx_st *ctx = NULL;
  CUresult r = enter_ctx(&ctx);
  if (r != CUDA_SUCCESS) return r;
  if (phStream == NULL || (Flags & ~(unsigned int)CU_STREAM_NON_BLOCKING) != 0) return CUDA_ERROR_INVALID_VALUE;
  struct CUstream_st *s = calloc(1, sizeof *s);
  if (s == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
  s->magic = kStreamMagic;
  s->ctx = ctx;
  s->flags = Flags;
  pthread_mutex_init(&s->lock, NULL);
  pthread_cond_init(&s->work, NULL);
  pthread_cond_init(&s->done, NULL);
  /* Signals go to the application's threads, not to the worker. */
  sigset_t all;
  sigset_t old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  int failed = pthread_create(&s->thread, NULL, stream_worker, s);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  if (failed != 0) {
    pthread_mutex_destroy(&s->lock);
    pthread_cond_destroy(&s->work);
    pthread_cond_destroy(&s->done);
    free(s);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  pthread_mutex_lock(&g_streams_lock);
  s->next_live = g_streams;
  g_streams = s;
  pthread_mutex_unlock(&g_streams_lock);
  *phStream = s;
  return CUDA_SUCCESS;
}

STANDIN_API CUresult CUDAAPI cuStreamDestroy_v2(CUstream hStream) {
  struct CUctx_st *ctx = NULL;
  CUresult r = enter_ctx(&ctx);
  if (r != CUDA_SUCCESS) return r;
  pthread_mutex_lock(&g_streams_lock);
  struct CUstream_st *s = NULL;
  for (struct CUstream_st **link = &g_streams; *link != NULL; link = &(*link)->next_live) {
    if (*link == hStream) {
      s = *link;
      *link = s->next_live;
      break;
    }
  }
  /* Callers still inside (queuing, synchronising) finish first. */
  while (s != NULL && s->users != 0) pthread_cond_wait(&g_streams_idle, &g_streams_lock);
  pthread_mutex_unlock(&g_streams_lock);
  if (s == NULL) return CUDA_ERROR_INVALID_HANDLE;

  /* Queued work runs to its end, then the worker leaves. */
  pthread_mutex_lock(&s->lock);
  s->stopping = true;
  pthread_cond_signal(&s->work);
  pthread_mutex_unlock(&s->lock);
  pthread_join(s->thread, NULL);
  pthread_mutex_destroy(&s->lock);
  pthread_cond_destroy(&s->work);
  pthread_cond_destroy(&s->done);
  s->magic = 0;
  free(s);
  return CUDA_SUCCESS;
}

STANDIN_API CUresult CUDAAPI cuStreamSynchronize(CUstream hStream) {
  struct CUctx_st *ctx = NULL;
  CUresult r = enter_ctx(&ctx);
  if (r != CUDA_SUCCESS) return r;
  if (hStream == NULL) return legacy_sync(ctx);
  struct CUstream_st *s = NULL;
  r = get_stream(hStream, &s);
  if (r != CUDA_SUCCESS) return r;
  r = drain(s);
  put_stream(s);
  return r;
}

STANDIN_API CUresult CUDAAPI cuStreamQuery(CUstream hStream) {
  struct CUctx_st *ctx = NULL;
  CUresult r = enter_ctx(&ctx);
  if (r != CUDA_SUCCESS) return r;
  if (hStream == NULL) {
    /* Idle when every blocking stream of the context is. */
    pthread_mutex_lock(&g_streams_lock);
    for (struct CUstream_st *s = g_streams; s != NULL && r == CUDA_SUCCESS; s = s->next_live) {
      if (s->ctx != ctx || (s->flags & CU_STREAM_NON_BLOCKING)) continue;
      pthread_mutex_lock(&s->lock);
      if (s->error != CUDA_SUCCESS) {
        r = s->error;
      } else if (s->completed != s->enqueued) {
        r = CUDA_ERROR_NOT_READY;
      }
      pthread_mutex_unlock(&s->lock);
    }
    pthread_mutex_unlock(&g_streams_lock);
    return r;
  }
  struct CUstream_st *s = NULL;
  r = get_stream(hStream, &s);
  if (r != CUDA_SUCCESS) return r;
  pthread_mutex_lock(&s->lock);
  if (s->error != CUDA_SUCCESS) {
    r = s->error;
  } else if (s->completed != s->enqueued) {
    r = CUDA_ERROR_NOT_READY;
  }
  pthread_mutex_unlock(&s->lock);
  put_stream(s);
  return r;
}

STANDIN_API CUresult CUDAAPI cuLaunchHostFunc(CUstream hStream, CUhostFn fn, void *userData) {
  struct CUctx_st *ctx = NULL;
  CUresult r = enter_ctx(&ctx);
  if (r != CUDA_SUCCESS) return r;
  if (fn == NULL) return CUDA_ERROR_INVALID_VALUE;
  struct op *op = calloc(1, sizeof *op);
  if (op == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
  op->kind = OP_HOST_FN;
  op->fn = fn;
  op->user_data = userData;
  return submit(ctx, hStream, op);
}

/* As the driver's: runs after everything queued before it, even after a
 * fault, with the error met (CUDA_SUCCESS if none); may not call the driver. */
STANDIN_API CUresult CUDAAPI cuStreamAddCallback(CUstream hStream, CUstreamCallback callback, void *userData,
                                                 unsigned int flags) {
  struct CUctx_st *ctx = NULL;
  CUresult r = enter_ctx(&ctx);
  if (r != CUDA_SUCCESS) return r;
  if (callback == NULL || flags != 0) return CUDA_ERROR_INVALID_VALUE;
  struct op *op = calloc(1, sizeof *op);
  if (op == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
  op->kind = OP_CALLBACK;
  op->callback = callback;
  op->stream = hStream;
  op->user_data = userData;
  return submit(ctx, hStream, op);
}

/* The copies. */

static CUresult copy(enum op_kind kind, CUdeviceptr dst_dev, void *dst_host, CUdeviceptr src_dev,
                     const void *src_host, size_t n, unsigned char value, bool async, CUstream hStream) {
  struct CUctx_st *ctx = NULL;
  CUresult r = enter_ctx(&ctx);
  if (r != CUDA_SUCCESS) return r;
  struct op *op = calloc(1, sizeof *op);
  if (op == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
  op->kind = kind;
  op->dst_dev = dst_dev;
  op->dst_host = dst_host;
  op->src_dev = src_dev;
  op->src_host = src_host;
  op->n = n;
  op->value = value;
  r = check_copy(op);
  if (r != CUDA_SUCCESS) {
    free(op);
    return r;
  }
  if (!async) hStream = NULL;
  return submit(ctx, hStream, op);
}

STANDIN_API CUresult CUDAAPI cuMemcpyHtoD_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount) {
  return copy(OP_HTOD, dstDevice, NULL, 0, srcHost, ByteCount, 0, false, NULL);
}

STANDIN_API CUresult CUDAAPI cuMemcpyDtoH_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount) {
  return copy(OP_DTOH, 0, dstHost, srcDevice, NULL, ByteCount, 0, false, NULL);
}

STANDIN_API CUresult CUDAAPI cuMemcpyDtoD_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount) {
  return copy(OP_DTOD, dstDevice, NULL, srcDevice, NULL, ByteCount, 0, false, NULL);
}

STANDIN_API CUresult CUDAAPI cuMemcpyHtoDAsync_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount,
                                                  CUstream hStream) {
  return copy(OP_HTOD, dstDevice, NULL, 0, srcHost, ByteCount, 0, true, hStream);
}

STANDIN_API CUresult CUDAAPI cuMemcpyDtoHAsync_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount,
                                                  CUstream hStream) {
  return copy(OP_DTOH, 0, dstHost, srcDevice, NULL, ByteCount, 0, true, hStream);
}

STANDIN_API CUresult CUDAAPI cuMemcpyDtoDAsync_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount,
                                                  CUstream hStream) {
  return copy(OP_DTOD, dstDevice, NULL, srcDevice, NULL, ByteCount, 0, true, hStream);
}

/* A 2D copy: `Height` rows of `WidthInBytes` bytes, each row `srcPitch`
 * (`dstPitch`) bytes after the one before it, from (srcXInBytes, srcY).
 * Every row is checked before any is queued, then the rows run in order on
 * the stream as copies of their own. Host or device memory at either end,
 * not both host (nor arrays or unified addressing: not supported here). */
STANDIN_API CUresult CUDAAPI cuMemcpy2DAsync_v2(const CUDA_MEMCPY2D *pCopy, CUstream hStream) {
  struct CUctx_st *ctx = NULL;
  CUresult r = enter_ctx(&ctx);
  if (r != CUDA_SUCCESS) return r;
  if (pCopy == NULL) return CUDA_ERROR_INVALID_VALUE;
  const CUDA_MEMCPY2D *p = pCopy;
  const bool src_dev = p->srcMemoryType == CU_MEMORYTYPE_DEVICE, dst_dev = p->dstMemoryType == CU_MEMORYTYPE_DEVICE;
  if ((!src_dev && p->srcMemoryType != CU_MEMORYTYPE_HOST) || (!dst_dev && p->dstMemoryType != CU_MEMORYTYPE_HOST)) {
    return CUDA_ERROR_NOT_SUPPORTED;
  }
  if (!src_dev && !dst_dev) return CUDA_ERROR_NOT_SUPPORTED;
  /* The driver's rule: each pitch holds its row from its x offset. */
  if (p->srcPitch < p->WidthInBytes || p->srcPitch - p->WidthInBytes < p->srcXInBytes ||
      p->dstPitch < p->WidthInBytes || p->dstPitch - p->WidthInBytes < p->dstXInBytes) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (p->WidthInBytes == 0 || p->Height == 0) return CUDA_SUCCESS;
  struct op **rows = calloc(p->Height, sizeof *rows);
  if (rows == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
  const enum op_kind kind = src_dev && dst_dev ? OP_DTOD : dst_dev ? OP_HTOD : OP_DTOH;
  const uintptr_t src0 = src_dev ? (uintptr_t)p->srcDevice : (uintptr_t)p->srcHost;
  const uintptr_t dst0 = dst_dev ? (uintptr_t)p->dstDevice : (uintptr_t)p->dstHost;
  for (size_t y = 0; y < p->Height && r == CUDA_SUCCESS; ++y) {
    uintptr_t src = 0, dst = 0;
    /* Row y starts (srcY + y) pitches and srcXInBytes bytes in. */
    if (__builtin_mul_overflow(p->srcY + y, p->srcPitch, &src) || __builtin_add_overflow(src, p->srcXInBytes, &src) ||
        __builtin_add_overflow(src, src0, &src) || __builtin_mul_overflow(p->dstY + y, p->dstPitch, &dst) ||
        __builtin_add_overflow(dst, p->dstXInBytes, &dst) || __builtin_add_overflow(dst, dst0, &dst)) {
      r = CUDA_ERROR_INVALID_VALUE;
      break;
    }
    struct op *op = calloc(1, sizeof *op);
    if (op == NULL) {
      r = CUDA_ERROR_OUT_OF_MEMORY;
      break;
    }
    op->kind = kind;
    op->n = p->WidthInBytes;
    if (src_dev) op->src_dev = (CUdeviceptr)src; else op->src_host = (const void *)src;
    if (dst_dev) op->dst_dev = (CUdeviceptr)dst; else op->dst_host = (void *)dst;
    rows[y] = op;
    r = check_copy(op);
  }
  if (r == CUDA_SUCCESS) atomic_fetch_add(&g_copies_2d, 1);
  /* submit() takes each op (and frees it where it fails). */
  for (size_t y = 0; y < p->Height && rows[y] != NULL; ++y) {
    if (r == CUDA_SUCCESS) {
      r = submit(ctx, hStream, rows[y]);
    } else {
      free_op(rows[y]);
    }
  }
  free(rows);
  return r;
}

STANDIN_API CUresult CUDAAPI cuMemsetD8_v2(CUdeviceptr dstDevice, unsigned char uc, size_t N) {
  return copy(OP_MEMSET, dstDevice, NULL, 0, NULL, N, uc, false, NULL);
}

/* The event calls. */

STANDIN_API CUresult CUDAAPI cuEventCreate(CUevent *phEvent, unsigned int Flags) {
  struct CUctx_st *ctx = NULL;
  CUresult r = enter_ctx(&ctx);
  if (r != CUDA_SUCCESS) return r;
  const unsigned int accepted = CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING;
  if (phEvent == NULL || (Flags & ~accepted) != 0) return CUDA_ERROR_INVALID_VALUE;
  struct CUevent_st *e = calloc(1, sizeof *e);
  if (e == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
  e->magic = kEventMagic;
  e->flags = Flags;
  atomic_store(&e->refs, 1);
  pthread_mutex_init(&e->lock, NULL);
  pthread_cond_init(&e->cond, NULL);
  pthread_mutex_lock(&g_events_lock);
  e->next_live = g_events;
  g_events = e;
  pthread_mutex_unlock(&g_events_lock);
  *phEvent = e;
  return CUDA_SUCCESS;
}

STANDIN_API CUresult CUDAAPI cuEventDestroy_v2(CUevent hEvent) {
  struct CUctx_st *ctx = NULL;
  CUresult r = enter_ctx(&ctx);
  if (r != CUDA_SUCCESS) return r;
  pthread_mutex_lock(&g_events_lock);
  struct CUevent_st *e = NULL;
  for (struct CUevent_st **link = &g_events; *link != NULL; link = &(*link)->next_live) {
    if (*link == hEvent) {
      e = *link;
      *link = e->next_live;
      break;
    }
  }
  pthread_mutex_unlock(&g_events_lock);
  if (e == NULL) return CUDA_ERROR_INVALID_HANDLE;
  /* Records and waits still queued keep it alive until they have run. */
  put_event(e);
  return CUDA_SUCCESS;
}

STANDIN_API CUresult CUDAAPI cuEventRecord(CUevent hEvent, CUstream hStream) {
  struct CUctx_st *ctx = NULL;
  CUresult r = enter_ctx(&ctx);
  if (r != CUDA_SUCCESS) return r;
  struct CUevent_st *e = NULL;
  r = get_event(hEvent, &e);
  if (r != CUDA_SUCCESS) return r;
  struct op *op = calloc(1, sizeof *op);
  if (op == NULL) {
    put_event(e);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  op->kind = OP_RECORD;
  op->event = e; /* the reference get_event took */
  struct CUstream_st *s = NULL;
  if (hStream != NULL) {
    /* Held from before the record counts until it is queued: a record that
     * is refused, or never queued, changes nothing. */
    r = get_stream(hStream, &s);
    if (r != CUDA_SUCCESS) {
      free_op(op);
      return r;
    }
  }
  pthread_mutex_lock(&e->lock);
  op->seq = ++e->recorded;
  pthread_mutex_unlock(&e->lock);
  if (s == NULL) return submit(ctx, NULL, op);
  enqueue(s, op);
  put_stream(s);
  return CUDA_SUCCESS;
}

STANDIN_API CUresult CUDAAPI cuEventQuery(CUevent hEvent) {
  struct CUctx_st *ctx = NULL;
  CUresult r = enter_ctx(&ctx);
  if (r != CUDA_SUCCESS) return r;
  struct CUevent_st *e = NULL;
  r = get_event(hEvent, &e);
  if (r != CUDA_SUCCESS) return r;
  pthread_mutex_lock(&e->lock);
  r = e->reached >= e->recorded ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
  pthread_mutex_unlock(&e->lock);
  put_event(e);
  return r;
}

STANDIN_API CUresult CUDAAPI cuEventSynchronize(CUevent hEvent) {
  struct CUctx_st *ctx = NULL;
  CUresult r = enter_ctx(&ctx);
  if (r != CUDA_SUCCESS) return r;
  struct CUevent_st *e = NULL;
  r = get_event(hEvent, &e);
  if (r != CUDA_SUCCESS) return r;
  event_wait(e, event_latest(e));
  put_event(e);
  return CUDA_SUCCESS;
}

STANDIN_API CUresult CUDAAPI cuStreamWaitEvent(CUstream hStream, CUevent hEvent, unsigned int Flags) {
  struct CUctx_st *ctx = NULL;
  CUresult r = enter_ctx(&ctx);
  if (r != CUDA_SUCCESS) return r;
  if (Flags != CU_EVENT_WAIT_DEFAULT) return CUDA_ERROR_INVALID_VALUE;
  struct CUevent_st *e = NULL;
  r = get_event(hEvent, &e);
  if (r != CUDA_SUCCESS) return r;
  struct op *op = calloc(1, sizeof *op);
  if (op == NULL) {
    put_event(e);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  op->kind = OP_WAIT;
  op->event = e;
  op->seq = event_latest(e); /* the record made last, as the driver does */
  return submit(ctx, hStream, op);
}

/* ------------------------------------------------------------------ */
/* IPC                                                                  */
/* ------------------------------------------------------------------ */

/* What a handle carries; the rest of its 64 bytes are zero. */
struct ipc_wire {
  uint32_t magic;
  uint32_t version;
  int32_t pid;    /* the exporter */
  int32_t fd;     /* the memfd's descriptor in the exporter */
  uint64_t size;  /* the allocation's size */
  int32_t device; /* the exporter's device ordinal */
  uint32_t zero;
  uint64_t id;    /* the memfd's random id, also in its name */
  uint64_t check; /* FNV-1a of the fields above */
};
_Static_assert(sizeof(struct ipc_wire) <= sizeof(CUipcMemHandle), "an IPC handle holds the wire form");

static uint64_t fnv1a(const void *data, size_t n) {
  const unsigned char *p = data;
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 0x100000001b3ull;
  }
  return h;
}

STANDIN_API CUresult CUDAAPI cuIpcGetMemHandle(CUipcMemHandle *pHandle, CUdeviceptr dptr) {
  struct CUctx_st *ctx = NULL;
  CUresult r = enter_ctx(&ctx);
  if (r != CUDA_SUCCESS) return r;
  if (pHandle == NULL) return CUDA_ERROR_INVALID_VALUE;
  if (!g_ipc) return CUDA_ERROR_NOT_SUPPORTED;
  struct ipc_wire wire;
  memset(&wire, 0, sizeof wire);
  pthread_rwlock_rdlock(&g_mem_lock);
  struct region *reg = region_with_base((uintptr_t)dptr, REGION_DEVICE);
  if (reg != NULL) {
    wire.magic = kIpcMagic;
    wire.version = kIpcVersion;
    wire.pid = (int32_t)getpid();
    wire.fd = reg->fd;
    wire.size = reg->size;
    wire.device = reg->ctx->device;
    wire.id = reg->id;
    wire.check = fnv1a(&wire, offsetof(struct ipc_wire, check));
  }
  pthread_rwlock_unlock(&g_mem_lock);
  if (reg == NULL) return CUDA_ERROR_INVALID_VALUE;
  memset(pHandle, 0, sizeof *pHandle);
  memcpy(pHandle->reserved, &wire, sizeof wire);
  return CUDA_SUCCESS;
}

/* Opens the exporter's memfd: through /proc/<pid>/fd/<n>, or with
 * pidfd_getfd where /proc refuses. -1 with *why set when neither works. */
static int open_exporter_fd(pid_t pid, int fd, CUresult *why) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/fd/%d", (int)pid, fd);
  int opened = open(path, O_RDWR | O_CLOEXEC);
  if (opened >= 0) return opened;
  int saved = errno;
  *why = CUDA_ERROR_MAP_FAILED;
  if (saved != EACCES && saved != EPERM) return -1;
#if defined(SYS_pidfd_open) && defined(SYS_pidfd_getfd)
  int pidfd = (int)syscall(SYS_pidfd_open, pid, 0);
  if (pidfd < 0) return -1;
  opened = (int)syscall(SYS_pidfd_getfd, pidfd, fd, 0);
  close(pidfd);
  if (opened >= 0) {
    int flags = fcntl(opened, F_GETFD);
    if (flags >= 0) fcntl(opened, F_SETFD, flags | FD_CLOEXEC);
  }
  return opened;
#else
  return -1;
#endif
}

/* True when fd is the memfd the handle names: its name carries the id and
 * its size is the allocation's, rounded to pages. */
static bool is_exported_memfd(int fd, const struct ipc_wire *wire) {
  struct stat st;
  size_t map_size = 0;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) return false;
  if (!round_to_pages(wire->size, &map_size) || (uint64_t)st.st_size != map_size) return false;
  char link[64];
  char target[256];
  snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  ssize_t n = readlink(link, target, sizeof target - 1);
  if (n < 0) return false;
  target[n] = '\0';
  char name[64];
  char expected[96];
  memfd_name(name, sizeof name, wire->id);
  snprintf(expected, sizeof expected, "/memfd:%s", name);
  size_t len = strlen(expected);
  if (strncmp(target, expected, len) != 0) return false;
  return target[len] == '\0' || strcmp(target + len, " (deleted)") == 0;
}

static struct region *opened_mapping(pid_t exporter, uint64_t id) {
  for (struct region *r = g_regions; r != NULL; r = r->next) {
    if (r->kind == REGION_IPC && r->exporter == exporter && r->id == id) return r;
  }
  return NULL;
}

STANDIN_API CUresult CUDAAPI cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int Flags) {
  struct CUctx_st *ctx = NULL;
  CUresult r = enter_ctx(&ctx);
  if (r != CUDA_SUCCESS) return r;
  if (pdptr == NULL || Flags != CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS) return CUDA_ERROR_INVALID_VALUE;
  struct ipc_wire wire;
  memcpy(&wire, handle.reserved, sizeof wire);
  bool tail_zero = true;
  for (size_t i = sizeof wire; i < sizeof handle.reserved; ++i) tail_zero = tail_zero && handle.reserved[i] == 0;
  if (wire.magic != kIpcMagic || wire.version != kIpcVersion || !tail_zero || wire.zero != 0 ||
      wire.check != fnv1a(&wire, offsetof(struct ipc_wire, check)) || wire.pid <= 0 || wire.fd < 0 ||
      wire.size == 0 || wire.device < 0 || wire.device >= kMaxDevices) {
    return CUDA_ERROR_INVALID_HANDLE;
  }
  /* The driver refuses to open a handle in the process that exported it. */
  if ((pid_t)wire.pid == getpid()) return CUDA_ERROR_INVALID_CONTEXT;

  pthread_rwlock_wrlock(&g_mem_lock);
  struct region *reg = opened_mapping(wire.pid, wire.id);
  if (reg != NULL) {
    ++reg->opens;
    *pdptr = (CUdeviceptr)reg->base;
  }
  pthread_rwlock_unlock(&g_mem_lock);
  if (reg != NULL) return CUDA_SUCCESS;

  CUresult why = CUDA_ERROR_MAP_FAILED;
  int fd = open_exporter_fd(wire.pid, wire.fd, &why);
  if (fd < 0) return why;
  if (!is_exported_memfd(fd, &wire)) {
    close(fd);
    return CUDA_ERROR_INVALID_HANDLE;
  }
  size_t map_size = 0;
  round_to_pages(wire.size, &map_size);
  reg = calloc(1, sizeof *reg);
  if (reg == NULL || !map_device(fd, map_size, &reg->base, &reg->shadow)) {
    close(fd);
    free(reg);
    return CUDA_ERROR_MAP_FAILED;
  }
  close(fd); /* the mappings keep the memory */
  reg->kind = REGION_IPC;
  reg->size = wire.size;
  reg->map_size = map_size;
  reg->fd = -1;
  reg->ctx = ctx;
  reg->id = wire.id;
  reg->buffer_id = atomic_fetch_add(&g_next_buffer_id, 1);
  reg->exporter = wire.pid;
  reg->opens = 1;

  pthread_rwlock_wrlock(&g_mem_lock);
  struct region *raced = opened_mapping(wire.pid, wire.id);
  if (raced != NULL) {
    ++raced->opens;
    *pdptr = (CUdeviceptr)raced->base;
  } else {
    insert_region(reg);
    *pdptr = (CUdeviceptr)reg->base;
  }
  pthread_rwlock_unlock(&g_mem_lock);
  if (raced != NULL) {
    unmap_device(reg);
    free(reg);
  }
  return CUDA_SUCCESS;
}

STANDIN_API CUresult CUDAAPI cuIpcCloseMemHandle(CUdeviceptr dptr) {
  struct CUctx_st *ctx = NULL;
  CUresult r = enter_ctx(&ctx);
  if (r != CUDA_SUCCESS) return r;
  pthread_rwlock_wrlock(&g_mem_lock);
  struct region *reg = region_with_base((uintptr_t)dptr, REGION_IPC);
  bool last = false;
  if (reg != NULL && --reg->opens == 0) {
    unlink_region(reg);
    last = true;
  }
  pthread_rwlock_unlock(&g_mem_lock);
  if (reg == NULL) return CUDA_ERROR_INVALID_VALUE;
  if (last) {
    unmap_device(reg);
    free(reg);
  }
  return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------ */
/* Virtual memory management                                            */
/* ------------------------------------------------------------------ */

#define VMM_MEMFD_PREFIX "standin-cuda-vmm-"

enum { kVmmGranularity = 2 << 20 };

/* A physical allocation (cuMemCreate, cuMemImportFromShareableHandle): a
 * memfd, alive while a handle or a mapping holds it. Its handle is its
 * address, looked up in g_vmm_allocs before use. */
struct vmm_alloc {
  struct vmm_alloc *next;
  int fd;
  size_t size;
  int device;
  unsigned int handle_types; /* CUmemAllocationHandleType bits it may be exported as */
  bool imported;             /* another process's memory: counts against no device here */
  int handles;               /* create, import and retain, less release */
  int mappings;
};

/* A reservation (cuMemAddressReserve): PROT_NONE addresses, and a shadow of
 * the same size where mappings get their read-write view. */
struct vmm_reserve {
  struct vmm_reserve *next;
  uintptr_t base;
  size_t size;
  unsigned char *shadow;
};

static struct vmm_alloc *g_vmm_allocs;
static struct vmm_reserve *g_vmm_reserves;

STANDIN_API int standin_cuda_live_vmm_allocations(void) {
  int live = 0;
  pthread_rwlock_rdlock(&g_mem_lock);
  for (struct vmm_alloc *a = g_vmm_allocs; a != NULL; a = a->next) ++live;
  pthread_rwlock_unlock(&g_mem_lock);
  return live;
}

/* Lock held. */
static struct vmm_alloc *known_alloc(CUmemGenericAllocationHandle handle) {
  for (struct vmm_alloc *a = g_vmm_allocs; a != NULL; a = a->next) {
    if ((CUmemGenericAllocationHandle)(uintptr_t)a == handle && a->handles > 0) return a;
  }
  return NULL;
}

/* Frees `a` once nothing holds it. Lock held. */
static void settle_alloc(struct vmm_alloc *a) {
  if (a->handles > 0 || a->mappings > 0) return;
  for (struct vmm_alloc **link = &g_vmm_allocs; *link != NULL; link = &(*link)->next) {
    if (*link == a) {
      *link = a->next;
      break;
    }
  }
  if (!a->imported) g_used[a->device] -= a->size;
  close(a->fd);
  free(a);
}

static bool valid_prop(const CUmemAllocationProp *prop) {
  return prop != NULL && prop->type == CU_MEM_ALLOCATION_TYPE_PINNED &&
         prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE && prop->location.id >= 0 &&
         prop->location.id < g_device_count;
}

STANDIN_API CUresult CUDAAPI cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                                           CUmemAllocationGranularity_flags option) {
  CUresult r = enter();
  if (r != CUDA_SUCCESS) return r;
  if (granularity == NULL || !valid_prop(prop) ||
      (option != CU_MEM_ALLOC_GRANULARITY_MINIMUM && option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  *granularity = kVmmGranularity;
  return CUDA_SUCCESS;
}

STANDIN_API CUresult CUDAAPI cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                                         const CUmemAllocationProp *prop, unsigned long long flags) {
  CUresult r = enter();
  if (r != CUDA_SUCCESS) return r;
  if (handle == NULL || flags != 0 || !valid_prop(prop) || size == 0 || size % kVmmGranularity != 0) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (((unsigned int)prop->requestedHandleTypes & ~(unsigned int)CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) != 0) {
    return CUDA_ERROR_NOT_SUPPORTED;
  }
  const int device = prop->location.id;
  pthread_rwlock_wrlock(&g_mem_lock);
  bool fits = size <= g_capacity && g_used[device] <= g_capacity - size;
  if (fits) g_used[device] += size;
  pthread_rwlock_unlock(&g_mem_lock);
  if (!fits) return CUDA_ERROR_OUT_OF_MEMORY;
  struct vmm_alloc *a = calloc(1, sizeof *a);
  char name[96];
  snprintf(name, sizeof name, VMM_MEMFD_PREFIX "d%d-%016llx", device, (unsigned long long)random_id());
  int fd = a != NULL ? memfd_create(name, MFD_CLOEXEC) : -1;
  if (fd < 0 || ftruncate(fd, (off_t)size) != 0) {
    if (fd >= 0) close(fd);
    free(a);
    pthread_rwlock_wrlock(&g_mem_lock);
    g_used[device] -= size;
    pthread_rwlock_unlock(&g_mem_lock);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  a->fd = fd;
  a->size = size;
  a->device = device;
  a->handle_types = (unsigned int)prop->requestedHandleTypes;
  a->handles = 1;
  pthread_rwlock_wrlock(&g_mem_lock);
  a->next = g_vmm_allocs;
  g_vmm_allocs = a;
  pthread_rwlock_unlock(&g_mem_lock);
  *handle = (CUmemGenericAllocationHandle)(uintptr_t)a;
  return CUDA_SUCCESS;
}

STANDIN_API CUresult CUDAAPI cuMemRelease(CUmemGenericAllocationHandle handle) {
  CUresult r = enter();
  if (r != CUDA_SUCCESS) return r;
  pthread_rwlock_wrlock(&g_mem_lock);
  struct vmm_alloc *a = known_alloc(handle);
  if (a != NULL) {
    --a->handles;
    settle_alloc(a);
  }
  pthread_rwlock_unlock(&g_mem_lock);
  return a != NULL ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

STANDIN_API CUresult CUDAAPI cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                                 unsigned long long flags) {
  CUresult r = enter();
  if (r != CUDA_SUCCESS) return r;
  (void)addr; /* a hint only */
  if (ptr == NULL || flags != 0 || size == 0 || size % kVmmGranularity != 0 ||
      (alignment & (alignment - 1)) != 0) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (alignment < kVmmGranularity) alignment = kVmmGranularity;
  if (size > SIZE_MAX - alignment) return CUDA_ERROR_OUT_OF_MEMORY;
  struct vmm_reserve *res = calloc(1, sizeof *res);
  if (res == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
  const int anon = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
  unsigned char *wide = mmap(NULL, size + alignment, PROT_NONE, anon, -1, 0);
  void *shadow = mmap(NULL, size, PROT_NONE, anon, -1, 0);
  if (wide == MAP_FAILED || shadow == MAP_FAILED) {
    if (wide != MAP_FAILED) munmap(wide, size + alignment);
    if (shadow != MAP_FAILED) munmap(shadow, size);
    free(res);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  uintptr_t base = ((uintptr_t)wide + alignment - 1) & ~(uintptr_t)(alignment - 1);
  if (base > (uintptr_t)wide) munmap(wide, base - (uintptr_t)wide);
  uintptr_t tail = (uintptr_t)wide + size + alignment - (base + size);
  if (tail > 0) munmap((void *)(base + size), tail);
  res->base = base;
  res->size = size;
  res->shadow = shadow;
  pthread_rwlock_wrlock(&g_mem_lock);
  res->next = g_vmm_reserves;
  g_vmm_reserves = res;
  pthread_rwlock_unlock(&g_mem_lock);
  *ptr = (CUdeviceptr)base;
  return CUDA_SUCCESS;
}

/* The reservation holding [p, p + n). Lock held. */
static struct vmm_reserve *reserve_holding(uintptr_t p, size_t n) {
  for (struct vmm_reserve *res = g_vmm_reserves; res != NULL; res = res->next) {
    if (p >= res->base && n <= res->size && p - res->base <= res->size - n) return res;
  }
  return NULL;
}

STANDIN_API CUresult CUDAAPI cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  CUresult r = enter();
  if (r != CUDA_SUCCESS) return r;
  pthread_rwlock_wrlock(&g_mem_lock);
  struct vmm_reserve **link = &g_vmm_reserves;
  while (*link != NULL && ((*link)->base != (uintptr_t)ptr || (*link)->size != size)) link = &(*link)->next;
  struct vmm_reserve *res = *link;
  if (res != NULL) {
    /* Its mappings go first (cuMemUnmap). */
    for (struct region *reg = g_regions; reg != NULL; reg = reg->next) {
      if (reg->kind == REGION_VMM && reg->base >= res->base && reg->base - res->base < res->size) {
        res = NULL;
        break;
      }
    }
    if (res != NULL) *link = res->next;
  }
  pthread_rwlock_unlock(&g_mem_lock);
  if (res == NULL) return CUDA_ERROR_INVALID_VALUE;
  munmap((void *)res->base, res->size);
  munmap(res->shadow, res->size);
  free(res);
  return CUDA_SUCCESS;
}

STANDIN_API CUresult CUDAAPI cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                                      unsigned long long flags) {
  CUresult r = enter();
  if (r != CUDA_SUCCESS) return r;
  /* The driver's offset must be 0 for now. */
  if (flags != 0 || offset != 0 || size == 0 || size % kVmmGranularity != 0 || ptr % kVmmGranularity != 0) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  struct region *reg = calloc(1, sizeof *reg);
  if (reg == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
  pthread_rwlock_wrlock(&g_mem_lock);
  struct vmm_alloc *a = known_alloc(handle);
  struct vmm_reserve *res = reserve_holding((uintptr_t)ptr, size);
  r = a == NULL ? CUDA_ERROR_INVALID_HANDLE : (res == NULL || size > a->size) ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
  for (struct region *other = g_regions; r == CUDA_SUCCESS && other != NULL; other = other->next) {
    if (other->kind == REGION_VMM && ranges_overlap((uintptr_t)ptr, size, other->base, other->size)) {
      r = CUDA_ERROR_INVALID_VALUE; /* already mapped */
    }
  }
  unsigned char *shadow = res != NULL ? res->shadow + ((uintptr_t)ptr - res->base) : NULL;
  if (r == CUDA_SUCCESS &&
      (mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, a->fd, 0) == MAP_FAILED ||
       mmap(shadow, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, a->fd, 0) == MAP_FAILED)) {
    const int anon = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED;
    mmap((void *)(uintptr_t)ptr, size, PROT_NONE, anon, -1, 0);
    mmap(shadow, size, PROT_NONE, anon, -1, 0);
    r = CUDA_ERROR_OUT_OF_MEMORY;
  }
  if (r == CUDA_SUCCESS) {
    reg->kind = REGION_VMM;
    reg->base = (uintptr_t)ptr;
    reg->size = size;
    reg->map_size = size;
    reg->shadow = shadow;
    reg->fd = -1;
    reg->ctx = &g_ctx[a->device];
    reg->buffer_id = atomic_fetch_add(&g_next_buffer_id, 1);
    reg->alloc = a;
    ++a->mappings;
    insert_region(reg);
  }
  pthread_rwlock_unlock(&g_mem_lock);
  if (r != CUDA_SUCCESS) free(reg);
  return r;
}

STANDIN_API CUresult CUDAAPI cuMemUnmap(CUdeviceptr ptr, size_t size) {
  CUresult r = enter();
  if (r != CUDA_SUCCESS) return r;
  if (size == 0) return CUDA_ERROR_INVALID_VALUE;
  pthread_rwlock_wrlock(&g_mem_lock);
  /* Whole mappings, side by side, from ptr to ptr + size. */
  size_t covered = 0;
  while (covered < size) {
    struct region *reg = region_with_base((uintptr_t)ptr + covered, REGION_VMM);
    if (reg == NULL || reg->size > size - covered) break;
    covered += reg->size;
  }
  if (covered != size) {
    pthread_rwlock_unlock(&g_mem_lock);
    return CUDA_ERROR_INVALID_VALUE;
  }
  for (covered = 0; covered < size;) {
    struct region *reg = region_with_base((uintptr_t)ptr + covered, REGION_VMM);
    covered += reg->size;
    unlink_region(reg);
    const int anon = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED;
    mmap((void *)reg->base, reg->size, PROT_NONE, anon, -1, 0);
    mmap(reg->shadow, reg->size, PROT_NONE, anon, -1, 0);
    --reg->alloc->mappings;
    settle_alloc(reg->alloc);
    free(reg);
  }
  pthread_rwlock_unlock(&g_mem_lock);
  return CUDA_SUCCESS;
}

STANDIN_API CUresult CUDAAPI cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count) {
  CUresult r = enter();
  if (r != CUDA_SUCCESS) return r;
  if (desc == NULL || count == 0 || size == 0) return CUDA_ERROR_INVALID_VALUE;
  bool access = false;
  for (size_t i = 0; i < count; ++i) {
    if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE || desc[i].location.id < 0 ||
        desc[i].location.id >= g_device_count) {
      return CUDA_ERROR_INVALID_DEVICE;
    }
    if (desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_NONE && desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READ &&
        desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE) {
      return CUDA_ERROR_INVALID_VALUE;
    }
    access = access || desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_NONE;
  }
  pthread_rwlock_wrlock(&g_mem_lock);
  /* Every byte of the range mapped. */
  size_t covered = 0;
  struct region *reg = device_region_at((uintptr_t)ptr);
  if (reg != NULL && reg->kind == REGION_VMM) covered = reg->size - ((uintptr_t)ptr - reg->base);
  struct region *at = reg;
  while (at != NULL && at->kind == REGION_VMM && covered < size) {
    at = region_with_base(at->base + at->size, REGION_VMM);
    if (at != NULL) covered += at->size;
  }
  if (reg == NULL || reg->kind != REGION_VMM || covered < size) {
    pthread_rwlock_unlock(&g_mem_lock);
    return CUDA_ERROR_INVALID_VALUE;
  }
  for (at = reg, covered = 0; covered < size + ((uintptr_t)ptr - reg->base);
       at = region_with_base(at->base + at->size, REGION_VMM)) {
    at->access = access;
    covered += at->size;
  }
  pthread_rwlock_unlock(&g_mem_lock);
  return CUDA_SUCCESS;
}

STANDIN_API CUresult CUDAAPI cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr) {
  CUresult r = enter();
  if (r != CUDA_SUCCESS) return r;
  if (handle == NULL) return CUDA_ERROR_INVALID_VALUE;
  pthread_rwlock_wrlock(&g_mem_lock);
  struct region *reg = device_region_at((uintptr_t)addr);
  struct vmm_alloc *a = reg != NULL && reg->kind == REGION_VMM ? reg->alloc : NULL;
  if (a != NULL) {
    ++a->handles;
    *handle = (CUmemGenericAllocationHandle)(uintptr_t)a;
  }
  pthread_rwlock_unlock(&g_mem_lock);
  return a != NULL ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

STANDIN_API CUresult CUDAAPI cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle handle,
                                                          CUmemAllocationHandleType handleType,
                                                          unsigned long long flags) {
  CUresult r = enter();
  if (r != CUDA_SUCCESS) return r;
  if (shareableHandle == NULL || flags != 0) return CUDA_ERROR_INVALID_VALUE;
  if (handleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return CUDA_ERROR_NOT_SUPPORTED;
  int fd = -1;
  pthread_rwlock_rdlock(&g_mem_lock);
  struct vmm_alloc *a = known_alloc(handle);
  /* Only as a type it was created with. */
  if (a == NULL) {
    r = CUDA_ERROR_INVALID_HANDLE;
  } else if ((a->handle_types & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) == 0) {
    r = CUDA_ERROR_INVALID_VALUE;
  } else {
    fd = fcntl(a->fd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) r = CUDA_ERROR_OUT_OF_MEMORY;
  }
  pthread_rwlock_unlock(&g_mem_lock);
  if (r == CUDA_SUCCESS) *(int *)shareableHandle = fd;
  return r;
}

/* The device of a memfd made by cuMemCreate here or in another process;
 * -1 for any other descriptor. */
static int vmm_memfd_device(int fd, size_t *size) {
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size <= 0 || st.st_size % kVmmGranularity != 0) return -1;
  char link[64];
  char target[256];
  snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  ssize_t n = readlink(link, target, sizeof target - 1);
  if (n < 0) return -1;
  target[n] = '\0';
  static const char prefix[] = "/memfd:" VMM_MEMFD_PREFIX "d";
  if (strncmp(target, prefix, sizeof prefix - 1) != 0) return -1;
  int device = -1;
  unsigned long long id = 0;
  char rest[16] = "";
  if (sscanf(target + sizeof prefix - 1, "%d-%16llx%15s", &device, &id, rest) < 2) return -1;
  if (rest[0] != '\0' && strcmp(rest, "(deleted)") != 0) return -1;
  if (device < 0 || device >= g_device_count) return -1;
  *size = (size_t)st.st_size;
  return device;
}

STANDIN_API CUresult CUDAAPI cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *osHandle,
                                                            CUmemAllocationHandleType shHandleType) {
  CUresult r = enter();
  if (r != CUDA_SUCCESS) return r;
  if (handle == NULL) return CUDA_ERROR_INVALID_VALUE;
  if (shHandleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return CUDA_ERROR_NOT_SUPPORTED;
  /* The descriptor travels in the pointer's bits. */
  const int given = (int)(intptr_t)osHandle;
  size_t size = 0;
  const int device = given >= 0 ? vmm_memfd_device(given, &size) : -1;
  if (device < 0) return CUDA_ERROR_INVALID_HANDLE;
  struct vmm_alloc *a = calloc(1, sizeof *a);
  int fd = a != NULL ? fcntl(given, F_DUPFD_CLOEXEC, 0) : -1;
  if (fd < 0) {
    free(a);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  a->fd = fd;
  a->size = size;
  a->device = device;
  a->handle_types = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  a->imported = true;
  a->handles = 1;
  pthread_rwlock_wrlock(&g_mem_lock);
  a->next = g_vmm_allocs;
  g_vmm_allocs = a;
  pthread_rwlock_unlock(&g_mem_lock);
  *handle = (CUmemGenericAllocationHandle)(uintptr_t)a;
  return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------ */
/* cuGetProcAddress                                                     */
/* ------------------------------------------------------------------ */

typedef void (*any_fn)(void);

struct proc_entry {
  const char *name; /* the name without a version suffix */
  const char *versioned;
  any_fn fn;
};

#define PROC(base, fn) {base, #fn, (any_fn)fn}

static const struct proc_entry k_procs[] = {
    PROC("cuInit", cuInit),
    PROC("cuDriverGetVersion", cuDriverGetVersion),
    PROC("cuDeviceGetCount", cuDeviceGetCount),
    PROC("cuDeviceGet", cuDeviceGet),
    PROC("cuDevicePrimaryCtxRetain", cuDevicePrimaryCtxRetain),
    PROC("cuDevicePrimaryCtxRelease", cuDevicePrimaryCtxRelease_v2),
    PROC("cuCtxSetCurrent", cuCtxSetCurrent),
    PROC("cuCtxGetCurrent", cuCtxGetCurrent),
    PROC("cuGetErrorString", cuGetErrorString),
    PROC("cuGetErrorName", cuGetErrorName),
    PROC("cuPointerGetAttributes", cuPointerGetAttributes),
    PROC("cuMemGetAddressRange", cuMemGetAddressRange_v2),
    PROC("cuMemAlloc", cuMemAlloc_v2),
    PROC("cuMemFree", cuMemFree_v2),
    PROC("cuMemAllocHost", cuMemAllocHost_v2),
    PROC("cuMemFreeHost", cuMemFreeHost),
    PROC("cuMemHostRegister", cuMemHostRegister_v2),
    PROC("cuMemHostUnregister", cuMemHostUnregister),
    PROC("cuMemsetD8", cuMemsetD8_v2),
    PROC("cuMemcpyHtoD", cuMemcpyHtoD_v2),
    PROC("cuMemcpyDtoH", cuMemcpyDtoH_v2),
    PROC("cuMemcpyDtoD", cuMemcpyDtoD_v2),
    PROC("cuMemcpyHtoDAsync", cuMemcpyHtoDAsync_v2),
    PROC("cuMemcpyDtoHAsync", cuMemcpyDtoHAsync_v2),
    PROC("cuMemcpyDtoDAsync", cuMemcpyDtoDAsync_v2),
    PROC("cuMemcpy2DAsync", cuMemcpy2DAsync_v2),
    PROC("cuStreamCreate", cuStreamCreate),
    PROC("cuStreamDestroy", cuStreamDestroy_v2),
    PROC("cuStreamSynchronize", cuStreamSynchronize),
    PROC("cuStreamQuery", cuStreamQuery),
    PROC("cuStreamWaitEvent", cuStreamWaitEvent),
    PROC("cuLaunchHostFunc", cuLaunchHostFunc),
    PROC("cuStreamAddCallback", cuStreamAddCallback),
    PROC("cuEventCreate", cuEventCreate),
    PROC("cuEventRecord", cuEventRecord),
    PROC("cuEventQuery", cuEventQuery),
    PROC("cuEventSynchronize", cuEventSynchronize),
    PROC("cuEventDestroy", cuEventDestroy_v2),
    PROC("cuIpcGetMemHandle", cuIpcGetMemHandle),
    PROC("cuIpcOpenMemHandle", cuIpcOpenMemHandle_v2),
    PROC("cuIpcCloseMemHandle", cuIpcCloseMemHandle),
    PROC("cuMemGetAllocationGranularity", cuMemGetAllocationGranularity),
    PROC("cuMemCreate", cuMemCreate),
    PROC("cuMemRelease", cuMemRelease),
    PROC("cuMemAddressReserve", cuMemAddressReserve),
    PROC("cuMemAddressFree", cuMemAddressFree),
    PROC("cuMemMap", cuMemMap),
    PROC("cuMemUnmap", cuMemUnmap),
    PROC("cuMemSetAccess", cuMemSetAccess),
    PROC("cuMemRetainAllocationHandle", cuMemRetainAllocationHandle),
    PROC("cuMemExportToShareableHandle", cuMemExportToShareableHandle),
    PROC("cuMemImportFromShareableHandle", cuMemImportFromShareableHandle),
    PROC("cuGetProcAddress", cuGetProcAddress_v2),
};

STANDIN_API CUresult CUDAAPI cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                                 CUdriverProcAddressQueryResult *symbolStatus) {
  const cuuint64_t known = CU_GET_PROC_ADDRESS_LEGACY_STREAM | CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;
  if (symbol == NULL || pfn == NULL || cudaVersion <= 0 || (flags & ~known) != 0) return CUDA_ERROR_INVALID_VALUE;
  for (size_t i = 0; i < sizeof k_procs / sizeof k_procs[0]; ++i) {
    if (strcmp(symbol, k_procs[i].name) == 0 || strcmp(symbol, k_procs[i].versioned) == 0) {
      *pfn = (void *)k_procs[i].fn;
      if (symbolStatus != NULL) *symbolStatus = CU_GET_PROC_ADDRESS_SUCCESS;
      return CUDA_SUCCESS;
    }
  }
  *pfn = NULL;
  if (symbolStatus != NULL) *symbolStatus = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  return CUDA_ERROR_NOT_FOUND;
}
