/* mplane: every MPLANE_* environment variable, parsed in one place.
 *
 * Each variable is one row of the table in config.c: name, kind, default, accepted form and a
 * one-line meaning. The README's configuration table is written from the same rows
 * (`mplane-config --markdown`). A value that does not parse makes mplane_config_load() fail with a
 * message naming the variable, the value and the accepted form. */
#ifndef MPLANE_CONFIG_H
#define MPLANE_CONFIG_H

#include <stddef.h>
#include <stdio.h>
#include "nccl/err.h"

enum mplane_transport_choice { MPLANE_TRANSPORT_AUTO = 0, MPLANE_TRANSPORT_IB, MPLANE_TRANSPORT_SOCKET };
enum mplane_gin_lane { MPLANE_GIN_LANE_STREAM = 0, MPLANE_GIN_LANE_KERNEL };
enum mplane_stats_format { MPLANE_STATS_JSON = 0, MPLANE_STATS_PROMETHEUS, MPLANE_STATS_BOTH };
enum mplane_relay_mode { MPLANE_RELAY_AUTO = 0, MPLANE_RELAY_NVLINK, MPLANE_RELAY_PCIE, MPLANE_RELAY_HOST,
                         MPLANE_RELAY_OFF };

/* The IB side channel's address family (NCCL_SOCKET_FAMILY's values). */
enum mplane_ib_socket_family { MPLANE_IB_FAMILY_ANY = 0, MPLANE_IB_FAMILY_INET, MPLANE_IB_FAMILY_INET6 };

#define MPLANE_CONFIG_STR 256

