/* mplane: MPLANE_* environment parsing (see config.h). */
#include "config.h"

#include <arpa/inet.h>
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

#include "log.h"
#include "tc_map.h"

enum kind { K_INT, K_SIZE, K_BOOL, K_ENUM, K_STR };

struct row {
  const char *name;
  enum kind kind;
  size_t offset;
  size_t str_len;      /* K_STR: capacity of the field */
  const char *dflt;    /* textual default, parsed like a user value */
  long lo, hi;         /* K_INT / K_SIZE bounds */
  const char *choices; /* K_ENUM: '|'-separated, index = stored value */
  const char *form;    /* accepted form, for errors and docs */
  const char *meaning; /* one line for docs */
  /* Optional deeper check of a K_STR grammar (tc map, planes): 0 if valid, else writes why. */
  int (*validate)(const char *value, char *why, size_t whylen);
  /* Optional rewrite of a stored K_STR value into the form its users read. */
  void (*normalize)(char *field);
};

int mplane_cidr_parse(const char *text, struct mplane_cidr *out, char *why, size_t whylen) {
  char addr[64];
  const char *slash = strchr(text, '/');
  size_t alen = slash ? (size_t)(slash - text) : 0;
  memset(out, 0, sizeof(*out));
  if (!slash || alen == 0 || alen >= sizeof(addr)) goto bad;
  memcpy(addr, text, alen);
  addr[alen] = 0;
  out->v6 = strchr(addr, ':') != NULL;
  if (inet_pton(out->v6 ? AF_INET6 : AF_INET, addr, out->addr) != 1) goto bad;
  long bits;
  if (mplane_parse_long(slash + 1, 0, out->v6 ? 128 : 32, &bits) != 0) goto bad;
  out->bits = (int)bits;
  return 0;
bad:
  snprintf(why, whylen, "'%s' is not an address range; expected ADDR/BITS, e.g. 198.18.0.0/15 or fd00::/8", text);
  return -1;
}

static int cidr_validate(const char *value, char *why, size_t whylen) {
  struct mplane_cidr c;
  return value[0] ? mplane_cidr_parse(value, &c, why, whylen) : 0;
}

static int planes_validate(const char *value, char *why, size_t whylen) {
  struct mplane_planes_spec spec;
  return mplane_planes_parse(value, &spec, why, whylen);
}

/* MPLANE_SOCKET_IFNAME: NCCL reads "eth0:1" as interface prefix "eth0", port 1, and matches
 * socket interfaces by the name alone; so does mplane: everything from a ':' to the end of its
 * comma-separated entry is dropped. */
static void ifname_drop_ports(char *field) {
  char *w = field;
  for (const char *r = field; *r;) {
    if (*r == ':') {
      while (*r && *r != ',') r++;
      continue;
    }
    *w++ = *r++;
  }
  *w = '\0';
}

/* MPLANE_SOCKET_SPEED: the range check allows -1..10000000; 0 is in it but is no speed. */
static int speed_validate(const char *value, char *why, size_t whylen) {
  long v;
  if (mplane_parse_long(value, -1, 10000000, &v) == 0 && v == 0) {
    snprintf(why, whylen, "0 Mb/s is no speed (-1 asks for the automatic one)");
    return -1;
  }
  return 0;
}

/* MPLANE_EP_RECV_SMS, MPLANE_EP_SEND_SMS: -1 asks for the automatic count; 0 blocks would do none of the work. */
static int ep_blocks_validate(const char *value, char *why, size_t whylen) {
  if (strcmp(value, "0") == 0) {
    snprintf(why, whylen, "0 blocks would do none of the work (-1 asks for the automatic count)");
    return -1;
  }
  return 0;
}

#define OFF(f) offsetof(struct mplane_config, f)
#define STR(f) OFF(f), sizeof(((struct mplane_config *)0)->f)

