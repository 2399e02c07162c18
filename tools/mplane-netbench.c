/* mplane-netbench: what the plugin sees on this machine, and how fast it moves bytes.
 *
 *   mplane-netbench [--plugin PATH] [--size BYTES] [--window N] [--seconds S | --rounds N] [--raw-streams N]
 *                   [--repeat N] [--sender-env "VAR=VALUE ..."] [--sender-netns PATH] [--devices-only]
 *   mplane-netbench [--plugin PATH] --pingpong [--min-size B] [--max-size B] [--iters N]
 *
 * Prints the devices the plugin discovers (NCCL's view: name, plane, speed, PCI path), then runs a
 * two-process bandwidth check through the plugin's ncclNet_v11 table on device 0, driven the way
 * NCCL's proxy drives it (a window of isend/irecv in flight, test polling), with every byte checked
 * in the first and last rounds. It also measures a plain TCP transfer over as many streams as the
 * plugin's connection opens (what it says at INFO; --raw-streams N: N streams, 0: none)
 * between the same two processes over the same address (device 0's), as many bytes: the ceiling the
 * plugin is judged against. --repeat N alternates the two N times (plugin, raw, plugin, raw ...) and
 * prints each pair and the min / median / max of both and of the pair-by-pair ratio: on a shared
 * machine one plugin run and one raw run seconds apart can differ 2x by load alone. Without
 * --rounds a short first plugin run, not counted, sizes the runs so that each plugin run lasts
 * about --seconds at the rate it measured (each raw run moves the same bytes).
 * --sender-netns PATH runs the sending process in another network namespace (scripts/netns or
 * tools/mplane-netns makes a pair joined by a veth), so the bytes cross a real interface.
 * Each process opens the plugin itself after the fork, as two ranks would (verbs contexts do not
 * survive a fork); --sender-env sets variables in the sending process only, e.g. its own HCA.
 * --rounds fixes the number of windows moved instead (no first run).
 *
 * --pingpong measures latency instead: for each size from --min-size (8) to --max-size (1 MiB), x4
 * apart, one process sends a message through the plugin and the other sends it back, --iters times
 * (default 2000, fewer above 64 KiB). Each side keeps two receives posted (of --max-size bytes) and
 * reposts one after the send that depends on it, as NCCL's proxy posts the receives of the steps
 * ahead while it waits for the GPU. Beside it, in the same processes and interleaved with it in
 * batches (the machine's noise hits both alike), a plain TCP ping-pong over 127.0.0.1 that polls the
 * same way (non-blocking calls, sched_yield when nothing moved). Prints median and p99 round trip of
 * both and the ratio of the medians. Every message is checked (a sequence stamp at both ends and in
 * the middle; the whole body at the end of each batch).
 * Sizes take K/M/G suffixes (x1024); an option whose number does not read is refused (exit 2).
 * Exit status is non-zero on any error or wrong byte. */
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <getopt.h>
#include <limits.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/config.h"
#include "common/nccl/net.h"

struct opts {
  const char *plugin;
  size_t size;
  int window;
  double seconds;
  int raw_streams;
  int devices_only;
  long rounds;
  const char *sender_env;
  const char *sender_netns;
  int repeat;
  int pingpong;
  size_t min_size, max_size;
  long iters;
};

static void die(const char *what) {
  fprintf(stderr, "mplane-netbench: %s\n", what);
  exit(1);
}

