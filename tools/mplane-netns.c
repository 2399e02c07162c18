/* mplane-netns: two network namespaces joined by a veth pair, made over netlink (no `ip` needed),
 * so two processes on one host talk over a real interface instead of loopback.
 *
 *   mplane-netns probe                 can this machine make them? exit 0 yes, 77 no (with the reason)
 *   mplane-netns up DIR [--mtu N]      make the pair; DIR/ns0 and DIR/ns1 then name the namespaces
 *                                      (/proc/PID/ns/net of a holder process each), DIR/pids the holders
 *   mplane-netns down DIR              end the holders: the namespaces and the veth go with them
 *   mplane-netns exec NSPATH CMD ...   run CMD in that namespace
 *
 * The ends are mpv0 (198.19.250.1/24, in ns0) and mpv1 (198.19.250.2/24, in ns1), from the
 * benchmarking range 198.18.0.0/15 (docs/planes.md), MTU 1500 unless --mtu says otherwise; loopback is
 * up in both. A namespace lives as long as its holder: `down` or killing the holders removes all of
 * it. Needs CAP_SYS_ADMIN and CAP_NET_ADMIN (root); `probe` says which step a machine refuses
 * (unshare, the veth, an address, a move) so a test can skip with that reason. */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/if_link.h>
#include <linux/rtnetlink.h>
#include <linux/veth.h>
#include <net/if.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#define END0 "mpv0"
#define END1 "mpv1"
static const char *const end_addr[2] = {"198.19.250.1", "198.19.250.2"};

static char why[256]; /* the step that failed and its errno, for probe and the error message */

static int fail(const char *step) {
  snprintf(why, sizeof(why), "%s: %s", step, strerror(errno));
  return -1;
}

/* ---- netlink: one request, one ack ---- */
struct req {
  struct nlmsghdr nh;
  char buf[1024];
};

static struct rtattr *add_attr(struct nlmsghdr *nh, int type, const void *data, size_t len) {
  struct rtattr *a = (struct rtattr *)((char *)nh + NLMSG_ALIGN(nh->nlmsg_len));
  a->rta_type = (unsigned short)type;
  a->rta_len = (unsigned short)RTA_LENGTH(len);
  if (len) memcpy(RTA_DATA(a), data, len);
  nh->nlmsg_len = NLMSG_ALIGN(nh->nlmsg_len) + RTA_ALIGN(a->rta_len);
  return a;
}

static void end_nest(struct nlmsghdr *nh, struct rtattr *nest) {
  nest->rta_len = (unsigned short)((char *)nh + nh->nlmsg_len - (char *)nest);
}

/* Sends the request on a netlink socket of the calling thread's namespace and reads the ack. */
static int talk(struct nlmsghdr *nh, const char *step) {
  int fd = socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, NETLINK_ROUTE);
  if (fd < 0) return fail(step);
  struct sockaddr_nl sa = {.nl_family = AF_NETLINK};
  nh->nlmsg_flags |= NLM_F_REQUEST | NLM_F_ACK;
  nh->nlmsg_seq = 1;
  if (sendto(fd, nh, nh->nlmsg_len, 0, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
    int e = errno;
    close(fd);
    errno = e;
    return fail(step);
  }
  char buf[4096];
  ssize_t n = recv(fd, buf, sizeof(buf), 0);
  int e = n < 0 ? errno : 0;
  close(fd);
  if (n < 0) {
    errno = e;
    return fail(step);
  }
  struct nlmsghdr *r = (struct nlmsghdr *)buf;
  if (!NLMSG_OK(r, (unsigned)n) || r->nlmsg_type != NLMSG_ERROR) {
    errno = EPROTO;
    return fail(step);
  }
  int err = ((struct nlmsgerr *)NLMSG_DATA(r))->error;
  if (err) {
    errno = -err;
    return fail(step);
  }
  return 0;
}

/* RTM_NEWLINK kind veth: END0 in the namespace of pid0, its peer END1 in that of pid1. */
static int make_veth(pid_t pid0, pid_t pid1, int mtu) {
  struct req q;
  memset(&q, 0, sizeof(q));
  q.nh.nlmsg_len = NLMSG_LENGTH(sizeof(struct ifinfomsg));
  q.nh.nlmsg_type = RTM_NEWLINK;
  q.nh.nlmsg_flags = NLM_F_CREATE | NLM_F_EXCL;
  ((struct ifinfomsg *)NLMSG_DATA(&q.nh))->ifi_family = AF_UNSPEC;
  uint32_t p0 = (uint32_t)pid0, p1 = (uint32_t)pid1, m = (uint32_t)mtu;
  add_attr(&q.nh, IFLA_IFNAME, END0, sizeof(END0));
  add_attr(&q.nh, IFLA_MTU, &m, sizeof(m));
  add_attr(&q.nh, IFLA_NET_NS_PID, &p0, sizeof(p0));
  struct rtattr *info = add_attr(&q.nh, IFLA_LINKINFO, NULL, 0);
  add_attr(&q.nh, IFLA_INFO_KIND, "veth", 4);
  struct rtattr *data = add_attr(&q.nh, IFLA_INFO_DATA, NULL, 0);
  struct rtattr *peer = add_attr(&q.nh, VETH_INFO_PEER, NULL, 0);
  q.nh.nlmsg_len += sizeof(struct ifinfomsg); /* the peer's own ifinfomsg, zeroed */
  add_attr(&q.nh, IFLA_IFNAME, END1, sizeof(END1));
  add_attr(&q.nh, IFLA_MTU, &m, sizeof(m));
  add_attr(&q.nh, IFLA_NET_NS_PID, &p1, sizeof(p1));
  end_nest(&q.nh, peer);
  end_nest(&q.nh, data);
  end_nest(&q.nh, info);
  return talk(&q.nh, "RTM_NEWLINK veth");
}