struct mplane_config {
  int transport;                             /* enum mplane_transport_choice */
  char socket_ifname[MPLANE_CONFIG_STR];     /* NCCL_SOCKET_IFNAME grammar; "" = automatic */
  int socket_streams;                        /* TCP data streams per connection; 0 by link speed */
  int socket_threads;                        /* I/O threads of the process's pool; 0 automatic */
  long socket_split_bytes;                   /* messages at least this big are split across streams */
  long socket_chunk_bytes;                   /* ... into chunks at least this big (so onto fewer streams) */
  long socket_inline_bytes;                  /* messages up to this big ride the control socket */
  long socket_eager_bytes;                   /* messages up to this big may go before the receiver's CTS */
  long socket_pad_bytes;                     /* control-socket messages shorter than this are padded */
  long socket_splice_bytes;                  /* data-stream chunks this big are spliced, not copied; 0 never */
  int socket_inline_busy;                    /* ... above 16K only with fewer sends in flight; 0 no limit */
  int socket_speed_mbps;                     /* reported where sysfs knows no speed; -1 automatic */
  int socket_spin_us;                        /* helper threads poll this long before sleeping */
  int nccl_defaults;                         /* setenv NCCL_* tuning defaults the user left unset */
  int connect_timeout_s;                     /* handshake deadline */
  char planes[1024];                         /* MPLANE_PLANES, parsed by topo/ */
  char topo_file[MPLANE_CONFIG_STR];         /* hwloc XML instead of live discovery */
  int nccl_topo;                             /* write NCCL_TOPO_FILE for NCCL */
  int relay;                                 /* enum mplane_relay_mode */
  char tc_map[MPLANE_CONFIG_STR];            /* traffic class -> service level map */
  char stats_file[MPLANE_CONFIG_STR];        /* counters file (JSON or Prometheus text) */
  int stats_format;                          /* enum mplane_stats_format */
  int stats_interval_s;                      /* rewrite the counters file this often; 0: at close only */
  char ib_hca[MPLANE_CONFIG_STR];            /* NCCL_IB_HCA grammar */
  int ib_gid_index;                          /* -1 = automatic (RoCE v2, IPv4-mapped first) */
  int ib_sl;                                 /* default service level */
  int ib_timeout;                            /* ibv local ack timeout exponent */
  int ib_retry_cnt;
  int ib_tc;                                 /* RoCE GRH traffic class of every QP; -1: from the class */
  int gin_ib_tc;                             /* the same for the one-sided (GIN) QPs; -1: as ib_tc */
  int gin_lane;                              /* enum mplane_gin_lane: how GPU memory ops are run */
  int gin_lane_idle_us;                      /* the lane kernel exits after this long idle */
  int gin_lane_kernel_max;                   /* copies up to this many bytes by the lane kernel */
  int gin_lane_stall_ms;                     /* ops wait no longer on a lane kernel that makes no progress */
  int ib_pkey;                               /* partition key index of every QP */
  int ib_ece;                                /* negotiate ECE on IB connections where supported */
  int ib_qps;                                /* QPs per connection */
  int ib_subnet_probe;                       /* default-prefix IB ports: find their subnets at init */
  int ib_relaxed_ordering;                   /* 0: never; 1, 2: data buffers where the verbs take it */
  int ib_roce_version;                       /* RoCE GID version: 0 automatic (v2 first), 1 or 2 */
  int ib_addr_family;                        /* enum mplane_ib_socket_family: RoCE GIDs' address family */
  char ib_addr_range[64];                    /* RoCE GIDs' address range (CIDR), "" any */
  int ib_gdr_flush_disable;                  /* 1: iflush never reads (the platform orders GPU writes) */
  int ib_adaptive_routing;                   /* two-sided data in the AR form: -1 per link (IB on, RoCE off), 0, 1 */
  long ib_ar_threshold;                      /* the AR form only for messages larger than this (bytes) */
  int ib_fifo_tc;                            /* RoCE traffic class of FIFO writes; -1 the connection's */
  char ib_socket_ifname[MPLANE_CONFIG_STR];  /* the IB side channel's interfaces; "" = automatic */
  int ib_device_pci_order;                   /* 1: IB devices in PCI order */
  int ib_split_data_on_qps;                  /* 1: large messages striped over the QPs; 0: whole, round-robin */
  int ib_socket_family;                      /* enum mplane_ib_socket_family: the side channel's addresses */
  char ibverbs_lib[MPLANE_CONFIG_STR];       /* libibverbs to dlopen */
  char tuner_config[MPLANE_CONFIG_STR];      /* tuner CSV table */
  int debug;                                 /* MPLANE_DEBUG; log.c reads it directly (before config) */
  /* libmplane-ep's (MPLANE_EP_*, mplane_config_load_ep): -1 automatic */
  int ep_link_sms;                           /* fused dispatch blocks that copy to the same-node peers */
  int ep_recv_sms;                           /* ... that unpack the peers' rows */
  int ep_send_sms;                           /* fused combine blocks that send the expert sums */
  char ep_lib[MPLANE_CONFIG_STR];            /* the Python binding's libmplane-ep.so */
  char ep_nccl_lib[MPLANE_CONFIG_STR];       /* the Python binding's NCCL */
  /* libmplane-hfreduce's (MPLANE_HFREDUCE_*, mplane_config_load_hfreduce) */
  long hfreduce_chunk_bytes;                 /* one pipelined chunk */
  int hfreduce_slots;                        /* chunks in flight */
};

/* Read the environment into cfg (defaults first; a variable set to "" counts as unset). On a bad
 * value returns ncclInvalidArgument and writes "MPLANE_X='value' is not valid: expected <form>" into
 * err (for a value taken from NCCL's own variable because MPLANE_X is unset, e.g. NCCL_IB_SL: "NCCL_Y='value'
 * is not valid for MPLANE_X: ..."); the MPLANE_IB_* variables NCCL has a twin of read it then.
 * err. */
ncclResult_t mplane_config_load(struct mplane_config *cfg, char *err, size_t errlen);
/* The same for libmplane-ep: every default, and the environment of its own rows (MPLANE_EP_*) only;
 * mplane_config_load leaves those at their defaults. */
ncclResult_t mplane_config_load_ep(struct mplane_config *cfg, char *err, size_t errlen);

/* The same for libmplane-hfreduce: every default, and its own rows (MPLANE_HFREDUCE_*) from the
 * environment; the transports it drives read the plugin's (mplane_config_get). */
ncclResult_t mplane_config_load_hfreduce(struct mplane_config *cfg, char *err, size_t errlen);