#define NCHECK(call)                                                            \
  do {                                                                          \
    ncclResult_t r_ = (call);                                                   \
    if (r_ != ncclSuccess) {                                                    \
      fprintf(stderr, "mplane-netbench: %s failed (%d)\n", #call, (int)r_);   \
      exit(1);                                                                  \
    }                                                                           \
  } while (0)

/* The data streams per connection the plugin says it opens (its INFO "N data streams per
 * connection"), -1 until it says: what --raw-streams defaults to, so the ratio compares like with
 * like. */
static int g_plugin_streams = -1;

static void logger(ncclDebugLogLevel level, unsigned long flags, const char *file, int line, const char *fmt, ...) {
  (void)flags; (void)file; (void)line;
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  const char *at = strstr(msg, " data streams per connection");
  if (at && level == NCCL_LOG_INFO) {
    const char *p = at;
    while (p > msg && p[-1] >= '0' && p[-1] <= '9') p--;
    if (p < at) g_plugin_streams = atoi(p);
  }
  if (level != NCCL_LOG_WARN && !getenv("MPLANE_DEBUG")) return;
  fprintf(stderr, "%s\n", msg);
}

static void fill(char *buf, size_t n, unsigned round) {
  for (size_t i = 0; i < n; i++) buf[i] = (char)((i * 131u) ^ (round * 29u));
}

static int check(const char *buf, size_t n, unsigned round) {
  for (size_t i = 0; i < n; i++)
    if (buf[i] != (char)((i * 131u) ^ (round * 29u))) return -1;
  return 0;
}

static void print_devices(ncclNet_v11_t *net) {
  int n = 0;
  NCHECK(net->devices(&n));
  printf("%d device%s through %s:\n", n, n == 1 ? "" : "s", net->name);
  for (int d = 0; d < n; d++) {
    ncclNetProperties_v11_t p;
    NCHECK(net->getProperties(d, &p));
    printf("  dev %d  %-12s speed %6d Mb/s  ptr %s%s  maxRecvs %d  pci %s\n", d, p.name, p.speed,
           (p.ptrSupport & NCCL_PTR_HOST) ? "host" : "", (p.ptrSupport & NCCL_PTR_CUDA) ? "+cuda" : "", p.maxRecvs,
           p.pciPath ? p.pciPath : "(none)");
  }
}

/* Moves `rounds * window` messages of `size` bytes with a sliding window of `window` requests in
 * flight, as NCCL's proxy does (a completed slot is reposted at once). Bytes are checked in the
 * first and last window. Both sides agree on the count. */
static void plugin_side(ncclNet_v11_t *net, void *comm, int sender, const struct opts *o, long rounds,
                        double *secs) {
  int w = o->window;
  long total = rounds * w;
  char *bufs[64];
  void *mh[64], *req[64] = {0};
  long msg_of[64];
  for (int i = 0; i < w; i++) {
    if (posix_memalign((void **)&bufs[i], 4096, o->size ? o->size : 1)) die("out of memory");
    NCHECK(net->regMr(comm, bufs[i], o->size, NCCL_PTR_HOST, &mh[i]));
  }
  double t0 = mplane_now_s();
  long posted = 0, completed = 0;
  while (completed < total) {
    for (int i = 0; i < w && posted < total; i++) {
      if (req[i] != NULL) continue;
      long m = posted;
      int verify = m < w || m >= total - w;
      if (sender && verify) fill(bufs[i], o->size, (unsigned)m);
      int tag = 0;
      if (sender) NCHECK(net->isend(comm, bufs[i], o->size, tag, mh[i], NULL, &req[i]));
      else {
        void *d = bufs[i];
        size_t sz = o->size;
        NCHECK(net->irecv(comm, 1, &d, &sz, &tag, &mh[i], NULL, &req[i]));
      }
      if (req[i] == NULL) break; /* not yet possible: NCCL retries later, so do we */
      msg_of[i] = m;
      posted++;
    }
    int progressed = 0;
    for (int i = 0; i < w; i++) {
      if (req[i] == NULL) continue;
      int done = 0, sz = -1;
      NCHECK(net->test(req[i], &done, &sz));
      if (!done) continue;
      if ((size_t)sz != o->size) die("wrong size reported by test()");
      long m = msg_of[i];
      if (!sender && (m < w || m >= total - w) && check(bufs[i], o->size, (unsigned)m)) die("wrong bytes received");
      req[i] = NULL;
      completed++;
      progressed = 1;
    }
    /* Like NCCL's proxy: yield the core when nothing progressed. */
    if (!progressed) sched_yield();
  }
  *secs = mplane_now_s() - t0;
  for (int i = 0; i < w; i++) {
    net->deregMr(comm, mh[i]);
    free(bufs[i]);
  }
}

/* ---- raw TCP ceiling: N plain streams, one thread each, same address ---- */
struct raw_arg {
  int fd;
  size_t bytes;
  int sender;
  size_t chunk;
  size_t footprint; /* bytes of buffer cycled through, like the plugin's window of messages */
};

static void *raw_thread(void *p) {
  struct raw_arg *a = p;
  size_t foot = a->footprint > a->chunk ? a->footprint : a->chunk;
  char *buf = malloc(foot);
  memset(buf, 1, foot);
  size_t left = a->bytes, off = 0;
  while (left > 0) {
    size_t n = left < a->chunk ? left : a->chunk;
    if (off + n > foot) off = 0;
    ssize_t r = a->sender ? send(a->fd, buf + off, n, MSG_NOSIGNAL) : recv(a->fd, buf + off, n, MSG_WAITALL);
    if (r <= 0) {
      if (errno == EINTR) continue;
      die("raw TCP transfer failed");
    }
    left -= (size_t)r;
    off += (size_t)r;
  }
  free(buf);
  return NULL;
}

/* The raw streams: opened once, before the first round, between the two processes (the sender
 * connects from its own process, in its own network namespace where --sender-netns says so), over
 * the address of the plugin's device 0, so both cross the same interface. */
struct raw_link {
  int lfd;
  struct sockaddr_storage addr;
  socklen_t len;
  int fds[64];
};

static void raw_listen(struct raw_link *r, const char *ip) {
  struct sockaddr_in *a4 = (struct sockaddr_in *)&r->addr;
  struct sockaddr_in6 *a6 = (struct sockaddr_in6 *)&r->addr;
  memset(&r->addr, 0, sizeof(r->addr));
  int family = strchr(ip, ':') ? AF_INET6 : AF_INET;
  if (family == AF_INET) {
    a4->sin_family = AF_INET;
    inet_pton(AF_INET, ip, &a4->sin_addr);
    r->len = sizeof(*a4);
  } else {
    a6->sin6_family = AF_INET6;
    inet_pton(AF_INET6, ip, &a6->sin6_addr);
    r->len = sizeof(*a6);
  }
  r->lfd = socket(family, SOCK_STREAM, 0);
  if (r->lfd < 0 || bind(r->lfd, (struct sockaddr *)&r->addr, r->len) || listen(r->lfd, 64)) die("raw TCP listen failed");
  getsockname(r->lfd, (struct sockaddr *)&r->addr, &r->len);
}

static void raw_connect(struct raw_link *r, int streams) {
  for (int i = 0; i < streams; i++) {
    int fd = socket(r->addr.ss_family, SOCK_STREAM, 0);
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    if (connect(fd, (struct sockaddr *)&r->addr, r->len)) die("raw TCP connect failed");
    r->fds[i] = fd;
  }
}

static void raw_accept(struct raw_link *r, int streams) {
  for (int i = 0; i < streams; i++)
    if ((r->fds[i] = accept(r->lfd, NULL, NULL)) < 0) die("raw TCP accept failed");
}

/* One raw round: `total` bytes over the streams, one thread each. Each stream cycles through
 * footprint/streams bytes of buffer, so the raw run touches as much memory as the plugin's window
 * does (a 1 MiB buffer would stay in cache and flatter the ceiling). Returns the seconds taken. */
static double raw_round(const struct raw_link *r, int streams, size_t total, size_t footprint, int sender) {
  pthread_t th[64];
  struct raw_arg args[64];
  size_t per = total / (size_t)streams;
  double t0 = mplane_now_s();
  for (int i = 0; i < streams; i++) {
    args[i] = (struct raw_arg){r->fds[i], per, sender, 1 << 20, footprint / (size_t)streams};
    pthread_create(&th[i], NULL, raw_thread, &args[i]);
  }
  for (int i = 0; i < streams; i++) pthread_join(th[i], NULL);
  return mplane_now_s() - t0;
}

/* The first IPv4 (else IPv6) address of interface `ifname`: where the plugin's device 0 listens. */
static void iface_ip(const char *ifname, char *ip, size_t len) {
  struct ifaddrs *ifas = NULL, *a;
  snprintf(ip, len, "127.0.0.1");
  if (getifaddrs(&ifas) != 0) return;
  for (int pass = 0; pass < 2; pass++)
    for (a = ifas; a; a = a->ifa_next) {
      if (!a->ifa_addr || strcmp(a->ifa_name, ifname) != 0) continue;
      if (pass == 0 && a->ifa_addr->sa_family == AF_INET) {
        inet_ntop(AF_INET, &((struct sockaddr_in *)a->ifa_addr)->sin_addr, ip, (socklen_t)len);
        goto out;
      }
      if (pass == 1 && a->ifa_addr->sa_family == AF_INET6 &&
          !IN6_IS_ADDR_LINKLOCAL(&((struct sockaddr_in6 *)a->ifa_addr)->sin6_addr)) {
        inet_ntop(AF_INET6, &((struct sockaddr_in6 *)a->ifa_addr)->sin6_addr, ip, (socklen_t)len);
        goto out;
      }
    }
out:
  freeifaddrs(ifas);
}

/* --sender-netns PATH: the sending process moves into that network namespace (a /proc/PID/ns/net
 * or a bind mount of one) before it opens the plugin, so the two processes talk over a real link
 * (a veth pair) instead of loopback. */
static void enter_netns(const char *spec) {
  char path[4096];
  snprintf(path, sizeof(path), "%s", spec);
  struct stat st;
  FILE *f = stat(spec, &st) == 0 && S_ISREG(st.st_mode) ? fopen(spec, "r") : NULL; /* a file naming it */
  if (f) {
    if (fscanf(f, "%4095s", path) != 1) snprintf(path, sizeof(path), "%s", spec);
    fclose(f);
  }
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0 || setns(fd, CLONE_NEWNET) != 0) {
    fprintf(stderr, "mplane-netbench: --sender-netns '%s': %s\n", path, strerror(errno));
    _exit(1);
  }
  close(fd);
}