static const struct row rows[] = {
    {"MPLANE_TRANSPORT", K_ENUM, OFF(transport), 0, "auto", 0, 0, "auto|ib|socket", "auto, ib or socket",
     "transport: auto picks InfiniBand/RoCE where an active port exists, else TCP sockets"},
    {"MPLANE_SOCKET_IFNAME", K_STR, STR(socket_ifname), "", 0, 0, NULL,
     "NCCL_SOCKET_IFNAME grammar: prefixes, ^ to exclude, = for exact names, comma separated; a :port "
     "suffix is ignored, as NCCL ignores it",
     "interfaces the socket transport uses (default: every up, non-loopback interface)", NULL,
     ifname_drop_ports},
    {"MPLANE_SOCKET_STREAMS", K_INT, OFF(socket_streams), 0, "0", 0, 16, NULL,
     "0 (automatic) or an integer from 1 to 16",
     "TCP data streams per connection at most, opened as its messages need them (automatic: 8 on links "
     "of 100 Gb/s or more, loopback included, when the process may run on 16 CPUs or more; else 4)"},
    {"MPLANE_SOCKET_THREADS", K_INT, OFF(socket_threads), 0, "0", 0, 64, NULL,
     "0 (automatic) or an integer from 1 to 64",
     "I/O threads of the process's one pool, which moves the data streams of every connection, both "
     "directions (automatic: the usable CPUs, at most two per stream); the count does not grow with "
     "the peers"},
    {"MPLANE_SOCKET_SPLIT_BYTES", K_SIZE, OFF(socket_split_bytes), 0, "256K", 1, 1L << 30, NULL,
     "a size in bytes, K/M/G suffixes allowed, from 1 to 1G",
     "messages at least this big are split across the streams; smaller ones ride one stream"},
    {"MPLANE_SOCKET_CHUNK_BYTES", K_SIZE, OFF(socket_chunk_bytes), 0, "512K", 4096, 1L << 30, NULL,
     "a size in bytes, K/M/G suffixes allowed, from 4K to 1G",
     "a split message's chunks are at least this big: it takes as many streams as that allows (each "
     "chunk costs a hand-off and a wake-up at both ends; NCCL keeps the other streams busy with its "
     "other steps)"},
    {"MPLANE_SOCKET_INLINE_BYTES", K_SIZE, OFF(socket_inline_bytes), 0, "128K", 0, 1L << 20, NULL,
     "a size in bytes, K/M/G suffixes allowed, from 0 (never) to 1M",
     "messages up to this big are written and read by NCCL's proxy thread on the control socket, "
     "without the I/O threads (lower latency); bigger ones ride the data streams"},
    {"MPLANE_SOCKET_EAGER_BYTES", K_SIZE, OFF(socket_eager_bytes), 0, "64K", 0, 1L << 20, NULL,
     "a size in bytes, K/M/G suffixes allowed, from 0 (never) to 1M",
     "inline messages up to this big may be sent before the receiver posts its receive; it holds at "
     "most 32 of them, 512 KiB together, per connection"},
    {"MPLANE_SOCKET_PAD_BYTES", K_SIZE, OFF(socket_pad_bytes), 0, "544", 0, 4096, NULL,
     "a size in bytes, K suffix allowed, from 0 (never) to 4096",
     "control-socket messages shorter than this are padded to it, so the receiving kernel takes them as "
     "full segments and does not send an ACK of its own from the receiver's read (~1 us per message)"},
    {"MPLANE_SOCKET_SPLICE_BYTES", K_SIZE, OFF(socket_splice_bytes), 0, "256K", 0, 1L << 30, NULL,
     "a size in bytes, K/M/G suffixes allowed, from 0 (never) to 1G",
     "data-stream chunks at least this big leave without the sender's copy: their pages go to the "
     "kernel (vmsplice, splice) and the send completes when the receiver says it has read them"},
    {"MPLANE_SOCKET_INLINE_BUSY", K_INT, OFF(socket_inline_busy), 0, "2", 0, 1024, NULL,
     "an integer from 0 to 1024; 0: no limit",
     "messages above 16K ride the control socket only while fewer sends than this are in flight in the "
     "process; with more, the I/O threads copy them in parallel"},
    {"MPLANE_SOCKET_SPEED", K_INT, OFF(socket_speed_mbps), 0, "-1", -1, 10000000, NULL,
     "-1 (automatic) or Mb/s from 1 to 10000000",
     "speed reported where the driver reports none, and for loopback and veth; NCCL sizes its channels by it, "
     "the socket transport its defaults (automatic: loopback and veth, whose bytes the host's cores copy, 25000 "
     "per usable CPU, at most 400000; other interfaces 10000, NCCL's own guess)",
     speed_validate},
    {"MPLANE_SOCKET_SPIN_US", K_INT, OFF(socket_spin_us), 0, "0", 0, 10000, NULL,
     "microseconds, an integer from 0 to 10000",
     "how long an I/O thread of the pool polls for more work before it sleeps in epoll (0: sleep at "
     "once; docs/results/2026-12-01-lone-message-stream.md)"},
    {"MPLANE_NCCL_DEFAULTS", K_BOOL, OFF(nccl_defaults), 0, "1", 0, 1, NULL, "0 or 1",
     "set NCCL tuning variables the user left unset to values suited to the transport (logged at INFO)"},
    {"MPLANE_CONNECT_TIMEOUT", K_INT, OFF(connect_timeout_s), 0, "120", 1, 3600, NULL,
     "seconds, an integer from 1 to 3600", "deadline for a connection handshake before it fails"},
    {"MPLANE_PLANES", K_STR, STR(planes), "", 0, 0, NULL, "NIC=plane pairs, e.g. mlx5_0=0,mlx5_1=1",
     "plane of each NIC; NICs on one plane are its rails (default: from the fabric, then PCI order)", planes_validate},
    {"MPLANE_TOPO_FILE", K_STR, STR(topo_file), "", 0, 0, NULL, "a path to an hwloc XML file",
     "discover the node from this hwloc XML instead of the live machine"},
    {"MPLANE_NCCL_TOPO", K_BOOL, OFF(nccl_topo), 0, "1", 0, 1, NULL, "0 or 1",
     "write the node's NCCL topology (with NIC planes) and point NCCL_TOPO_FILE at it"},
    {"MPLANE_RELAY", K_ENUM, OFF(relay), 0, "auto", 0, 0, "auto|nvlink|pcie|host|off",
     "auto, nvlink, pcie, host or off", "how cross-plane connections are relayed (off: they fail)"},
    {"MPLANE_TC_MAP", K_STR, STR(tc_map), "default=0,collective=0,alltoall=3,lowlat=5,storage=1", 0, 0, NULL,
     "class=SL pairs, classes default|collective|alltoall|lowlat|storage|hfreduce, SL 0..15",
     "traffic class to service level (IB SL, RoCE/IP traffic class)", mplane_tc_validate},
    {"MPLANE_STATS_FILE", K_STR, STR(stats_file), "", 0, 0, NULL, "a path; %p expands to the process id",
     "write per-plane and per-class counters to this file at close (and every MPLANE_STATS_INTERVAL)"},
    {"MPLANE_STATS_FORMAT", K_ENUM, OFF(stats_format), 0, "json", 0, 0, "json|prometheus|both",
     "json, prometheus or both", "MPLANE_STATS_FILE's format (both: JSON there, Prometheus text at its path + .prom)"},
    {"MPLANE_STATS_INTERVAL", K_INT, OFF(stats_interval_s), 0, "15", 0, 86400, NULL,
     "seconds, an integer from 0 to 86400", "rewrite MPLANE_STATS_FILE this often while comms are open (0: at close only)"},
    {"MPLANE_IB_HCA", K_STR, STR(ib_hca), "", 0, 0, NULL, "NCCL_IB_HCA grammar, e.g. mlx5_0:1,mlx5_1",
     "HCAs and ports the IB transport uses (default: every active port)"},
    {"MPLANE_IB_GID_INDEX", K_INT, OFF(ib_gid_index), 0, "-1", -1, 255, NULL, "-1 (automatic) or 0..255",
     "RoCE GID index (automatic: RoCE v2, IPv4-mapped first)"},
    {"MPLANE_IB_SL", K_INT, OFF(ib_sl), 0, "0", 0, 15, NULL, "an integer from 0 to 15",
     "service level for traffic with no class"},
    {"MPLANE_IB_TIMEOUT", K_INT, OFF(ib_timeout), 0, "20", 1, 31, NULL, "an integer from 1 to 31",
     "IB local ACK timeout exponent (4.096us * 2^n)"},
    {"MPLANE_IB_RETRY_CNT", K_INT, OFF(ib_retry_cnt), 0, "7", 0, 7, NULL, "an integer from 0 to 7",
     "IB transport retry count"},
    {"MPLANE_IB_TC", K_INT, OFF(ib_tc), 0, "-1", -1, 255, NULL, "-1 (from the class) or 0..255",
     "RoCE GRH traffic class of every connection (default: the DSCP of its class's SL, << 2)"},
    {"MPLANE_IB_FIFO_TC", K_INT, OFF(ib_fifo_tc), 0, "-1", -1, 255, NULL, "-1 (as the connection's) or 0..255",
     "RoCE GRH traffic class of the receiver's FIFO writes (clear-to-send records), e.g. a higher-priority "
     "queue than the data's (default: the connection's traffic class)"},
    {"MPLANE_GIN_IB_TC", K_INT, OFF(gin_ib_tc), 0, "-1", -1, 255, NULL, "-1 (as MPLANE_IB_TC) or 0..255",
     "RoCE GRH traffic class of the one-sided (GIN) QPs (default: MPLANE_IB_TC's rule)"},
    {"MPLANE_GIN_LANE", K_ENUM, OFF(gin_lane), 0, "stream", 0, 0, "stream|kernel", "stream or kernel",
     "how the socket transport's one-sided ops reach GPU memory: stream (a CUDA stream op each) or kernel (a "
     "resident kernel of one block reads them from pinned memory; docs/gin.md)"},
    {"MPLANE_GIN_LANE_IDLE_US", K_INT, OFF(gin_lane_idle_us), 0, "5000", 10, 1000000, NULL,
     "microseconds, an integer from 10 to 1000000", "the lane kernel exits after this long with nothing to do"},
    {"MPLANE_GIN_LANE_KERNEL_MAX", K_INT, OFF(gin_lane_kernel_max), 0, "262144", 0, 67108864, NULL,
     "bytes, an integer from 0 to 67108864", "with MPLANE_GIN_LANE=kernel, larger copies go to the copy engine"},
    {"MPLANE_GIN_LANE_STALL_MS", K_INT, OFF(gin_lane_stall_ms), 0, "200", 1, 5000, NULL,
     "milliseconds, an integer from 1 to 5000",
     "with MPLANE_GIN_LANE=kernel, ops waiting this long on a lane kernel that does not start or move go to "
     "stream ops, and the lane stays on them (docs/gin.md)"},
    {"MPLANE_IB_PKEY", K_INT, OFF(ib_pkey), 0, "0", 0, 65535, NULL, "an integer from 0 to 65535",
     "partition key index of every QP"},
    {"MPLANE_IB_ECE", K_BOOL, OFF(ib_ece), 0, "1", 0, 1, NULL, "0 or 1",
     "negotiate ECE (enhanced connection establishment) where the HCA has it"},
    {"MPLANE_IB_SUBNET_PROBE", K_BOOL, OFF(ib_subnet_probe), 0, "1", 0, 1, NULL, "0 or 1",
     "find which ports share a subnet where nothing names it (IB ports with the default GID prefix, RoCE ports: "
     "LIDs, SM LIDs, one RDMA write between the node's own ports) and make those one plane; 0: a plane per port"},
    {"MPLANE_IB_ROCE_VERSION_NUM", K_INT, OFF(ib_roce_version), 0, "0", 0, 2, NULL,
     "0 (automatic: v2, then v1), 1 or 2", "RoCE version of the GID a RoCE port uses (MPLANE_IB_GID_INDEX wins)"},
    {"MPLANE_IB_ADDR_FAMILY", K_ENUM, OFF(ib_addr_family), 0, "any", 0, 0, "any|AF_INET|AF_INET6",
     "any, AF_INET or AF_INET6",
     "address family of the GID a RoCE port uses (any: IPv4-mapped first; MPLANE_IB_GID_INDEX wins)"},
    {"MPLANE_IB_ADDR_RANGE", K_STR, STR(ib_addr_range), "", 0, 0, NULL, "ADDR/BITS, e.g. 198.18.0.0/15 or fd00::/8",
     "address range the GID a RoCE port uses must lie in, e.g. one VLAN's subnet (default: any)", cidr_validate},
    {"MPLANE_IB_PCI_RELAXED_ORDERING", K_INT, OFF(ib_relaxed_ordering), 0, "2", 0, 2, NULL,
     "0 (off), 1 or 2 (on where the verbs take it)",
     "register NCCL's data buffers and one-sided data windows with PCIe relaxed ordering (never the FIFO, "
     "length records or signal windows); 0 turns it off, e.g. where a platform's relaxed ordering is broken"},
    {"MPLANE_IB_GDR_FLUSH_DISABLE", K_BOOL, OFF(ib_gdr_flush_disable), 0, "0", 0, 1, NULL, "0 or 1",
     "1: iflush after a receive or a one-sided get into GPU memory posts no RDMA read and completes at once, "
     "and a staged get reads no slot back (only where the platform makes the NIC's writes visible to the GPU "
     "by itself)"},
    {"MPLANE_IB_ADAPTIVE_ROUTING", K_INT, OFF(ib_adaptive_routing), 0, "-1", -1, 1, NULL,
     "-1 (per link: on for IB, off for RoCE), 0 or 1",
     "send two-sided data in the adaptive-routing form (a write, then a write with immediate) above "
     "MPLANE_IB_AR_THRESHOLD; one-sided ops always keep static routes"},
    {"MPLANE_IB_AR_THRESHOLD", K_SIZE, OFF(ib_ar_threshold), 0, "8K", 0, 1L << 30, NULL,
     "bytes, an integer from 0 to 1G (K, M, G suffixes)",
     "messages up to this size go as one write with immediate even where adaptive routing is on"},
    {"MPLANE_IB_SPLIT_DATA_ON_QPS", K_BOOL, OFF(ib_split_data_on_qps), 0, "1", 0, 1, NULL, "0 or 1",
     "1: a message above 64 KiB is striped over the connection's QPs; 0: each message goes whole on one QP, "
     "round-robin (with MPLANE_IB_QPS > 1)"},
    {"MPLANE_IB_SOCKET_FAMILY", K_ENUM, OFF(ib_socket_family), 0, "any", 0, 0, "any|AF_INET|AF_INET6",
     "any, AF_INET or AF_INET6",
     "address family of the IB transport's TCP side channel (any: IPv4 where an interface has both, else IPv6; "
     "link-local IPv6 never)"},
    {"MPLANE_IB_SOCKET_IFNAME", K_STR, STR(ib_socket_ifname), "", 0, 0, NULL,
     "NCCL_SOCKET_IFNAME grammar: prefixes, ^ to exclude, = for exact names, comma separated",
     "interfaces the IB transport's TCP side channel may use, as NCCL's out-of-band (default: "
     "MPLANE_SOCKET_IFNAME's, else the port's own interface, else IPoIB (ib*) first, docker* and lo never)",
     NULL, ifname_drop_ports},
    {"MPLANE_IB_DEVICE_PCI_ORDER", K_BOOL, OFF(ib_device_pci_order), 0, "1", 0, 1, NULL, "0 or 1",
     "1: the IB transport's devices in PCI order (as NCCL's net_ib), so every node numbers them alike; 0: in the "
     "order the verbs list them"},
    {"MPLANE_IB_QPS", K_INT, OFF(ib_qps), 0, "1", 1, 16, NULL, "an integer from 1 to 16",
     "queue pairs per connection (as NCCL's default, plus the flush QP); large messages are striped across them"},
    {"MPLANE_IBVERBS_LIB", K_STR, STR(ibverbs_lib), "libibverbs.so.1", 0, 0, NULL, "a library name or path",
     "the libibverbs to dlopen (tests point it at the software verbs double)"},
    {"MPLANE_DEBUG", K_INT, OFF(debug), 0, "0", 0, 2, NULL, "0, 1 (INFO) or 2 (INFO and TRACE)",
     "mplane's own messages on stderr when NCCL's logger is not in use (tools, tests); 2 also prints every "
     "TRACE line (each one-sided op) on stderr under NCCL, time-stamped"},
    {"MPLANE_TUNER_CONFIG", K_STR, STR(tuner_config), "", 0, 0, NULL, "a path to a CSV tuner table",
     "tuner table; without one the tuner changes nothing"},
    /* libmplane-ep's (collectives/ep/): it reads these through mplane_config_load_ep; the plugin leaves them at
     * their defaults. The fused kernels' counts are bounded again at create, by the device's blocks. */
    {"MPLANE_EP_LINK_SMS", K_INT, OFF(ep_link_sms), 0, "-1", -1, 1024, NULL,
     "-1 (automatic) or an integer from 0 to 1024, at most the fused dispatch's blocks less 2",
     "libmplane-ep: blocks of the fused dispatch that copy the staged rows to the same-node peers (automatic: "
     "with token rows 32, or (blocks - 2) / 4 + 1 below 66 blocks; with expert rows 0, the pack blocks write to "
     "the peers themselves; docs/moe-alltoall.md)"},
    {"MPLANE_EP_RECV_SMS", K_INT, OFF(ep_recv_sms), 0, "-1", -1, 1024, NULL,
     "-1 (automatic) or an integer from 1 to 1024, at most the blocks the link blocks leave less 1",
     "libmplane-ep: blocks of the fused dispatch that unpack the peers' rows (automatic: with token rows a third "
     "of what the link blocks leave, at most 32; with expert rows half of it); the rest pack",
     ep_blocks_validate},
    {"MPLANE_EP_SEND_SMS", K_INT, OFF(ep_send_sms), 0, "-1", -1, 1024, NULL,
     "-1 (automatic) or an integer from 1 to 1024, at most the fused combine's blocks less 1",
     "libmplane-ep: blocks of the fused combine that send the expert sums to the peers (automatic: a third)",
     ep_blocks_validate},
    {"MPLANE_EP_LIB", K_STR, STR(ep_lib), "", 0, 0, NULL, "a path to libmplane-ep.so",
     "the libmplane-ep the Python binding (mplane_ep) loads (default: in $MPLANE_LIB_DIR, the repository's build folders, then the "
     "loader's search path)"},
    {"MPLANE_EP_NCCL_LIB", K_STR, STR(ep_nccl_lib), "", 0, 0, NULL, "a library name or path",
     "the NCCL the Python binding opens where torch has loaded none (default: libnccl.so.2)"},
    /* libmplane-hfreduce's (collectives/hfreduce/): it reads these through mplane_config_load_hfreduce; the
     * plugin leaves them at their defaults. */
    {"MPLANE_HFREDUCE_CHUNK_BYTES", K_SIZE, OFF(hfreduce_chunk_bytes), 0, "2M", 65536, 1L << 30, NULL,
     "a size in bytes, K/M/G suffixes allowed, from 64K to 1G, the same on every rank",
     "libmplane-hfreduce: bytes of one pipelined chunk (the node's ranks each reduce a slice of it and send "
     "its halves on the two trees; docs/hfreduce.md)"},
    {"MPLANE_HFREDUCE_SLOTS", K_INT, OFF(hfreduce_slots), 0, "4", 2, 16, NULL,
     "an integer from 2 to 16, the same on every rank",
     "libmplane-hfreduce: chunks in flight (each takes ranks-per-node + 1 chunks of shared memory)"},
};

