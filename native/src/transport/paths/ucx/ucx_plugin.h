/* The UCX data plane as a run-time plugin: libdatadist_ucx.so, built only
 * where UCX is found, implements this C ABI over UCP; the engine opens it with
 * dlopen (transport/paths/ucx/ucx_loader.h), so neither building nor installing the
 * engine needs UCX.
 *
 * One worker per engine, with its own UCP context (RMA and WAKEUP features).
 * The worker runs in UCS_THREAD_MODE_MULTI: the engine's I/O threads may all
 * call into it. No thread of the plugin's own progresses it: the engine polls
 * event_fd() beside its sockets, and `arm` then `progress` when it is ready.
 * Every callback (an operation's completion, an endpoint's error) runs from
 * within `progress`, on the thread that called it, outside UCX's locks, so a
 * callback may post new operations.
 *
 * Host-to-host ranges move as the plugin's own active messages where no
 * transport of the context reads or writes a peer's memory by itself (no
 * RDMA): UCX's emulated get and put answer the peer from inside progress and
 * abort the process when that answer's send fails (a peer that died). The
 * peer's end of such a range reads or writes only inside host memory it
 * mapped.
 *
 * Statuses: 0 is success, DATADIST_UCX_BUSY is `arm`'s "progress first", and
 * anything else is a negative ucs_status_t that status_string() describes. */
#ifndef DATADIST_TRANSPORT_PATHS_UCX_UCX_PLUGIN_H_
#define DATADIST_TRANSPORT_PATHS_UCX_UCX_PLUGIN_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define DATADIST_UCX_ABI_VERSION 3
#define DATADIST_UCX_OK 0
#define DATADIST_UCX_BUSY 1
/* The symbol the loader resolves: returns the plugin's table. */
#define DATADIST_UCX_ENTRY_SYMBOL "datadist_ucx_plugin_v1_get"

typedef struct datadist_ucx_worker datadist_ucx_worker;
typedef struct datadist_ucx_mem datadist_ucx_mem;
typedef struct datadist_ucx_ep datadist_ucx_ep;
typedef struct datadist_ucx_rkey datadist_ucx_rkey;

/* How an endpoint's gets and puts of host memory reach the peer's (ep_rma). */
#define DATADIST_UCX_RMA_NONE 0   /* not by themselves (tcp), or UCX cannot say */
#define DATADIST_UCX_RMA_FENCED 1 /* in the NIC (rc, dc, srd): the peer's unmap fences them */
#define DATADIST_UCX_RMA_DIRECT 2 /* this process's own system calls or mappings (cma, xpmem, knem,
                                     cuda_ipc): nothing of the peer's stops them */

/* Memory types of mem_map. */
#define DATADIST_UCX_HOST 0
#define DATADIST_UCX_CUDA 1

/* One range of a get or put: `local` in this process, inside `local_mem`
 * where it is not null (UCX then needs no lookup of its own), `remote` in
 * the peer's memory that the rkey covers. */
typedef struct datadist_ucx_range {
  uint64_t local;
  uint64_t remote;
  uint64_t length;
  datadist_ucx_mem *local_mem;
} datadist_ucx_range;

/* An operation's completion: status 0, or why it failed (the first failure
 * among its ranges). Called once. */
typedef void (*datadist_ucx_done_fn)(void *arg, int status);
/* An endpoint's peer failed (died, reset, timed out): its pending operations
 * fail, and the endpoint is to be closed with force. Called once. */
typedef void (*datadist_ucx_ep_error_fn)(void *arg, int status);