static void usage(void) {
  fprintf(stderr, "usage: mplane-netbench [--plugin PATH] [--size BYTES] [--window N] [--seconds S | --rounds N] "
                  "[--raw-streams N] [--repeat N] [--sender-env \"VAR=VALUE ...\"] [--sender-netns PATH] [--devices-only]\n"
                  "       mplane-netbench [--plugin PATH] --pingpong [--min-size B] [--max-size B] [--iters N]\n");
  exit(2);
}

/* A whole number for option `opt`, with a K/M/G suffix (x1024) where `suffixes`, read as the
 * MPLANE_* variables are (common/config.h); anything else is an error naming the option and the
 * text (a silent "1M" -> 1 would measure the wrong thing). The ranges are checked after parsing. */
static unsigned long long parse_num(const char *opt, const char *text, int suffixes) {
  long v = 0;
  if ((suffixes ? mplane_parse_size(text, 0, LONG_MAX, &v) : mplane_parse_long(text, 0, LONG_MAX, &v)) != 0) {
    fprintf(stderr, "mplane-netbench: %s '%s': expected a whole number%s\n", opt, text,
            suffixes ? " of bytes, K/M/G suffixes allowed" : "");
    exit(2);
  }
  return (unsigned long long)v;
}

static void parse(int argc, char **argv, struct opts *o) {
  static const struct option longopts[] = {{"plugin", 1, 0, 'p'},      {"size", 1, 0, 's'},
                                           {"window", 1, 0, 'w'},      {"seconds", 1, 0, 't'},
                                           {"raw-streams", 1, 0, 'r'}, {"devices-only", 0, 0, 'd'},
                                           {"rounds", 1, 0, 'n'},      {"sender-env", 1, 0, 'e'},
                                           {"pingpong", 0, 0, 'P'},    {"min-size", 1, 0, 'a'},
                                           {"max-size", 1, 0, 'b'},    {"iters", 1, 0, 'i'},
                                           {"repeat", 1, 0, 'R'},      {"sender-netns", 1, 0, 'N'},
                                           {"help", 0, 0, 'h'},        {0, 0, 0, 0}};
  int c;
  while ((c = getopt_long(argc, argv, "p:s:w:t:r:dn:e:h", longopts, NULL)) != -1) {
    switch (c) {
      case 'p': o->plugin = optarg; break;
      case 's': o->size = parse_num("--size", optarg, 1); break;
      case 'w': o->window = (int)parse_num("--window", optarg, 0); break;
      case 't': {
        char *end = NULL;
        o->seconds = strtod(optarg, &end);
        if (end == optarg || *end || !(o->seconds > 0 && o->seconds <= 3600)) {
          fprintf(stderr, "mplane-netbench: --seconds '%s': expected a number of seconds, more than 0, at most 3600\n",
                  optarg);
          exit(2);
        }
        break;
      }
      case 'r': o->raw_streams = (int)parse_num("--raw-streams", optarg, 0); break;
      case 'd': o->devices_only = 1; break;
      case 'n': o->rounds = (long)parse_num("--rounds", optarg, 0); break;
      case 'e': o->sender_env = optarg; break;
      case 'P': o->pingpong = 1; break;
      case 'a': o->min_size = parse_num("--min-size", optarg, 1); break;
      case 'b': o->max_size = parse_num("--max-size", optarg, 1); break;
      case 'i': o->iters = (long)parse_num("--iters", optarg, 0); break;
      case 'R': o->repeat = (int)parse_num("--repeat", optarg, 0); break;
      case 'N': o->sender_netns = optarg; break;
      default: usage();
    }
  }
  if (o->window < 1 || o->window > 32) die("--window must be 1..32");
  if (o->repeat < 1 || o->repeat > 1000) die("--repeat must be 1..1000");
  if (o->size > (1u << 30)) die("--size must be at most 1G");
  if (o->raw_streams < -1 || o->raw_streams > 64) die("--raw-streams must be 0..64");
  if (o->rounds < 0 || o->rounds > 10000000) die("--rounds must be 1..10000000");
  if (o->iters < 0 || o->iters > 10000000) die("--iters must be 1..10000000");
  if (o->min_size < 1 || o->max_size < o->min_size || o->max_size > (1u << 30)) die("--min-size/--max-size: 1 <= min <= max <= 1G");
}

