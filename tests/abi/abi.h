/* mplane ABI harness: shared declarations (see abi_harness.c for the command line). */
#ifndef MPLANE_TESTS_ABI_H
#define MPLANE_TESTS_ABI_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "common/nccl/net.h"

/* ------------------------------------------------------------------ the plugin, any table version */

/* Properties of one device, the union of every version's fields (absent ones stay at their
 * "unknown" value: -1 for ids, 0 otherwise). */
struct abi_props {
  const char *name;
  const char *pci_path;
  uint64_t guid;
  int ptr_support, reg_is_global, force_flush, speed, port;
  float latency;
  int max_comms, max_recvs;
  int net_device_type, net_device_version;
  int vndevs, vdev0;
  size_t max_p2p_bytes, max_coll_bytes;
  int max_multi_request_size;
  int rail_id, plane_id;
};

struct abi_net {
  int version; /* 8, 9, 10, 11, 12 */
  void *lib;
  const void *table;
  const char *name;
};

/* dlopen path (once per process) and dlsym ncclNetPlugin_v<version>. Exits on failure. */
void abi_net_open(struct abi_net *net, const char *path, int version);
/* dlclose the plugin, as NCCL does when its last communicator is gone; abi_net_open opens it anew. */
void abi_net_close(struct abi_net *net);
/* What init hands the plugin as NCCL's profiler callback (v10+): NULL unless a scenario sets it. */
extern ncclProfilerCallback_t abi_prof_callback;
/* When set, the pHandle that isend (is_send 1) and irecv (0, per buffer) pass with the buffer `data` of
 * `size` bytes (v10+); unset, NULL, as NCCL passes when its profiler follows nothing. */
extern void *(*abi_phandle_of)(const void *data, size_t size, int is_send);
/* v11/v12: per-communicator init (ctx out); v8-v10: process init (ctx = NULL). */
ncclResult_t abi_init(struct abi_net *net, uint64_t comm_id, int traffic_class, void **ctx);
ncclResult_t abi_finalize(struct abi_net *net, void *ctx);
ncclResult_t abi_devices(struct abi_net *net, int *ndev);
ncclResult_t abi_get_props(struct abi_net *net, int dev, struct abi_props *p);
ncclResult_t abi_listen(struct abi_net *net, void *ctx, int dev, void *handle, void **lc);
ncclResult_t abi_connect(struct abi_net *net, void *ctx, int dev, void *handle, void **sc);
ncclResult_t abi_accept(struct abi_net *net, void *lc, void **rc);
ncclResult_t abi_reg_mr(struct abi_net *net, void *comm, void *data, size_t size, int type, void **mh);
ncclResult_t abi_dereg_mr(struct abi_net *net, void *comm, void *mh);
ncclResult_t abi_isend(struct abi_net *net, void *sc, void *data, size_t size, int tag, void *mh, void **req);
ncclResult_t abi_irecv(struct abi_net *net, void *rc, int n, void **data, size_t *sizes, int *tags, void **mh,
                       void **req);
ncclResult_t abi_iflush(struct abi_net *net, void *rc, int n, void **data, int *sizes, void **mh, void **req);
ncclResult_t abi_test(struct abi_net *net, void *req, int *done, int *sizes);
ncclResult_t abi_close_send(struct abi_net *net, void *sc);
ncclResult_t abi_close_recv(struct abi_net *net, void *rc);
ncclResult_t abi_close_listen(struct abi_net *net, void *lc);

/* ------------------------------------------------------------------ captured log */

/* The logger handed to init: keeps every line (for checks) and echoes WARNs to stderr (and
 * everything with MPLANE_ABI_VERBOSE=1). */
void abi_logger(ncclDebugLogLevel level, unsigned long flags, const char *file, int line, const char *fmt, ...);
size_t abi_log_mark(void);
/* 1 if a WARN logged after mark contains every one of the NULL-terminated strings. */
int abi_log_warn_has(size_t mark, const char *s1, ...);
/* 1 if anything logged after mark (any level) contains s. */
int abi_log_has(size_t mark, const char *s);
void abi_log_dump(size_t mark, const char *why);

/* ------------------------------------------------------------------ small helpers */

double abi_now(void);
void abi_fail(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
void abi_note(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
extern const char *abi_scenario;
extern int abi_rank;

#endif