typedef struct datadist_ucx_plugin_v1 {
  uint32_t abi_version; /* DATADIST_UCX_ABI_VERSION */
  uint32_t struct_size; /* sizeof(datadist_ucx_plugin_v1) */

  /* "1.13.1": the UCX library in use. */
  const char *(*ucx_version)(void);
  /* A status as text: "Endpoint timeout (UCS_ERR_ENDPOINT_TIMEOUT)". */
  const char *(*status_string)(int status);

  /* A context and its worker. */
  int (*worker_create)(datadist_ucx_worker **out);
  /* Force-closes the endpoints and unmaps the memory left, then frees all;
   * pending operations complete with UCS_ERR_CANCELED first. */
  void (*worker_destroy)(datadist_ucx_worker *worker);
  /* The worker's address for a peer's ep_create; valid until destroy. */
  int (*worker_address)(datadist_ucx_worker *worker, const void **address, size_t *length);
  /* The file descriptor to poll for readability; owned by the worker. */
  int (*event_fd)(datadist_ucx_worker *worker, int *fd);
  /* Before sleeping on event_fd: 0 when armed, DATADIST_UCX_BUSY when there
   * is work to progress first. */
  int (*arm)(datadist_ucx_worker *worker);
  /* Progresses UCX and runs the callbacks due; returns how many events it
   * handled (0: nothing left to do now). */
  unsigned (*progress)(datadist_ucx_worker *worker);

  /* 1 when the worker's context has a one-sided network transport (RDMA:
   * rc, dc or srd over a verbs device), so the owner's gets and puts run in
   * its NIC; 0 when its network transports are tcp alone. */
  int (*one_sided_network)(datadist_ucx_worker *worker);
  /* 1 when the worker's UCX moves CUDA device memory (built with CUDA, and
   * its CUDA transports found a driver), else 0. */
  int (*reaches_cuda)(datadist_ucx_worker *worker);
  /* Maps [address, address + length) of memory of `memory_type`
   * (DATADIST_UCX_HOST or, where reaches_cuda, DATADIST_UCX_CUDA, with the
   * device's context current on the calling thread) for peers' access; the
   * packed rkey is for the peer (the memory's type, then UCX's key), valid
   * until unmap. */
  int (*mem_map)(datadist_ucx_worker *worker, void *address, size_t length, int memory_type,
                 datadist_ucx_mem **out, const void **rkey, size_t *rkey_length);
  int (*mem_unmap)(datadist_ucx_mem *mem);

  /* An endpoint to a peer's worker address; on_error(error_arg, status)
   * runs from progress when the peer fails. */
  int (*ep_create)(datadist_ucx_worker *worker, const void *address, size_t length,
                   datadist_ucx_ep_error_fn on_error, void *error_arg, datadist_ucx_ep **out);
  /* A peer's packed rkey, usable on that peer's endpoint. */
  int (*rkey_unpack)(datadist_ucx_ep *ep, const void *rkey, size_t length, datadist_ucx_rkey **out);
  void (*rkey_destroy)(datadist_ucx_rkey *rkey);

  /* Reads the peer's ranges into local memory (get) or writes local memory
   * into the peer's (put). 0: posted, and done runs once from progress;
   * otherwise nothing was posted and done never runs. A host range outside
   * the host memory the peer mapped fails (where ranges move as active
   * messages). */
  int (*get)(datadist_ucx_ep *ep, datadist_ucx_rkey *rkey, const datadist_ucx_range *ranges, size_t count,
             datadist_ucx_done_fn done, void *arg);
  int (*put)(datadist_ucx_ep *ep, datadist_ucx_rkey *rkey, const datadist_ucx_range *ranges, size_t count,
             datadist_ucx_done_fn done, void *arg);
  /* done runs once every operation posted on ep so far is complete at the
   * peer. */
  int (*ep_flush)(datadist_ucx_ep *ep, datadist_ucx_done_fn done, void *arg);
  /* Closes ep (force: at once, without flushing, where the endpoint has
   * RDMA; one whose host ranges move as active messages flushes instead,
   * see ucx_plugin.cpp). The handle is gone on return; the close finishes in
   * progress. Pending operations of a forced close fail with
   * UCS_ERR_CANCELED; a range moving as active messages fails on return, and
   * bytes that come for it later are dropped. Its rkeys are to be destroyed
   * first. */
  void (*ep_close)(datadist_ucx_ep *ep, int force);

  /* An endpoint for one-sided moves into and out of memory the peer
   * granted: no peer-failure handling (UCX's shared-memory transports offer
   * none, and need none to read or write the peer), so no on_error; a dead
   * peer fails its operations. Its gets and puts always go as UCX's own;
   * ep_close never forces it (a forced close needs the handling). */
  int (*ep_create_direct)(datadist_ucx_worker *worker, const void *address, size_t length, datadist_ucx_ep **out);
  /* How ep's gets and puts reach the peer: DATADIST_UCX_RMA_*, by the
   * transports UCX chose for it (asked of UCX from 1.14 on; NONE before).
   * FENCED where one is rc, dc or srd; DIRECT where one is cma, xpmem,
   * knem or cuda_ipc and none is tcp; else NONE. */
  int (*ep_rma)(datadist_ucx_ep *ep);
} datadist_ucx_plugin_v1;

typedef const datadist_ucx_plugin_v1 *(*datadist_ucx_entry_fn)(void);

#ifdef __cplusplus
}
#endif

#endif /* DATADIST_TRANSPORT_PATHS_UCX_UCX_PLUGIN_H_ */