/* dlopen the plugin and init it in this process; devices are this process's own. */
static ncclNet_v11_t *open_plugin(const char *path, void **ctx) {
  void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    fprintf(stderr, "mplane-netbench: cannot load %s: %s\n", path, dlerror());
    exit(1);
  }
  ncclNet_v11_t *net = dlsym(lib, "ncclNetPlugin_v11");
  if (!net) die("plugin exports no ncclNetPlugin_v11");
  ncclNetCommConfig_v11_t cfg = {NCCL_NET_TRAFFIC_CLASS_UNDEF};
  NCHECK(net->init(ctx, 1, &cfg, logger, NULL));
  return net;
}

/* "VAR=VALUE VAR=VALUE": set in this process. */
static void apply_env(const char *spec) {
  char *copy = strdup(spec), *save = NULL;
  for (char *kv = strtok_r(copy, " ", &save); kv; kv = strtok_r(NULL, " ", &save)) {
    char *eq = strchr(kv, '=');
    if (!eq || eq == kv) die("--sender-env: expected VAR=VALUE");
    *eq = 0;
    setenv(kv, eq + 1, 1);
  }
  free(copy);
}

/* ---- ping-pong: round-trip latency through the plugin beside plain TCP ---- */

#define PP_BATCHES 5 /* plugin and raw alternate this many times per size */
#define PP_POSTED 2  /* receives each side keeps posted */
#define PP_TAG 7

struct pp_plugin {
  ncclNet_v11_t *net;
  void *send_comm, *recv_comm;
  char *sbuf, *rbuf[PP_POSTED];
  void *smh, *rmh[PP_POSTED];
  size_t cap;
  void *rreq[PP_POSTED]; /* posted receives, of the whole buffer (NCCL posts its step size, not the message's) */
  long next;             /* the message the oldest posted receive gets; it lands in rbuf[next % PP_POSTED] */
};

static long pp_iters(const struct opts *o, size_t size) {
  long n = o->iters ? o->iters : 2000;
  if (!o->iters && size > 65536) n = (long)(n * 65536 / size) < 100 ? 100 : (long)(n * 65536 / size);
  return n;
}

/* Post the receive that message k will land in (receives complete in the order they were posted). */
static void pp_post_recv(struct pp_plugin *p, long k) {
  int tag = PP_TAG, b = (int)(k % PP_POSTED);
  void *d = p->rbuf[b];
  size_t sz = p->cap;
  while (!p->rreq[b]) {
    NCHECK(p->net->irecv(p->recv_comm, 1, &d, &sz, &tag, &p->rmh[b], NULL, &p->rreq[b]));
    if (!p->rreq[b]) sched_yield();
  }
}

/* The body of every message carries a fixed pattern, filled once per size and checked in full at the
 * end of each batch; each round stamps its sequence number at both ends and in the middle, checked
 * on every receive, so a stale, shifted or misrouted message shows without a byte loop in the timing. */
static char pp_byte(size_t i) { return (char)(i * 7u + (i >> 8) + 1); }

static void pp_fill(char *buf, size_t n) {
  for (size_t i = 0; i < n; i++) buf[i] = pp_byte(i);
}

static void pp_stamp(char *buf, size_t n, long seq) {
  size_t at[3] = {0, n / 2, n - 1};
  for (int i = 0; i < 3 && n; i++) buf[at[i]] = (char)(seq * 13 + i);
}