static int link_up(const char *ifname) {
  unsigned idx = if_nametoindex(ifname);
  if (!idx) return fail(ifname);
  struct req q;
  memset(&q, 0, sizeof(q));
  q.nh.nlmsg_len = NLMSG_LENGTH(sizeof(struct ifinfomsg));
  q.nh.nlmsg_type = RTM_NEWLINK;
  struct ifinfomsg *ifi = NLMSG_DATA(&q.nh);
  ifi->ifi_index = (int)idx;
  ifi->ifi_flags = IFF_UP;
  ifi->ifi_change = IFF_UP;
  return talk(&q.nh, "RTM_NEWLINK up");
}

static int add_addr(const char *ifname, const char *ip, int prefix) {
  unsigned idx = if_nametoindex(ifname);
  if (!idx) return fail(ifname);
  struct req q;
  memset(&q, 0, sizeof(q));
  q.nh.nlmsg_len = NLMSG_LENGTH(sizeof(struct ifaddrmsg));
  q.nh.nlmsg_type = RTM_NEWADDR;
  q.nh.nlmsg_flags = NLM_F_CREATE | NLM_F_EXCL;
  struct ifaddrmsg *ifa = NLMSG_DATA(&q.nh);
  ifa->ifa_family = AF_INET;
  ifa->ifa_prefixlen = (unsigned char)prefix;
  ifa->ifa_index = idx;
  struct in_addr a;
  inet_pton(AF_INET, ip, &a);
  add_attr(&q.nh, IFA_LOCAL, &a, sizeof(a));
  add_attr(&q.nh, IFA_ADDRESS, &a, sizeof(a));
  return talk(&q.nh, "RTM_NEWADDR");
}

