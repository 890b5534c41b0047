// UCX's TCP transport calls through a freed endpoint when both ends of a
// connection close it with UCP_EP_CLOSE_FLAG_FORCE while one end's send was
// cut short (docs/design.md, "Limits": a frozen peer that resumes). No
// engine involved: two UCP workers in one process, progressed by hand.
//
//   1. W1 and W2 each make an endpoint to the other (peer-failure handling
//      on, as the engine's), over UCX_TLS=tcp, and exchange one message.
//   2. W1 sends ROUNDS messages of 256 KiB to W2, which does not progress
//      (a frozen peer): W1's socket fills, a send is left half done.
//   3. W1 closes its endpoint (MODE1: force or flush).
//   4. W2 progresses (the peer resumes and drains), then closes its own
//      endpoint (MODE2).
//   5. Both progress. With force and force, the socket is writable and
//      readable in one epoll event, and the transport's send handler runs
//      on the endpoint its receive handler just freed (SIGSEGV).
//
// Build and run (Debian's UCX; for another, add -I, -L and an rpath):
//   mkdir -p build && cc -O1 -g -o build/ucx_close_race tools/ucx_close_race.c -lucp -lucs
//   build/ucx_close_race 16 force force; echo $?   # 139 where UCX has the fault
//   build/ucx_close_race 16 flush force; echo $?   # 0
// It prints "survived" when it gets through.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

static ucp_worker_h workers[2];
static ucp_ep_h eps[2];
static int received[2];

static ucs_status_t on_message(void *arg, const void *header, size_t header_length, void *data, size_t length,
                               const ucp_am_recv_param_t *param) {
  (void)header, (void)header_length, (void)data, (void)length, (void)param;
  received[(long)arg] += 1;
  return UCS_OK;
}

static void on_error(void *arg, ucp_ep_h ep, ucs_status_t status) {
  (void)ep;
  fprintf(stderr, "W%ld: endpoint error: %s\n", (long)arg + 1, ucs_status_string(status));
}

static void on_sent(void *request, ucs_status_t status, void *user_data) {
  (void)status, (void)user_data;
  if (request != NULL) ucp_request_free(request);
}

static void on_closed(void *request, ucs_status_t status, void *user_data) {
  fprintf(stderr, "W%ld: close done: %s\n", (long)user_data + 1, ucs_status_string(status));
  if (request != NULL) ucp_request_free(request);
}

static void progress(int w, int times) {
  for (int i = 0; i < times; ++i) ucp_worker_progress(workers[w]);
}

static int start_worker(int w) {
  ucp_config_t *config;
  if (ucp_config_read(NULL, NULL, &config) != UCS_OK) return -1;
  ucp_params_t params = {0};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_AM;
  ucp_context_h context;
  ucs_status_t s = ucp_init(&params, config, &context);
  ucp_config_release(config);
  if (s != UCS_OK) return -1;
  ucp_worker_params_t worker_params = {0};
  worker_params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  worker_params.thread_mode = UCS_THREAD_MODE_SINGLE;
  if (ucp_worker_create(context, &worker_params, &workers[w]) != UCS_OK) return -1;
  ucp_am_handler_param_t handler = {0};
  handler.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                       UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
  handler.id = 1;
  handler.cb = on_message;
  handler.arg = (void *)(long)w;
  handler.flags = UCP_AM_FLAG_WHOLE_MSG;
  return ucp_worker_set_am_recv_handler(workers[w], &handler) == UCS_OK ? 0 : -1;
}

static void send_message(int w, const void *bytes, size_t length) {
  static char header[8];
  ucp_request_param_t param = {0};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_FLAGS;
  param.cb.send = on_sent;
  param.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
  ucs_status_ptr_t request = ucp_am_send_nbx(eps[w], 1, header, sizeof header, bytes, length, &param);
  (void)request;  // completed by on_sent, or at once
}

static void close_endpoint(int w, int force) {
  ucp_request_param_t param = {0};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  param.cb.send = on_closed;
  param.user_data = (void *)(long)w;
  param.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  ucs_status_ptr_t request = ucp_ep_close_nbx(eps[w], &param);
  fprintf(stderr, "W%d: close (%s) %s\n", w + 1, force ? "force" : "flush",
          UCS_PTR_IS_PTR(request) ? "pending" : ucs_status_string(UCS_PTR_STATUS(request)));
}

int main(int argc, char **argv) {
  if (argc != 4 || (strcmp(argv[2], "force") && strcmp(argv[2], "flush")) ||
      (strcmp(argv[3], "force") && strcmp(argv[3], "flush"))) {
    fprintf(stderr, "usage: %s ROUNDS force|flush force|flush\n", argv[0]);
    return 2;
  }
  const int rounds = atoi(argv[1]);
  setenv("UCX_TLS", "tcp", 0);
  setenv("UCX_NET_DEVICES", "lo", 0);
  for (int w = 0; w < 2; ++w) {
    if (start_worker(w) != 0) {
      fprintf(stderr, "UCX does not start over %s\n", getenv("UCX_TLS"));
      return 3;
    }
  }
  ucp_address_t *addresses[2];
  size_t lengths[2];
  for (int w = 0; w < 2; ++w) ucp_worker_get_address(workers[w], &addresses[w], &lengths[w]);
  for (int w = 0; w < 2; ++w) {
    ucp_ep_params_t params = {0};
    params.field_mask =
        UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
    params.address = addresses[1 - w];
    params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    params.err_handler.cb = on_error;
    params.err_handler.arg = (void *)(long)w;
    if (ucp_ep_create(workers[w], &params, &eps[w]) != UCS_OK) return 3;
  }
  const size_t chunk = 256 * 1024;
  char *bytes = calloc(1, chunk);
  for (int w = 0; w < 2; ++w) send_message(w, bytes, 8);
  for (int i = 0; i < 20000 && (received[0] == 0 || received[1] == 0); ++i) {
    progress(0, 1);
    progress(1, 1);
    usleep(100);
  }
  if (received[0] == 0 || received[1] == 0) return 3;
  for (int i = 0; i < rounds; ++i) {  // W2 is frozen
    send_message(0, bytes, chunk);
    progress(0, 20);
  }
  progress(0, 200);
  close_endpoint(0, strcmp(argv[2], "force") == 0);
  progress(0, 200);
  progress(1, 2000);  // W2 resumes
  fprintf(stderr, "W2: received %d messages\n", received[1]);
  close_endpoint(1, strcmp(argv[3], "force") == 0);
  for (int i = 0; i < 2000; ++i) {
    progress(1, 1);
    progress(0, 1);
  }
  fprintf(stderr, "survived\n");
  return 0;
}