/* Where variable `name`'s value comes from: `name` itself, its NCCL twin (e.g. "NCCL_IB_SL" for
 * MPLANE_IB_SL, when that is unset), or NULL where neither is set (the default holds). */
const char *mplane_config_source(const char *name);

/* The process-wide configuration, loaded by the first call (thread-safe). NULL plus a WARN if the
 * environment is invalid; callers fail init then. */
const struct mplane_config *mplane_config_get(void);

/* Print every variable with its default, form and meaning: plain text or a Markdown table. */
void mplane_config_describe(FILE *out, int markdown);

/* Parse helpers shared with other grammars (tc map, planes, tuner table): a whole-string
 * decimal integer within [lo, hi], written exactly: digits only, no sign, no blanks, no leading
 * zero ("0" itself excepted); a '-' before the digits only for a negative value ("-1", never
 * "-0"). Returns 0 on success (and stores *out), -1 otherwise (*out untouched). */
int mplane_parse_long(const char *s, long lo, long hi, long *out);
/* A number as NCCL's parameters read it (strtoll, base 0: "022" is 18, "0x10" 16; text after the
 * number ignored, *trailing set then, and a string with no number is 0). 0, or -1 out of range. */
int mplane_nccl_parse_number(const char *s, long *v, int *trailing);
/* The NCCL_* twins of the config table: up to max (MPLANE_* name, NCCL name) pairs into names and
 * nccl (either may be NULL); returns how many there are. A twin is read when its MPLANE_* variable
 * is unset, with NCCL's grammar and meaning; a value mplane cannot use is ignored with a WARN. */
int mplane_config_nccl_twins(const char **names, const char **nccl, int max);
/* A byte count as the MPLANE_* size variables take it: digits as mplane_parse_long reads them (no
 * sign), an optional K, M or G (x1024), the result within [lo, hi]. 0 on success, -1 otherwise. */
int mplane_parse_size(const char *s, long lo, long hi, long *out);

/* MPLANE_PLANES, the one parser of its grammar (plugin init, topo/ and mplane-config --check all
 * use it): "NIC=plane" entries, comma separated, e.g. "mlx5_0=0,mlx5_1=1" or "eth0=0,eth1=1".
 * Blanks (space, tab) around a name, '=' or plane are allowed; NIC is a verbs device (optionally
 * with ":port"), an interface name or a plugin device name, made of letters, digits and _ - . :
 * and shorter than 64 characters; plane is an integer from 0 to MPLANE_PLANES_MAX_PLANE written as
 * mplane_parse_long reads it. No NIC may appear twice; NICs given one plane are its rails. Whether
 * the NICs exist is checked against a node elsewhere. */
#define MPLANE_PLANES_MAX 64
#define MPLANE_PLANES_MAX_PLANE 63
#define MPLANE_PLANES_NAME_MAX 64
struct mplane_planes_spec {
  int n;
  struct {
    char nic[MPLANE_PLANES_NAME_MAX];
    int plane;
  } entry[MPLANE_PLANES_MAX];
};
/* 0 on success, else -1 with the reason in why. NULL, "" and blanks parse as no entries. */
int mplane_planes_parse(const char *value, struct mplane_planes_spec *out, char *why, size_t whylen);

/* Open a file named by a variable (MPLANE_TOPO_FILE, MPLANE_TUNER_CONFIG) for reading, never
 * blocking. Returns the descriptor (O_CLOEXEC, blocking reads); -1 when it cannot be opened (errno
 * says why, err is untouched: the caller words it); -2 when it is no regular file (a FIFO would
 * block the reader forever; a device, directory or socket is no input either), with "VAR='path' is
 * not a regular file (a FIFO); expected <expected>" in err. */
int mplane_open_regular_file(const char *var, const char *path, const char *expected, char *err, size_t errlen);

/* An address range "ADDR/BITS" (IPv4 or IPv6). */
struct mplane_cidr {
  int v6;
  unsigned char addr[16]; /* IPv4: the first 4 bytes */
  int bits;
};
/* 0 and out, or -1 and why (the accepted form). */
int mplane_cidr_parse(const char *text, struct mplane_cidr *out, char *why, size_t whylen);

#endif