static void pp_check_stamp(const char *buf, size_t n, long seq) {
  size_t at[3] = {0, n / 2, n - 1};
  for (int i = 0; i < 3 && n; i++)
    if (buf[at[i]] != (char)(seq * 13 + i)) die("ping-pong: wrong message received (stamp)");
}

static void pp_check_body(const char *buf, size_t n) {
  for (size_t i = 1; i + 1 < n; i++)
    if (i != n / 2 && buf[i] != pp_byte(i)) die("ping-pong: wrong bytes received");
}

static void pp_wait(struct pp_plugin *p, void **req, size_t size) {
  int done = 0, sz = -1;
  while (!done) {
    NCHECK(p->net->test(*req, &done, &sz));
    if (!done) sched_yield();
  }
  if (size != (size_t)-1 && (size_t)sz != size) die("ping-pong: wrong size reported by test()");
  *req = NULL;
}

/* One round trip: the initiator sends seq and waits for seq + 1; the echo waits for seq and sends
 * seq + 1. After its dependent send each side reposts the receive that completed, so the next
 * message always finds a receive posted ahead, as NCCL's proxy posts receives for the steps
 * ahead while it waits for the GPU. */
static void pp_plugin_round(struct pp_plugin *p, size_t size, long seq, int initiator) {
  void *sreq = NULL;
  if (!initiator) {
    int b = (int)(p->next % PP_POSTED);
    pp_wait(p, &p->rreq[b], size);
    pp_check_stamp(p->rbuf[b], size, seq);
    pp_stamp(p->sbuf, size, seq + 1);
    while (!sreq) {
      NCHECK(p->net->isend(p->send_comm, p->sbuf, size, PP_TAG, p->smh, NULL, &sreq));
      if (!sreq) sched_yield();
    }
    pp_post_recv(p, p->next + PP_POSTED);
    p->next++;
    pp_wait(p, &sreq, (size_t)-1);
    return;
  }
  pp_stamp(p->sbuf, size, seq);
  while (!sreq) {
    NCHECK(p->net->isend(p->send_comm, p->sbuf, size, PP_TAG, p->smh, NULL, &sreq));
    if (!sreq) sched_yield();
  }
  int b = (int)(p->next % PP_POSTED), rdone = 0, sdone = 0;
  while (!rdone || !sdone) {
    int progressed = 0, sz = -1;
    if (!sdone) {
      NCHECK(p->net->test(sreq, &sdone, NULL));
      progressed |= sdone;
    }
    if (!rdone) {
      NCHECK(p->net->test(p->rreq[b], &rdone, &sz));
      if (rdone && (size_t)sz != size) die("ping-pong: wrong size reported by test()");
      progressed |= rdone;
    }
    if (!progressed) sched_yield();
  }
  p->rreq[b] = NULL;
  pp_check_stamp(p->rbuf[b], size, seq + 1);
  pp_post_recv(p, p->next + PP_POSTED);
  p->next++;
}

/* Plain TCP, polled the same way: non-blocking send/recv, sched_yield when nothing moved. */
static void pp_raw_xfer(int fd, char *buf, size_t n, int sending) {
  size_t have = 0;
  while (have < n) {
    ssize_t r = sending ? send(fd, buf + have, n - have, MSG_NOSIGNAL | MSG_DONTWAIT)
                        : recv(fd, buf + have, n - have, MSG_DONTWAIT);
    if (r > 0) have += (size_t)r;
    else if (r == 0) die("raw ping-pong: peer closed");
    else if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) sched_yield();
    else die("raw ping-pong: send/recv failed");
  }
}

/* One round on raw sockets: sfd carries this side's message, rfd the peer's (the same socket, or
 * one per direction as a net plugin's send and receive comms are). */