/* ------------------------------------------------------------------ NCCL's twins
 * NCCL's own variable of the same meaning: read when the MPLANE_* one is unset, so a site's
 * NCCL_* settings (a RoCE site's NCCL_IB_TC, say) hold for mplane too. A twin is read with NCCL's
 * grammar and meaning, never mplane's: numbers as NCCL's parameters read them (strtoll, base 0:
 * "022" is 18, "0x10" 16, text after the number ignored), NCCL's "unset" values (-1, -2) as unset,
 * and a value NCCL takes that mplane cannot use is mapped to what NCCL makes of it, or ignored with
 * one WARN naming it; never a failed init. */
enum twin_verdict { TWIN_USE, TWIN_UNSET, TWIN_MAPPED, TWIN_IGNORED };

/* What NCCL's value v means for the mplane row: *out and the verdict (why for MAPPED/IGNORED). */
typedef enum twin_verdict (*twin_map)(long v, long *out, char *why, size_t whylen);

static enum twin_verdict in_range(long v, long lo, long hi, long *out, char *why, size_t whylen) {
  if (v >= lo && v <= hi) {
    *out = v;
    return TWIN_USE;
  }
  snprintf(why, whylen, "outside %ld..%ld, which mplane can use", lo, hi);
  return TWIN_IGNORED;
}
/* NCCL's -1: unset (the traffic classes, the SL) */
static enum twin_verdict map_tc(long v, long *out, char *why, size_t n) {
  return v == -1 ? TWIN_UNSET : in_range(v, 0, 255, out, why, n);
}
static enum twin_verdict map_sl(long v, long *out, char *why, size_t n) {
  return v == -1 ? TWIN_UNSET : in_range(v, 0, 15, out, why, n);
}
static enum twin_verdict map_gid_index(long v, long *out, char *why, size_t n) { return in_range(v, -1, 255, out, why, n); }
static enum twin_verdict map_timeout(long v, long *out, char *why, size_t n) {
  if (v == 0) {
    snprintf(why, n, "0 asks for an infinite ACK timeout, which mplane does not use: a lost peer must end in an error");
    return TWIN_IGNORED;
  }
  return in_range(v, 1, 31, out, why, n);
}
static enum twin_verdict map_retry(long v, long *out, char *why, size_t n) { return in_range(v, 0, 7, out, why, n); }
static enum twin_verdict map_pkey(long v, long *out, char *why, size_t n) { return in_range(v, 0, 65535, out, why, n); }
/* NCCL takes 1..128 QPs; mplane carries at most 16 */
static enum twin_verdict map_qps(long v, long *out, char *why, size_t n) {
  if (v > 16 && v <= 128) {
    *out = 16;
    snprintf(why, n, "mplane uses at most 16 QPs per connection: 16");
    return TWIN_MAPPED;
  }
  return in_range(v, 1, 16, out, why, n);
}
/* NCCL reads these as "0 or anything else" */
static enum twin_verdict map_bool(long v, long *out, char *why, size_t n) {
  *out = v != 0;
  if (v == 0 || v == 1) return TWIN_USE;
  snprintf(why, n, "NCCL reads any value but 0 as on: 1");
  return TWIN_MAPPED;
}
/* NCCL: 1 on, 2 on where the verbs take it, anything else off */
static enum twin_verdict map_relaxed(long v, long *out, char *why, size_t n) {
  if (v >= 0 && v <= 2) {
    *out = v;
    return TWIN_USE;
  }
  *out = 0;
  snprintf(why, n, "NCCL turns relaxed ordering off for any value but 1 and 2: 0");
  return TWIN_MAPPED;
}
static enum twin_verdict map_roce_version(long v, long *out, char *why, size_t n) { return in_range(v, 1, 2, out, why, n); }
/* NCCL: -2 per link (its default), 0 off, anything else on */
static enum twin_verdict map_ar(long v, long *out, char *why, size_t n) {
  if (v == -2) {
    *out = -1;
    return TWIN_USE;
  }
  return map_bool(v, out, why, n);
}
/* NCCL: -2 its default (8 KiB); a message goes adaptive when its size is above the value */
static enum twin_verdict map_ar_threshold(long v, long *out, char *why, size_t n) {
  if (v == -2) return TWIN_UNSET;
  if (v < 0) {
    *out = 0;
    snprintf(why, n, "every message is above it: 0");
    return TWIN_MAPPED;
  }
  if (v > (1L << 30)) { /* no message is bigger than 1 GiB (MPIB_MAX_MSG): the same as 1G */
    *out = 1L << 30;
    return TWIN_USE;
  }
  *out = v;
  return TWIN_USE;
}

