/* libnetns-after-mpi-init.so: an LD_PRELOAD for MPI programs (nccl-tests) whose ranks should talk
 * over a veth pair (tools/mplane-netns) while MPI itself keeps the namespace it started in.
 *
 * MPI_Init and MPI_Init_thread run as usual (Open MPI reaches its launcher over the loopback of the
 * namespace it was started in); then the calling thread moves into the network namespace named by
 * NETNS_AFTER_MPI_INIT (a /proc/PID/ns/net path, or a file holding one, as `mplane-netns up` writes).
 * A network namespace belongs to a thread, and threads made afterwards inherit it: NCCL's bootstrap,
 * proxy and the net plugin's sockets all live in the new one, and MPI's own connections stay where
 * they were made. Unset: nothing changes. A namespace that cannot be entered ends the process. */
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static void move(void) {
  const char *spec = getenv("NETNS_AFTER_MPI_INIT");
  if (!spec || !*spec) return;
  char path[4096];
  snprintf(path, sizeof(path), "%s", spec);
  struct stat st;
  if (stat(spec, &st) == 0 && S_ISREG(st.st_mode)) {
    FILE *f = fopen(spec, "r");
    if (!f || fscanf(f, "%4095s", path) != 1) {
      fprintf(stderr, "netns-after-mpi-init: cannot read %s\n", spec);
      exit(1);
    }
    fclose(f);
  }
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0 || setns(fd, CLONE_NEWNET) != 0) {
    fprintf(stderr, "netns-after-mpi-init: NETNS_AFTER_MPI_INIT=%s: %s\n", path, strerror(errno));
    exit(1);
  }
  close(fd);
}

int MPI_Init(int *argc, char ***argv) {
  int (*real)(int *, char ***) = (int (*)(int *, char ***))dlsym(RTLD_NEXT, "MPI_Init");
  if (!real) {
    fprintf(stderr, "netns-after-mpi-init: no MPI_Init after this library\n");
    exit(1);
  }
  int rc = real(argc, argv);
  move();
  return rc;
}

int MPI_Init_thread(int *argc, char ***argv, int required, int *provided) {
  int (*real)(int *, char ***, int, int *) = (int (*)(int *, char ***, int, int *))dlsym(RTLD_NEXT, "MPI_Init_thread");
  if (!real) {
    fprintf(stderr, "netns-after-mpi-init: no MPI_Init_thread after this library\n");
    exit(1);
  }
  int rc = real(argc, argv, required, provided);
  move();
  return rc;
}
