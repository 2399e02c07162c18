/* The data segments this process's TCP sockets have sent, summed over every socket it holds (the
 * plugin's connections share the process's file table): how many sends the socket RMA transport
 * made, seen from outside it. With TCP_NODELAY on loopback each send of ours leaves as one segment,
 * so a test can count the plugin's system calls without reaching into it. */
#include <dirent.h>
#include <linux/tcp.h>
#include <netinet/in.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include "tcp_segs.h"

uint64_t tcp_data_segs_out(void) {
  uint64_t sum = 0;
  DIR *d = opendir("/proc/self/fd");
  if (!d) return 0;
  for (struct dirent *e; (e = readdir(d));) {
    int fd = atoi(e->d_name);
    struct stat st;
    if (e->d_name[0] == '.' || fd == dirfd(d) || fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) continue;
    struct tcp_info ti;
    socklen_t len = sizeof(ti);
    if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &len) != 0) continue; /* not TCP */
    if (len >= offsetof(struct tcp_info, tcpi_data_segs_out) + sizeof(ti.tcpi_data_segs_out))
      sum += ti.tcpi_data_segs_out;
  }
  closedir(d);
  return sum;
}