static int enter(const char *nspath) {
  int fd = open(nspath, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return fail(nspath);
  int r = setns(fd, CLONE_NEWNET);
  int e = errno;
  close(fd);
  errno = e;
  return r ? fail("setns") : 0;
}

/* A holder: a process in a new network namespace of its own, asleep until it is killed. It tells
 * the parent over `ready` whether unshare worked (0) or its errno. */
static pid_t spawn_holder(int detach) {
  int p[2];
  if (pipe(p)) return -1;
  pid_t pid = fork();
  if (pid == 0) {
    close(p[0]);
    if (detach) setsid();
    int e = unshare(CLONE_NEWNET) ? errno : 0;
    if (write(p[1], &e, sizeof(e)) != sizeof(e)) _exit(1);
    close(p[1]);
    if (e) _exit(1);
    if (detach) {
      int null = open("/dev/null", O_RDWR);
      if (null >= 0) { dup2(null, 0); dup2(null, 1); dup2(null, 2); }
    }
    for (;;) pause();
  }
  close(p[1]);
  int e = EIO;
  if (pid < 0 || read(p[0], &e, sizeof(e)) != sizeof(e) || e) {
    close(p[0]);
    if (pid > 0) waitpid(pid, NULL, 0);
    errno = e;
    fail("unshare(CLONE_NEWNET)");
    return -1;
  }
  close(p[0]);
  return pid;
}

/* Builds the pair between holders h[0], h[1]: the veth, then inside each namespace lo up, the
 * end's address, the end up. The calling process moves between namespaces; it ends where it was. */
static int build(const pid_t h[2], int mtu) {
  if (make_veth(h[0], h[1], mtu)) return -1;
  int home = open("/proc/self/ns/net", O_RDONLY | O_CLOEXEC);
  if (home < 0) return fail("/proc/self/ns/net");
  int rc = 0;
  for (int i = 0; i < 2 && rc == 0; i++) {
    char path[64];
    snprintf(path, sizeof(path), "/proc/%d/ns/net", (int)h[i]);
    rc = enter(path);
    if (!rc) rc = link_up("lo");
    if (!rc) rc = add_addr(i ? END1 : END0, end_addr[i], 24);
    if (!rc) rc = link_up(i ? END1 : END0);
  }
  if (setns(home, CLONE_NEWNET) && rc == 0) rc = fail("setns back");
  close(home);
  return rc;
}

static int write_file(const char *dir, const char *name, const char *text) {
  char path[4096];
  snprintf(path, sizeof(path), "%s/%s", dir, name);
  FILE *f = fopen(path, "w");
  if (!f) return fail(path);
  fputs(text, f);
  return fclose(f) ? fail(path) : 0;
}

static int cmd_probe(void) {
  pid_t h[2] = {spawn_holder(0), -1};
  int rc = h[0] < 0 ? -1 : 0;
  if (!rc) rc = (h[1] = spawn_holder(0)) < 0 ? -1 : 0;
  if (!rc) rc = build(h, 1500);
  for (int i = 0; i < 2; i++)
    if (h[i] > 0) {
      kill(h[i], SIGKILL);
      waitpid(h[i], NULL, 0);
    }
  if (rc) {
    printf("mplane-netns: this machine cannot make a veth pair between namespaces: %s\n", why);
    return 77;
  }
  printf("mplane-netns: namespaces and a veth pair can be made here\n");
  return 0;
}

static int cmd_up(const char *dir, int mtu) {
  if (mkdir(dir, 0755) && errno != EEXIST) {
    fprintf(stderr, "mplane-netns: %s: %s\n", dir, strerror(errno));
    return 1;
  }
  pid_t h[2] = {spawn_holder(1), -1};
  int rc = h[0] < 0 ? -1 : 0;
  if (!rc) rc = (h[1] = spawn_holder(1)) < 0 ? -1 : 0;
  if (!rc) rc = build(h, mtu);
  char text[64];
  for (int i = 0; i < 2 && !rc; i++) {
    snprintf(text, sizeof(text), "/proc/%d/ns/net\n", (int)h[i]);
    rc = write_file(dir, i ? "ns1" : "ns0", text);
  }
  if (!rc) {
    snprintf(text, sizeof(text), "%d %d\n", (int)h[0], (int)h[1]);
    rc = write_file(dir, "pids", text);
  }
  if (rc) {
    for (int i = 0; i < 2; i++)
      if (h[i] > 0) kill(h[i], SIGKILL);
    fprintf(stderr, "mplane-netns: up %s: %s\n", dir, why);
    return errno == EPERM || errno == EOPNOTSUPP || errno == ENOSYS ? 77 : 1;
  }
  printf("%s %s/%s in %s/ns0 <-> %s %s/24 in %s/ns1 (mtu %d)\n", END0, end_addr[0], "24", dir, END1, end_addr[1],
         dir, mtu);
  return 0;
}

static int cmd_down(const char *dir) {
  char path[4096];
  snprintf(path, sizeof(path), "%s/pids", dir);
  FILE *f = fopen(path, "r");
  if (!f) {
    fprintf(stderr, "mplane-netns: down: %s: %s\n", path, strerror(errno));
    return 1;
  }
  int p[2] = {0, 0};
  int n = fscanf(f, "%d %d", &p[0], &p[1]);
  fclose(f);
  for (int i = 0; i < n && i < 2; i++) {
    /* only a holder of ours: its namespace differs from ours and it sleeps */
    if (p[i] > 1) kill(p[i], SIGKILL);
  }
  unlink(path);
  return n == 2 ? 0 : 1;
}

static void usage(void) {
  fprintf(stderr, "usage: mplane-netns probe | up DIR [--mtu N] | down DIR | exec NSPATH CMD [ARG ...]\n");
  exit(2);
}

int main(int argc, char **argv) {
  if (argc < 2) usage();
  if (!strcmp(argv[1], "probe") && argc == 2) return cmd_probe();
  if (!strcmp(argv[1], "up") && (argc == 3 || argc == 5)) {
    int mtu = 1500;
    if (argc == 5) {
      char *end;
      long v = strtol(argv[4], &end, 10);
      if (strcmp(argv[3], "--mtu") || *end || v < 68 || v > 65535) {
        fprintf(stderr, "mplane-netns: --mtu '%s': expected a whole number from 68 to 65535\n", argv[4]);
        return 2;
      }
      mtu = (int)v;
    }
    return cmd_up(argv[2], mtu);
  }
  if (!strcmp(argv[1], "down") && argc == 3) return cmd_down(argv[2]);
  if (!strcmp(argv[1], "exec") && argc >= 4) {
    char path[4096];
    snprintf(path, sizeof(path), "%s", argv[2]);
    /* NSPATH may be DIR/ns0, a file holding the namespace's path */
    FILE *f = fopen(argv[2], "r");
    struct stat st;
    if (f && stat(argv[2], &st) == 0 && S_ISREG(st.st_mode)) {
      if (fscanf(f, "%4095s", path) != 1) snprintf(path, sizeof(path), "%s", argv[2]);
    }
    if (f) fclose(f);
    if (enter(path)) {
      fprintf(stderr, "mplane-netns: exec: %s\n", why);
      return 1;
    }
    execvp(argv[3], argv + 3);
    fprintf(stderr, "mplane-netns: exec %s: %s\n", argv[3], strerror(errno));
    return 127;
  }
  usage();
}