static const struct {
  const char *name, *nccl;
  twin_map map; /* numbers; NULL: text, checked by the row's own grammar */
} nccl_aliases[] = {
    {"MPLANE_GIN_IB_TC", "NCCL_GIN_IB_TC", map_tc},
    {"MPLANE_IB_HCA", "NCCL_IB_HCA", NULL},
    {"MPLANE_IB_GID_INDEX", "NCCL_IB_GID_INDEX", map_gid_index},
    {"MPLANE_IB_SL", "NCCL_IB_SL", map_sl},
    {"MPLANE_IB_TIMEOUT", "NCCL_IB_TIMEOUT", map_timeout},
    {"MPLANE_IB_RETRY_CNT", "NCCL_IB_RETRY_CNT", map_retry},
    {"MPLANE_IB_TC", "NCCL_IB_TC", map_tc},
    {"MPLANE_IB_FIFO_TC", "NCCL_IB_FIFO_TC", map_tc},
    {"MPLANE_IB_PKEY", "NCCL_IB_PKEY", map_pkey},
    {"MPLANE_IB_QPS", "NCCL_IB_QPS_PER_CONNECTION", map_qps},
    {"MPLANE_IB_ECE", "NCCL_IB_ECE_ENABLE", map_bool},
    {"MPLANE_IB_SOCKET_FAMILY", "NCCL_SOCKET_FAMILY", NULL},
    {"MPLANE_IB_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", NULL},
    {"MPLANE_IB_PCI_RELAXED_ORDERING", "NCCL_IB_PCI_RELAXED_ORDERING", map_relaxed},
    {"MPLANE_IB_ROCE_VERSION_NUM", "NCCL_IB_ROCE_VERSION_NUM", map_roce_version},
    {"MPLANE_IB_ADDR_FAMILY", "NCCL_IB_ADDR_FAMILY", NULL},
    {"MPLANE_IB_ADDR_RANGE", "NCCL_IB_ADDR_RANGE", NULL},
    {"MPLANE_IB_GDR_FLUSH_DISABLE", "NCCL_GDR_FLUSH_DISABLE", map_bool},
    {"MPLANE_IB_ADAPTIVE_ROUTING", "NCCL_IB_ADAPTIVE_ROUTING", map_ar},
    {"MPLANE_IB_AR_THRESHOLD", "NCCL_IB_AR_THRESHOLD", map_ar_threshold},
    {"MPLANE_IB_SPLIT_DATA_ON_QPS", "NCCL_IB_SPLIT_DATA_ON_QPS", map_bool},
    {"MPLANE_IB_DEVICE_PCI_ORDER", "NCCL_IB_DEVICE_PCI_ORDER", map_bool},
};
#define NTWINS (sizeof(nccl_aliases) / sizeof(nccl_aliases[0]))