static void pp_raw_round(int sfd, int rfd, char *sbuf, char *rbuf, size_t size, long seq, int initiator) {
  if (!initiator) {
    pp_raw_xfer(rfd, rbuf, size, 0);
    pp_check_stamp(rbuf, size, seq);
    pp_stamp(sbuf, size, seq + 1);
    pp_raw_xfer(sfd, sbuf, size, 1);
    return;
  }
  pp_stamp(sbuf, size, seq);
  pp_raw_xfer(sfd, sbuf, size, 1);
  pp_raw_xfer(rfd, rbuf, size, 0);
  pp_check_stamp(rbuf, size, seq + 1);
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static double pct(double *v, long n, double q) {
  qsort(v, (size_t)n, sizeof(*v), cmp_double);
  long i = (long)(q * (double)(n - 1) + 0.5);
  return v[i < n ? i : n - 1];
}

/* Both processes run this; rank 0 (the parent) initiates and prints. */
static int pingpong_main(const struct opts *o) {
  int sp[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, sp)) die("socketpair failed");
  /* the raw TCP listener, made before the fork so both know its port */
  int lfd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET};
  inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  socklen_t alen = sizeof(a);
  if (bind(lfd, (struct sockaddr *)&a, alen) || listen(lfd, 4)) die("raw TCP listen failed");
  getsockname(lfd, (struct sockaddr *)&a, &alen);
  fflush(NULL);
  pid_t pid = fork();
  if (pid < 0) die("fork failed");
  int rank = pid == 0 ? 1 : 0;
  int cfd = sp[rank];
  close(sp[1 - rank]);
  if (rank == 1 && o->sender_env) apply_env(o->sender_env);

  struct pp_plugin p = {0};
  void *ctx = NULL;
  p.net = open_plugin(o->plugin, &ctx);
  if (rank == 0) print_devices(p.net);
  char mine[NCCL_NET_HANDLE_MAXSIZE] = {0}, peer[NCCL_NET_HANDLE_MAXSIZE] = {0};
  void *listen_comm = NULL;
  NCHECK(p.net->listen(ctx, 0, mine, &listen_comm));
  if (write(cfd, mine, sizeof(mine)) != sizeof(mine) || read(cfd, peer, sizeof(peer)) != sizeof(peer))
    die("handle exchange failed");
  while (!p.send_comm || !p.recv_comm) {
    if (!p.send_comm) NCHECK(p.net->connect(ctx, 0, peer, &p.send_comm, NULL));
    if (!p.recv_comm) NCHECK(p.net->accept(listen_comm, &p.recv_comm, NULL));
  }
  size_t cap = p.cap = o->max_size;
  if (posix_memalign((void **)&p.sbuf, 4096, cap)) die("out of memory");
  NCHECK(p.net->regMr(p.send_comm, p.sbuf, cap, NCCL_PTR_HOST, &p.smh));
  for (int b = 0; b < PP_POSTED; b++) {
    if (posix_memalign((void **)&p.rbuf[b], 4096, cap)) die("out of memory");
    NCHECK(p.net->regMr(p.recv_comm, p.rbuf[b], cap, NCCL_PTR_HOST, &p.rmh[b]));
  }

  /* raw[0]: one socket both ways; raw[1], raw[2]: one socket per direction (rank 0 sends on [1]),
   * which is what a plugin's separate send and receive comms are: each message's ACK then travels
   * alone instead of riding the reply */
  int raw[3];
  for (int k = 0; k < 3; k++) {
    if (rank == 0) {
      raw[k] = accept(lfd, NULL, NULL);
    } else {
      raw[k] = socket(AF_INET, SOCK_STREAM, 0);
      if (raw[k] < 0 || connect(raw[k], (struct sockaddr *)&a, alen)) die("raw TCP connect failed");
    }
    int one = 1;
    setsockopt(raw[k], IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  }
  close(lfd);
  int rfd = raw[0], s2 = raw[rank == 0 ? 1 : 2], r2 = raw[rank == 0 ? 2 : 1];
  char *rsbuf = malloc(cap), *rrbuf = malloc(cap);
  if (!rsbuf || !rrbuf || rfd < 0) die("raw TCP setup failed");
  for (int k = 0; k < PP_POSTED; k++) pp_post_recv(&p, k);

  if (rank == 0) {
    printf("ping-pong round trip, us (plugin %s on dev 0, %d receives posted ahead; raw TCP over 127.0.0.1; "
           "%d interleaved batches per size)\n", p.net->name, PP_POSTED, PP_BATCHES);
    printf("(raw: one socket both ways; raw2: one socket per direction, as the plugin's send and receive comms)\n");
    printf("%10s %8s %12s %10s %12s %10s %8s %12s %8s\n", "bytes", "iters", "plugin med", "p99", "raw med", "p99",
           "ratio", "raw2 med", "ratio2");
  }
  long seq = 0;
  for (size_t size = o->min_size; size <= o->max_size; size = size * 4 > o->max_size && size < o->max_size ? o->max_size : size * 4) {
    long iters = pp_iters(o, size), per = (iters + PP_BATCHES - 1) / PP_BATCHES;
    iters = per * PP_BATCHES;
    double *tp = malloc(sizeof(double) * (size_t)iters), *tr = malloc(sizeof(double) * (size_t)iters);
    double *t2 = malloc(sizeof(double) * (size_t)iters);
    long np = 0, nr = 0, n2 = 0;
    pp_fill(p.sbuf, size);
    pp_fill(rsbuf, size);
    long warm = per < 50 ? per : 50;
    for (long i = 0; i < warm; i++, seq += 2) {
      pp_plugin_round(&p, size, seq, rank == 0);
      pp_raw_round(rfd, rfd, rsbuf, rrbuf, size, seq, rank == 0);
      pp_raw_round(s2, r2, rsbuf, rrbuf, size, seq, rank == 0);
    }
    for (int b = 0; b < PP_BATCHES; b++) {
      for (long i = 0; i < per; i++, seq += 2) {
        double t0 = mplane_now_s();
        pp_plugin_round(&p, size, seq, rank == 0);
        tp[np++] = (mplane_now_s() - t0) * 1e6;
      }
      pp_check_body(p.rbuf[(p.next - 1) % PP_POSTED], size);
      for (long i = 0; i < per; i++, seq += 2) {
        double t0 = mplane_now_s();
        pp_raw_round(rfd, rfd, rsbuf, rrbuf, size, seq, rank == 0);
        tr[nr++] = (mplane_now_s() - t0) * 1e6;
      }
      pp_check_body(rrbuf, size);
      for (long i = 0; i < per; i++, seq += 2) {
        double t0 = mplane_now_s();
        pp_raw_round(s2, r2, rsbuf, rrbuf, size, seq, rank == 0);
        t2[n2++] = (mplane_now_s() - t0) * 1e6;
      }
      pp_check_body(rrbuf, size);
    }
    if (rank == 0) {
      double pm = pct(tp, np, 0.5), p99 = pct(tp, np, 0.99), rm = pct(tr, nr, 0.5), r99 = pct(tr, nr, 0.99);
      double m2 = pct(t2, n2, 0.5);
      printf("%10zu %8ld %12.1f %10.1f %12.1f %10.1f %7.2fx %12.1f %7.2fx\n", size, iters, pm, p99, rm, r99, pm / rm,
             m2, pm / m2);
      fflush(stdout);
    }
    free(tp);
    free(tr);
    free(t2);
    if (size == o->max_size) break;
  }
  /* receives are still posted on each side: closing a comm with some pending is allowed */
  char bye = 0;
  if (write(cfd, &bye, 1) != 1 || read(cfd, &bye, 1) != 1) die("final handshake failed");
  NCHECK(p.net->deregMr(p.send_comm, p.smh));
  for (int b = 0; b < PP_POSTED; b++) NCHECK(p.net->deregMr(p.recv_comm, p.rmh[b]));
  NCHECK(p.net->closeSend(p.send_comm));
  NCHECK(p.net->closeRecv(p.recv_comm));
  NCHECK(p.net->closeListen(listen_comm));
  for (int k = 0; k < 3; k++) close(raw[k]);
  if (rank == 1) _exit(0);
  int st;
  waitpid(pid, &st, 0);
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) die("echo process failed");
  return 0;
}