static int twin_index(const char *name) {
  for (size_t i = 0; i < NTWINS; i++)
    if (!strcmp(nccl_aliases[i].name, name)) return (int)i;
  return -1;
}

static const char *nccl_alias(const char *name) {
  int i = twin_index(name);
  return i >= 0 ? nccl_aliases[i].nccl : NULL;
}

int mplane_config_nccl_twins(const char **names, const char **nccl, int max) {
  int n = 0;
  for (size_t i = 0; i < NTWINS && n < max; i++, n++) {
    if (names) names[n] = nccl_aliases[i].name;
    if (nccl) nccl[n] = nccl_aliases[i].nccl;
  }
  return (int)NTWINS;
}

/* The value of row r's variable, or of its NCCL alias when it is unset (*from names which). */
static const char *row_value(const char *name, const char **from) {
  const char *value = getenv(name), *alias = nccl_alias(name);
  *from = name;
  if ((value == NULL || value[0] == '\0') && alias) {
    value = getenv(alias);
    *from = alias;
  }
  return value == NULL || value[0] == '\0' ? NULL : value; /* empty is unset, as NCCL reads its variables */
}

/* Each twin WARNs once per process, however often the configuration is read. */
static unsigned long twin_warned;

static void twin_warn_once(int twin, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void twin_warn_once(int twin, const char *fmt, ...) {
  if (__atomic_fetch_or(&twin_warned, 1UL << twin, __ATOMIC_RELAXED) & (1UL << twin)) return;
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  MP_WARN("%s", msg);
}

/* NCCL's number grammar (its parameters: strtoll base 0, text after the number ignored, a value
 * out of range its default): 0 and *v, else -1 (out of range). *trailing: text was ignored. */
int mplane_nccl_parse_number(const char *s, long *v, int *trailing) {
  char *end = NULL;
  errno = 0;
  long long x = strtoll(s, &end, 0);
  if (errno == ERANGE || x > LONG_MAX || x < LONG_MIN) return -1;
  *trailing = end == s || *end != '\0';
  *v = (long)x;
  return 0;
}

struct row;
static int parse_row(const struct row *r, const char *value, struct mplane_config *cfg);

/* Row r takes NCCL's twin value: what NCCL makes of it, in the row's own grammar. 1 taken, 0 left
 * unset (the default holds); never an error. */
static int take_twin_as(const struct row *r, int twin, const char *value, struct mplane_config *cfg, int quiet);
static int take_twin(const struct row *r, int twin, const char *value, struct mplane_config *cfg) {
  return take_twin_as(r, twin, value, cfg, 0);
}

#define twin_warn(t, ...) \
  do {                    \
    if (!quiet) twin_warn_once(t, __VA_ARGS__); \
  } while (0)

/* quiet: only the verdict (mplane_config_source asks whether the twin's value holds). */
static int take_twin_as(const struct row *r, int twin, const char *value, struct mplane_config *cfg, int quiet) {
  const char *nccl = nccl_aliases[twin].nccl;
  if (!nccl_aliases[twin].map) {
    char why[256] = "the form it takes";
    if (parse_row(r, value, cfg) == 0 && (!r->validate || r->validate(value, why, sizeof(why)) == 0)) return 1;
    twin_warn(twin, "%s='%s' is not a value mplane can use for %s (%s); ignored (%s keeps its default)", nccl, value,
              r->name, why, r->name);
    return parse_row(r, r->dflt, cfg), 0;
  }
  long v = 0, out = 0;
  int trailing = 0;
  if (mplane_nccl_parse_number(value, &v, &trailing) != 0) {
    twin_warn(twin, "%s='%s' is out of range; ignored, as NCCL ignores it (%s keeps its default)", nccl, value,
               r->name);
    return 0;
  }
  char why[160] = "";
  enum twin_verdict verdict = nccl_aliases[twin].map(v, &out, why, sizeof(why));
  if (trailing && verdict != TWIN_IGNORED)
    twin_warn(twin, "%s='%s': NCCL reads it as %ld (the text after the number is ignored), and so does mplane", nccl,
               value, v);
  if (verdict == TWIN_UNSET) return 0;
  if (verdict == TWIN_IGNORED) {
    twin_warn(twin, "%s=%ld (NCCL accepts it) is %s; ignored (%s keeps its default)", nccl, v, why, r->name);
    return 0;
  }
  if (verdict == TWIN_MAPPED) twin_warn(twin, "%s=%ld: %s, for %s", nccl, v, why, r->name);
  char text[32];
  snprintf(text, sizeof(text), "%ld", out);
  if (parse_row(r, text, cfg) == 0) return 1;
  twin_warn(twin, "%s=%ld cannot be used for %s; ignored", nccl, v, r->name); /* a map out of step with its row */
  return 0;
}
#undef twin_warn

/* Digits of s (no sign) into *out; the end in *end. 0 on success: at least one digit, no leading
 * zero unless the number is "0", no overflow past LONG_MAX. */
static int parse_digits(const char *s, const char **end, unsigned long *out) {
  const char *p = s;
  unsigned long v = 0;
  if (!isdigit((unsigned char)*p)) return -1;
  if (p[0] == '0' && isdigit((unsigned char)p[1])) return -1;
  for (; isdigit((unsigned char)*p); p++) {
    unsigned d = (unsigned)(*p - '0');
    if (v > ((unsigned long)LONG_MAX - d) / 10) return -1;
    v = v * 10 + d;
  }
  *end = p;
  *out = v;
  return 0;
}

int mplane_parse_long(const char *s, long lo, long hi, long *out) {
  if (!s || !*s) return -1;
  int neg = *s == '-';
  const char *end;
  unsigned long mag;
  if (parse_digits(s + neg, &end, &mag) != 0 || *end != '\0') return -1;
  if (neg && mag == 0) return -1; /* "-0" */
  long v = neg ? -(long)mag : (long)mag;
  if (v < lo || v > hi) return -1;
  *out = v;
  return 0;
}

int mplane_parse_size(const char *s, long lo, long hi, long *out) {
  if (!s || !*s) return -1;
  const char *end;
  unsigned long v;
  if (parse_digits(s, &end, &v) != 0) return -1;
  unsigned long mult = 1;
  if (*end) {
    switch (*end) {
      case 'k': case 'K': mult = 1UL << 10; break;
      case 'm': case 'M': mult = 1UL << 20; break;
      case 'g': case 'G': mult = 1UL << 30; break;
      default: return -1;
    }
    if (end[1] != '\0') return -1;
  }
  if (hi < 0 || v > (unsigned long)hi / mult) return -1;
  long bytes = (long)(v * mult);
  if (bytes < lo || bytes > hi) return -1;
  *out = bytes;
  return 0;
}

static int parse_enum(const char *s, const char *choices, int *out) {
  int idx = 0;
  size_t n = strlen(s);
  for (const char *p = choices; *p; idx++) {
    const char *bar = strchr(p, '|');
    size_t len = bar ? (size_t)(bar - p) : strlen(p);
    if (len == n && strncasecmp(p, s, n) == 0) {
      *out = idx;
      return 0;
    }
    if (!bar) break;
    p = bar + 1;
  }
  return -1;
}

static int parse_row(const struct row *r, const char *value, struct mplane_config *cfg) {
  char *field = (char *)cfg + r->offset;
  long v;
  switch (r->kind) {
    case K_INT:
      if (mplane_parse_long(value, r->lo, r->hi, &v)) return -1;
      *(int *)field = (int)v;
      return 0;
    case K_SIZE:
      if (mplane_parse_size(value, r->lo, r->hi, &v)) return -1;
      *(long *)field = v;
      return 0;
    case K_BOOL:
      if (mplane_parse_long(value, 0, 1, &v)) return -1;
      *(int *)field = (int)v;
      return 0;
    case K_ENUM:
      return parse_enum(value, r->choices, (int *)field);
    case K_STR:
      if (strlen(value) >= r->str_len) return -1;
      strcpy(field, value);
      if (r->normalize) r->normalize(field);
      return 0;
  }
  return -1;
}

/* libmplane-ep's rows: mplane_config_load_ep reads them, mplane_config_load only their defaults, so a
 * bad MPLANE_EP_* value fails libmplane-ep's create, never the plugin's init. */
/* libmplane-hfreduce's (MPLANE_HFREDUCE_*) likewise, through mplane_config_load_hfreduce. */
enum row_reader { READER_PLUGIN = 0, READER_EP = 1, READER_HFREDUCE = 2 };
static int row_reader(const struct row *r) {
  if (strncmp(r->name, "MPLANE_EP_", 10) == 0) return READER_EP;
  if (strncmp(r->name, "MPLANE_HFREDUCE_", 16) == 0) return READER_HFREDUCE;
  return READER_PLUGIN;
}

/* Every row's default; the environment for the rows of one reader (enum row_reader). */
static ncclResult_t load_rows(struct mplane_config *cfg, int reader, char *err, size_t errlen) {
  memset(cfg, 0, sizeof(*cfg));
  for (size_t i = 0; i < sizeof(rows) / sizeof(rows[0]); i++) {
    const struct row *r = &rows[i];
    if (parse_row(r, r->dflt, cfg) != 0) {
      snprintf(err, errlen, "internal: default of %s does not parse", r->name);
      return ncclInternalError;
    }
    if (row_reader(r) != reader) continue;
    const char *from;
    const char *value = row_value(r->name, &from);
    if (value == NULL) continue;
    if (from != r->name) { /* NCCL's twin: its grammar and meaning, never a failed init */
      take_twin(r, twin_index(r->name), value, cfg);
      continue;
    }
    if (parse_row(r, value, cfg) != 0) {
      snprintf(err, errlen, "%s='%s' is not valid%s%s: expected %s", from, value, from != r->name ? " for " : "",
               from != r->name ? r->name : "", r->form);
      return ncclInvalidArgument;
    }
    char why[256] = "";
    if (r->validate && r->validate(value, why, sizeof(why)) != 0) {
      snprintf(err, errlen, "%s='%s' is not valid: %s; expected %s", from, value, why, r->form);
      return ncclInvalidArgument;
    }
  }
  return ncclSuccess;
}

ncclResult_t mplane_config_load(struct mplane_config *cfg, char *err, size_t errlen) {
  return load_rows(cfg, READER_PLUGIN, err, errlen);
}

ncclResult_t mplane_config_load_ep(struct mplane_config *cfg, char *err, size_t errlen) {
  return load_rows(cfg, READER_EP, err, errlen);
}

ncclResult_t mplane_config_load_hfreduce(struct mplane_config *cfg, char *err, size_t errlen) {
  return load_rows(cfg, READER_HFREDUCE, err, errlen);
}

const char *mplane_config_source(const char *name) {
  const char *from, *value = row_value(name, &from);
  if (!value || from == name) return value ? from : NULL;
  /* a twin's value NCCL reads as unset (NCCL_IB_SL=-1), or one mplane ignores, sets nothing */
  for (size_t i = 0; i < sizeof(rows) / sizeof(rows[0]); i++) {
    if (strcmp(rows[i].name, name) != 0) continue;
    struct mplane_config scratch;
    memset(&scratch, 0, sizeof(scratch));
    return take_twin_as(&rows[i], twin_index(name), value, &scratch, 1) ? from : NULL;
  }
  return from;
}

static pthread_once_t config_once = PTHREAD_ONCE_INIT;
static struct mplane_config global_config;
static int global_config_ok;

static void load_global(void) {
  char err[512];
  if (mplane_config_load(&global_config, err, sizeof(err)) != ncclSuccess) {
    MP_WARN("%s", err);
    return;
  }
  global_config_ok = 1;
  for (size_t i = 0; i < sizeof(nccl_aliases) / sizeof(nccl_aliases[0]); i++) {
    const char *from, *value = row_value(nccl_aliases[i].name, &from);
    if (value && from == nccl_aliases[i].nccl && mplane_config_source(nccl_aliases[i].name) == from)
      MP_INFO(NCCL_INIT | NCCL_ENV, "%s unset: using %s=%s", nccl_aliases[i].name, from, value);
  }
}

const struct mplane_config *mplane_config_get(void) {
  pthread_once(&config_once, load_global);
  return global_config_ok ? &global_config : NULL;
}

/* A Markdown table cell: '|' would end the cell, so it is escaped. */
static void md_cell(FILE *out, const char *text) {
  for (const char *c = text; *c; c++) {
    if (*c == '|') fputc('\\', out);
    fputc(*c, out);
  }
}

void mplane_config_describe(FILE *out, int markdown) {
  if (markdown) fprintf(out, "| variable | default | accepted | meaning |\n| --- | --- | --- | --- |\n");
  for (size_t i = 0; i < sizeof(rows) / sizeof(rows[0]); i++) {
    const struct row *r = &rows[i];
    const char *d = *r->dflt ? r->dflt : "(unset)";
    char meaning[512];
    const char *alias = nccl_alias(r->name);
    snprintf(meaning, sizeof(meaning), "%s%s%s%s", r->meaning, alias ? "; unset: " : "", alias ? alias : "",
             alias ? "'s value, when that is set" : "");
    if (markdown) {
      fprintf(out, "| `%s` | `%s` | ", r->name, d);
      md_cell(out, r->form);
      fputs(" | ", out);
      md_cell(out, meaning);
      fputs(" |\n", out);
    } else
      fprintf(out, "%-26s default %-12s %s\n%26s accepted: %s\n", r->name, d, meaning, "", r->form);
  }
}

/* ------------------------------------------------------------------ MPLANE_PLANES */

static int planes_blank(char c) { return c == ' ' || c == '\t'; }

static int planes_name_char(char c) {
  return isalnum((unsigned char)c) || c == '_' || c == '-' || c == '.' || c == ':';
}

int mplane_planes_parse(const char *value, struct mplane_planes_spec *out, char *why, size_t whylen) {
  memset(out, 0, sizeof(*out));
  if (!value) return 0;
  const char *p = value;
  while (planes_blank(*p)) p++;
  if (*p == '\0') return 0;
  p = value;
  for (;;) {
    const char *comma = strchr(p, ',');
    const char *a = p, *b = comma ? comma : p + strlen(p);
    while (a < b && planes_blank(*a)) a++;
    while (b > a && planes_blank(b[-1])) b--;
    int col = (int)(a - value) + 1;
    if (a == b) {
      snprintf(why, whylen, "empty entry at column %d (a stray comma?)", col);
      return -1;
    }
    const char *eq = memchr(a, '=', (size_t)(b - a));
    if (!eq) {
      snprintf(why, whylen, "entry '%.*s' at column %d has no '=plane'", (int)(b - a), a, col);
      return -1;
    }
    const char *ne = eq, *num = eq + 1;
    while (ne > a && planes_blank(ne[-1])) ne--;
    while (num < b && planes_blank(*num)) num++;
    size_t nlen = (size_t)(ne - a), numlen = (size_t)(b - num);
    if (nlen == 0) {
      snprintf(why, whylen, "entry '=%.*s' at column %d names no NIC", (int)numlen, num, col);
      return -1;
    }
    for (const char *c = a; c < ne; c++) {
      if (planes_name_char(*c)) continue;
      char shown[8];
      if (isprint((unsigned char)*c))
        snprintf(shown, sizeof(shown), "'%c'", *c);
      else
        snprintf(shown, sizeof(shown), "\\x%02x", (unsigned char)*c);
      snprintf(why, whylen, "NIC name '%.*s' has a character (%s) no NIC name has", (int)nlen, a, shown);
      return -1;
    }
    if (nlen >= MPLANE_PLANES_NAME_MAX) {
      snprintf(why, whylen, "NIC name '%.40s...' is too long (at most %d characters)", a, MPLANE_PLANES_NAME_MAX - 1);
      return -1;
    }
    char name[MPLANE_PLANES_NAME_MAX], numbuf[24];
    memcpy(name, a, nlen);
    name[nlen] = '\0';
    long plane = -1;
    int plane_ok = numlen > 0 && numlen < sizeof(numbuf);
    if (plane_ok) {
      memcpy(numbuf, num, numlen);
      numbuf[numlen] = '\0';
      plane_ok = mplane_parse_long(numbuf, 0, MPLANE_PLANES_MAX_PLANE, &plane) == 0;
    }
    if (!plane_ok) {
      snprintf(why, whylen, "plane '%.*s' of NIC '%s' is not an integer from 0 to %d", (int)(numlen < 40 ? numlen : 40),
               num, name, MPLANE_PLANES_MAX_PLANE);
      return -1;
    }
    for (int i = 0; i < out->n; i++) {
      if (strcmp(out->entry[i].nic, name) == 0) {
        snprintf(why, whylen, "NIC '%s' is given twice", name);
        return -1;
      }
    }
    if (out->n >= MPLANE_PLANES_MAX) {
      snprintf(why, whylen, "more than %d entries", MPLANE_PLANES_MAX);
      return -1;
    }
    memcpy(out->entry[out->n].nic, name, nlen + 1);
    out->entry[out->n].plane = (int)plane;
    out->n++;
    if (!comma) break;
    p = comma + 1;
  }
  return 0;
}

/* ------------------------------------------------------------------ files named by variables */

static const char *file_kind(mode_t m) {
  if (S_ISFIFO(m)) return "a FIFO";
  if (S_ISDIR(m)) return "a directory";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  if (S_ISSOCK(m)) return "a socket";
  return "not a plain file";
}

int mplane_open_regular_file(const char *var, const char *path, const char *expected, char *err, size_t errlen) {
  /* O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer, forever. */
  int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  if (fd < 0) return -1; /* errno says why; the caller words it */
  struct stat st;
  if (fstat(fd, &st) != 0) {
    int e = errno;
    close(fd);
    errno = e;
    return -1;
  }
  if (!S_ISREG(st.st_mode)) {
    snprintf(err, errlen, "%s='%s' is not a regular file (%s); expected %s", var, path, file_kind(st.st_mode),
             expected);
    close(fd);
    return -2;
  }
  int fl = fcntl(fd, F_GETFL);
  if (fl >= 0) fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
  return fd;
}