/* What the receiver tells the sender: the plugin's handle, the rounds, and the raw streams' address. */
struct bench_plan {
  char handle[NCCL_NET_HANDLE_MAXSIZE];
  long rounds;
  struct sockaddr_storage raw_addr;
  socklen_t raw_len;
};

/* The sending process: its own plugin, connect to the handle the receiver sends, then --repeat
 * times: move the rounds through the plugin, wait for the receiver's go, move as many bytes raw. */
static void sender_main(const struct opts *o, int fd) {
  if (o->sender_netns) enter_netns(o->sender_netns);
  if (o->sender_env) apply_env(o->sender_env);
  void *ctx = NULL;
  ncclNet_v11_t *net = open_plugin(o->plugin, &ctx);
  struct bench_plan plan;
  if (read(fd, &plan, sizeof(plan)) != sizeof(plan)) _exit(1);
  void *send_comm = NULL;
  while (!send_comm) NCHECK(net->connect(ctx, 0, plan.handle, &send_comm, NULL));
  struct opts mine = *o;
  o = &mine;
  /* the receiver's count of raw streams, once it accepted (the plugin's own by default) */
  if (read(fd, &mine.raw_streams, sizeof(mine.raw_streams)) != sizeof(mine.raw_streams)) _exit(1);
  struct raw_link raw = {.lfd = -1, .len = plan.raw_len};
  memcpy(&raw.addr, &plan.raw_addr, sizeof(raw.addr));
  if (o->raw_streams > 0) raw_connect(&raw, o->raw_streams);
  size_t per_round = o->size * (size_t)o->window;
  long rounds = plan.rounds;
  /* without --rounds, pair -1 is the receiver's first run, not counted (no raw run) */
  for (int r = o->rounds ? 0 : -1; r < o->repeat; r++) {
    double secs;
    plugin_side(net, send_comm, 1, o, rounds, &secs);
    long next; /* the receiver's go, with the rounds of the next pair */
    if (read(fd, &next, sizeof(next)) != sizeof(next)) _exit(1);
    if (r >= 0 && o->raw_streams > 0) raw_round(&raw, o->raw_streams, per_round * (size_t)rounds, per_round, 1);
    rounds = next;
  }
  NCHECK(net->closeSend(send_comm));
  for (int i = 0; i < o->raw_streams; i++) close(raw.fds[i]);
  _exit(0);
}

/* min / median / max of n values (sorted in place). */
static void spread(double *v, int n, double out[3]) {
  qsort(v, (size_t)n, sizeof(*v), cmp_double);
  out[0] = v[0];
  out[1] = n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
  out[2] = v[n - 1];
}

int main(int argc, char **argv) {
  struct opts o = {.plugin = "libnccl-net-mplane.so", .size = 4 << 20, .window = 8, .seconds = 3, .repeat = 1, .raw_streams = -1,
                   .min_size = 8, .max_size = 1 << 20};
  parse(argc, argv, &o);
  if (o.pingpong) return pingpong_main(&o);
  int pipefd[2] = {-1, -1};
  pid_t pid = -1;
  if (!o.devices_only) {
    if (pipe(pipefd)) die("pipe failed");
    fflush(NULL);
    pid = fork();
    if (pid < 0) die("fork failed");
    if (pid == 0) sender_main(&o, pipefd[0]);
  }
  void *ctx = NULL;
  ncclNet_v11_t *net = open_plugin(o.plugin, &ctx);
  print_devices(net);
  if (o.devices_only) return net->finalize(ctx) == ncclSuccess ? 0 : 1;

  ncclNetProperties_v11_t p0;
  NCHECK(net->getProperties(0, &p0));
  /* Calibrate rounds from a time budget (or take --rounds): the receiver decides, tells the sender. */
  struct bench_plan plan;
  memset(&plan, 0, sizeof(plan));
  void *listen_comm = NULL, *recv_comm = NULL;
  NCHECK(net->listen(ctx, 0, plan.handle, &listen_comm));
  size_t per_round = o.size * (size_t)o.window;
  /* Without --rounds a first plugin run, not counted and with no raw run beside it, measures the
   * rate: a tenth of --seconds at a first guess of 4 GB/s or 200k messages/s, whichever is fewer
   * rounds (a host that moves 1 GB/s takes 0.4 of it, one that moves 20 a fiftieth; 8-byte
   * messages at 35k/s about 0.6), so the counted runs move --seconds' worth at the rate the host
   * really has (a fixed 4 GB/s guess made `--seconds 2` run 7.5 s at 1 GB/s, plus the raw run of
   * the same bytes, and 8-byte messages 100000 rounds, minutes). */
  double by_bytes = o.seconds * 0.1 * 4e9 / (double)(per_round ? per_round : 1);
  double by_msgs = o.seconds * 0.1 * 2e5 / (double)(o.window > 0 ? o.window : 1);
  long rounds = o.rounds ? o.rounds : (long)(by_bytes < by_msgs ? by_bytes : by_msgs) + 2;
  if (!o.rounds && rounds > 100000) rounds = 100000;
  plan.rounds = rounds;
  char ip[INET6_ADDRSTRLEN];
  iface_ip(p0.name, ip, sizeof(ip));
  struct raw_link raw = {.lfd = -1};
  if (o.raw_streams != 0) {
    raw_listen(&raw, ip);
    memcpy(&plan.raw_addr, &raw.addr, sizeof(raw.addr));
    plan.raw_len = raw.len;
  }
  if (write(pipefd[1], &plan, sizeof(plan)) != sizeof(plan)) die("pipe write failed");
  int st;
  while (!recv_comm) {
    NCHECK(net->accept(listen_comm, &recv_comm, NULL));
    if (!recv_comm && waitpid(pid, &st, WNOHANG) == pid) die("sender process failed before it connected");
  }
  if (o.raw_streams < 0) {
    o.raw_streams = g_plugin_streams > 0 ? g_plugin_streams : 0;
    printf("raw TCP gets %d streams: the plugin's own data streams per connection%s\n", o.raw_streams,
           g_plugin_streams > 0 ? "" : " (it said none: no raw run)");
  }
  if (write(pipefd[1], &o.raw_streams, sizeof(o.raw_streams)) != sizeof(o.raw_streams)) die("pipe write failed");
  if (o.raw_streams > 0) raw_accept(&raw, o.raw_streams);
  /* Plugin and raw rounds alternate, so a noisy machine's drift hits both alike; the ratio is
   * taken pair by pair. */
  double pg[1000], rg[1000], ratio[1000];
  for (int r = o.rounds ? 0 : -1; r < o.repeat; r++) {
    double secs;
    plugin_side(net, recv_comm, 0, &o, rounds, &secs);
    double gbs = (double)per_round * rounds / secs / 1e9;
    long next = rounds;
    if (r < 0) {
      next = (long)(o.seconds * gbs * 1e9 / (double)per_round) + 2;
      if (next > 100000) next = 100000;
    }
    if (r < 0) {
      printf("calibration (not counted): plugin %.2f GB/s over %ld rounds; the counted runs move %ld\n", gbs,
             rounds, next);
    } else {
      pg[r] = gbs;
      if (o.repeat > 1 || o.raw_streams == 0)
        printf("plugin   %-10s %zu-byte messages, %d in flight: %.2f GB/s (%ld rounds, %.2f s, bytes checked), "
               "%.0f messages/s\n", p0.name, o.size, o.window, pg[r], rounds, secs, (double)o.window * rounds / secs);
    }
    if (write(pipefd[1], &next, sizeof(next)) != sizeof(next)) die("pipe write failed");
    if (o.raw_streams == 0 || r < 0) {
      rounds = next;
      continue;
    }
    double rs = raw_round(&raw, o.raw_streams, per_round * (size_t)rounds, per_round, 0);
    long moved = rounds;
    rounds = next;
    if (r < 0) continue;
    rg[r] = (double)per_round * moved / rs / 1e9;
    ratio[r] = pg[r] / rg[r];
    if (o.repeat == 1)
      printf("plugin   %-10s %zu-byte messages, %d in flight: %.2f GB/s (%ld rounds, %.2f s, bytes checked), "
             "%.0f messages/s\n", p0.name, o.size, o.window, pg[r], moved, secs, (double)o.window * moved / secs);
    printf("raw-tcp  %-10s %d streams, 1 MiB writes over %zu bytes of buffer: %.2f GB/s\n", ip, o.raw_streams,
           per_round, rg[r]);
    printf("ratio    plugin / raw TCP = %.0f%%\n", 100.0 * ratio[r]);
  }
  waitpid(pid, &st, 0);
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) die("sender process failed");
  NCHECK(net->closeRecv(recv_comm));
  NCHECK(net->closeListen(listen_comm));
  NCHECK(net->finalize(ctx)); /* frees init's context: LeakSanitizer runs this tool (tests/abi/sanitize.sh) */
  for (int i = 0; i < o.raw_streams; i++) close(raw.fds[i]);
  if (raw.lfd >= 0) close(raw.lfd);
  if (o.repeat > 1) {
    double a[3];
    spread(pg, o.repeat, a);
    printf("summary  %d pairs, min / median / max: plugin %.2f / %.2f / %.2f GB/s", o.repeat, a[0], a[1], a[2]);
    if (o.raw_streams > 0) {
      spread(rg, o.repeat, a);
      printf(", raw TCP %.2f / %.2f / %.2f GB/s", a[0], a[1], a[2]);
      spread(ratio, o.repeat, a);
      printf(", ratio %.0f%% / %.0f%% / %.0f%%", 100 * a[0], 100 * a[1], 100 * a[2]);
    }
    printf("\n");
  }
  return 0;
}
