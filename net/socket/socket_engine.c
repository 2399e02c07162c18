/* mplane: the socket transport's I/O engine (socket.h, "the I/O engine"). A process holds one pool
 * of I/O threads, whatever its number of peers: each thread waits in epoll on the data streams
 * given to it, round robin as connections attach them, on an eventfd that wakes it for new work,
 * and keeps a few splice pipes, made when it starts. The threads start as streams come
 * (a process that only ever sends small messages starts none).
 *
 * Locking: a thread's lock covers its streams' send queues, its ready list (send streams with new
 * chunks) and its detach list; the thread runs the I/O itself without it. A stream is taken back
 * through the detach list, so that its memory is freed only once its thread no longer holds an
 * event of it. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <unistd.h>

#include "../../common/clock.h"
#include "../../common/log.h"
#include "socket.h"

#define MPS_POOL_MAX 64        /* threads of the pool at most (MPLANE_SOCKET_THREADS' bound) */
#define MPS_EVENTS 64          /* epoll events taken per wait */
#define MPS_PIPE_BYTES (1u << 20) /* a 512 KiB chunk in one vmsplice; Linux's default limit for users */
#define MPS_POOL_PIPES 4 /* splice pipes a thread holds at most: one per stream whose socket is full */

struct mps_pool {
  int index;
  pthread_t thread;
  int started;
  int epfd, wake_fd;
  pthread_mutex_t lock;
  pthread_cond_t detached;         /* a stream on the detach list was let go */
  struct mps_stream *ready, *ready_tail;
  struct mps_stream *detach;
  int sleeping;                    /* under lock: in epoll_wait, wake through wake_fd */
  uint64_t spin_ns;
  struct {                         /* splice pipes, made as chunks need them */
    int fd[2];
    struct mps_stream *owner;      /* the stream whose bytes are still in it (its socket was full) */
    size_t bytes;
  } pipes[MPS_POOL_PIPES];
  int npipes;
};

static struct {
  pthread_mutex_t lock;
  int size;                        /* threads the pool may have (fixed at the first attach) */
  int started;
  unsigned next;                   /* the thread the next stream goes to */
  struct mps_pool pools[MPS_POOL_MAX];
} g_engine = {.lock = PTHREAD_MUTEX_INITIALIZER};

int mps_pool_size_for(const struct mplane_config *cfg, int nstreams, int ncpus) {
  if (cfg->socket_threads > 0) return cfg->socket_threads;
  int n = ncpus < 2 * nstreams ? ncpus : 2 * nstreams;
  if (n < 1) n = 1;
  return n > MPS_POOL_MAX ? MPS_POOL_MAX : n;
}

int mps_engine_threads(void) { return __atomic_load_n(&g_engine.started, __ATOMIC_ACQUIRE); }

void mps_engine_arm(struct mps_stream *st, uint32_t events) {
  if (st->armed == events) return;
  struct epoll_event ev = {.events = events, .data.ptr = st};
  epoll_ctl(st->pool->epfd, EPOLL_CTL_MOD, st->fd, &ev);
  st->armed = events;
}

/* ---- splice pipes: a thread's streams share its few pipes; a pipe left holding bytes (its socket
 * was full) stays its stream's until it drains, and a chunk that finds none free is copied ---- */

int *mps_engine_pipe(struct mps_stream *st) {
  struct mps_pool *p = st->pool;
  int free_one = -1;
  for (int i = 0; i < p->npipes; i++) {
    if (p->pipes[i].owner == st) return p->pipes[i].fd;
    if (!p->pipes[i].owner && free_one < 0) free_one = i;
  }
  return free_one >= 0 ? p->pipes[free_one].fd : NULL;
}

/* The thread's pipes, made when it starts (a fixed cost per thread, none per connection; a thread
 * whose pipes could not all be made splices with fewer, after one WARN). */
static void pipes_make(struct mps_pool *p) {
  if (!mps_config()->socket_splice_bytes) return;
  while (p->npipes < MPS_POOL_PIPES) {
    int *fd = p->pipes[p->npipes].fd;
    if (pipe2(fd, O_CLOEXEC | O_NONBLOCK) != 0) {
      struct rlimit rl = {0};
      getrlimit(RLIMIT_NOFILE, &rl);
      MP_WARN("socket: I/O thread %d made %d of its %d splice pipes (%s; open files limited to %ld): its chunks "
              "are copied while those are busy; MPLANE_SOCKET_SPLICE_BYTES=0 turns splicing off, "
              "MPLANE_SOCKET_THREADS=n lowers the pipes", p->index, p->npipes, MPS_POOL_PIPES, strerror(errno),
              (long)rl.rlim_cur);
      return;
    }
    fcntl(fd[1], F_SETPIPE_SZ, MPS_PIPE_BYTES); /* best effort: a smaller pipe takes more calls */
    p->npipes++;
  }
}

/* The pipe (as mps_engine_pipe gave it) holds bytes of st's chunk, or (0) is empty again. */
static int pipe_index(struct mps_pool *p, const int *fd) {
  for (int i = 0; i < p->npipes; i++)
    if (p->pipes[i].fd == fd) return i;
  return -1;
}

void mps_engine_pipe_hold(struct mps_stream *st, const int *fd, size_t bytes) {
  int i = pipe_index(st->pool, fd);
  st->pool->pipes[i].bytes = bytes;
  st->pool->pipes[i].owner = bytes ? st : NULL;
}

size_t mps_engine_pipe_bytes(struct mps_stream *st, const int *fd) {
  int i = pipe_index(st->pool, fd);
  return st->pool->pipes[i].owner == st ? st->pool->pipes[i].bytes : 0;
}

/* ---- the thread ---- */

static void wake(struct mps_pool *p) {
  uint64_t one = 1;
  if (write(p->wake_fd, &one, sizeof(one)) < 0) {} /* EAGAIN: a wake-up is pending anyway */
}

/* Under lock: let go of the streams asked back. Their events of the last wait were all handled. */
static void detach_listed(struct mps_pool *p) {
  while (p->detach) {
    struct mps_stream *st = p->detach;
    p->detach = st->next;
    epoll_ctl(p->epfd, EPOLL_CTL_DEL, st->fd, NULL);
    for (int i = 0; i < p->npipes; i++) {
      if (p->pipes[i].owner != st) continue;
      char drop[4096]; /* its bytes in the pipe can go nowhere now */
      while (read(p->pipes[i].fd[0], drop, sizeof(drop)) > 0) {}
      p->pipes[i].owner = NULL;
      p->pipes[i].bytes = 0;
    }
    st->detached = 1;
  }
  pthread_cond_broadcast(&p->detached);
}

/* Under lock: the next send stream with new chunks, off the ready list. */
static struct mps_stream *pop_ready(struct mps_pool *p) {
  struct mps_stream *st = p->ready;
  if (!st) return NULL;
  p->ready = st->next;
  if (!p->ready) p->ready_tail = NULL;
  st->listed = 0;
  return st;
}

static void *pool_thread(void *arg) {
  struct mps_pool *p = arg;
  char name[16];
  snprintf(name, sizeof(name), "mplane-io%d", p->index);
  pthread_setname_np(pthread_self(), name);
  /* splice() has no MSG_NOSIGNAL: a peer gone mid-chunk must give EPIPE here, not kill the job. */
  sigset_t pipe_sig;
  sigemptyset(&pipe_sig);
  sigaddset(&pipe_sig, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipe_sig, NULL);
  struct epoll_event evs[MPS_EVENTS];
  uint64_t idle_since = 0;
  for (;;) {
    pthread_mutex_lock(&p->lock);
    detach_listed(p);
    /* New chunks first; a stream detached meanwhile has left the list (mps_engine_detach). */
    struct mps_stream *st;
    int worked = 0;
    while ((st = pop_ready(p))) {
      pthread_mutex_unlock(&p->lock);
      mps_stream_io(st, 0);
      worked = 1;
      pthread_mutex_lock(&p->lock);
    }
    int timeout = 0;
    if (!worked) {
      /* Poll a moment before sleeping (MPLANE_SOCKET_SPIN_US): a wake-up costs more than a small
       * chunk on a fast link. */
      uint64_t now = p->spin_ns ? mplane_now_ns() : 0;
      if (!idle_since) idle_since = now;
      if (!p->spin_ns || now - idle_since >= p->spin_ns) {
        timeout = -1;
        p->sleeping = 1;
      }
    } else {
      idle_since = 0;
    }
    pthread_mutex_unlock(&p->lock);
    if (p->index == 0) { /* the stream listener's thread: accepted streams that never say hello go */
      int due = mps_stream_hellos_sweep();
      if (due >= 0 && (timeout < 0 || due < timeout)) timeout = due;
    }
    int n = epoll_wait(p->epfd, evs, MPS_EVENTS, timeout);
    if (timeout) {
      pthread_mutex_lock(&p->lock);
      p->sleeping = 0;
      pthread_mutex_unlock(&p->lock);
    }
    for (int i = 0; i < n; i++) {
      struct mps_stream *st = evs[i].data.ptr;
      if (!st) {
        uint64_t wakes;
        if (read(p->wake_fd, &wakes, sizeof(wakes)) < 0) {}
        continue;
      }
      idle_since = 0;
      mps_stream_io(st, evs[i].events);
    }
  }
  return NULL;
}

/* Make thread i (under g_engine.lock). 0, or -1 after a WARN naming what ran out. */
static int pool_start(int i) {
  struct mps_pool *p = &g_engine.pools[i];
  memset(p, 0, sizeof(*p));
  p->index = i;
  p->spin_ns = mps_spin_ns(mps_config());
  pthread_mutex_init(&p->lock, NULL);
  pthread_cond_init(&p->detached, NULL);
  p->epfd = epoll_create1(EPOLL_CLOEXEC);
  p->wake_fd = p->epfd >= 0 ? eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC) : -1;
  struct epoll_event ev = {.events = EPOLLIN, .data.ptr = NULL};
  const char *what = "file descriptors (its epoll and eventfd)";
  int err = errno;
  if (p->wake_fd >= 0 && epoll_ctl(p->epfd, EPOLL_CTL_ADD, p->wake_fd, &ev) == 0) {
    pipes_make(p);
    what = "threads";
    err = pthread_create(&p->thread, NULL, pool_thread, p);
    if (err == 0) {
      p->started = 1;
      __atomic_store_n(&g_engine.started, i + 1, __ATOMIC_RELEASE);
      return 0;
    }
  } else {
    err = errno;
  }
  struct rlimit rl = {0};
  getrlimit(what[0] == 't' ? RLIMIT_NPROC : RLIMIT_NOFILE, &rl);
  MP_WARN("socket: cannot start I/O thread %d of %d: out of %s (%s; limit %ld); the streams go to the %d "
          "started; MPLANE_SOCKET_THREADS lowers the pool", i + 1, g_engine.size, what, strerror(err),
          (long)rl.rlim_cur, i);
  if (p->wake_fd >= 0) close(p->wake_fd);
  if (p->epfd >= 0) close(p->epfd);
  for (int k = 0; k < p->npipes; k++) {
    close(p->pipes[k].fd[0]);
    close(p->pipes[k].fd[1]);
  }
  return -1;
}

/* Under g_engine.lock: the pool's size, fixed at the first stream. */
static void pool_size_init(void) {
  if (g_engine.size) return;
  const struct mplane_config *cfg = mps_config();
  int ncpus = mps_usable_cpus();
  const struct mps_dev *d = mps_dev_get(0);
  int streams = mps_streams_for(cfg, d ? d->props.speed_mbps : 0, ncpus);
  g_engine.size = mps_pool_size_for(cfg, streams, ncpus);
  MP_INFO(NCCL_INIT | NCCL_NET, "socket: one pool of %d I/O threads moves every connection's data streams (%s; "
          "%d data streams per connection, %d CPUs usable)", g_engine.size,
          cfg->socket_threads ? "MPLANE_SOCKET_THREADS" : "automatic", streams, ncpus);
}

/* The thread for the next stream: round robin over the pool, starting threads as they are reached. */
static struct mps_pool *pool_pick(void) {
  pthread_mutex_lock(&g_engine.lock);
  pool_size_init();
  struct mps_pool *p = NULL;
  for (int tries = 0; tries < 2 && !p; tries++) {
    int i = (int)(g_engine.next++ % (unsigned)g_engine.size);
    if (i < g_engine.started) p = &g_engine.pools[i];
    else if (i == g_engine.started && pool_start(i) == 0) p = &g_engine.pools[i];
    else if (g_engine.started > 0) {
      g_engine.size = g_engine.started; /* no more threads: the pool stays as it is (WARNed once) */
      p = &g_engine.pools[i % g_engine.started];
    }
  }
  pthread_mutex_unlock(&g_engine.lock);
  return p;
}

static int attach_to(struct mps_stream *st, struct mps_pool *p) {
  if (!p) return -1;
  st->pool = p;
  if (!st->armed) st->armed = EPOLLIN; /* a stream still connecting asks for EPOLLOUT */
  struct epoll_event ev = {.events = st->armed, .data.ptr = st};
  if (epoll_ctl(p->epfd, EPOLL_CTL_ADD, st->fd, &ev) != 0) {
    MP_WARN("socket: cannot add a data stream to I/O thread %d's epoll: %m", p->index);
    st->pool = NULL;
    return -1;
  }
  return 0;
}

int mps_engine_attach(struct mps_stream *st) { return attach_to(st, pool_pick()); }

/* Thread 0, started if need be: where the stream listener and the hellos it accepts live. */
int mps_engine_attach_first(struct mps_stream *st) {
  pthread_mutex_lock(&g_engine.lock);
  pool_size_init();
  struct mps_pool *p = g_engine.started > 0 || pool_start(0) == 0 ? &g_engine.pools[0] : NULL;
  pthread_mutex_unlock(&g_engine.lock);
  return attach_to(st, p);
}

void mps_engine_forget(struct mps_stream *st) {
  epoll_ctl(st->pool->epfd, EPOLL_CTL_DEL, st->fd, NULL);
  st->pool = NULL;
}

void mps_engine_detach(struct mps_stream *st) {
  struct mps_pool *p = st->pool;
  if (!p) return;
  pthread_mutex_lock(&p->lock);
  if (st->listed) { /* off the ready list first */
    struct mps_stream **pp = &p->ready, *prev = NULL;
    while (*pp && *pp != st) {
      prev = *pp;
      pp = &(*pp)->next;
    }
    if (*pp) *pp = st->next;
    if (p->ready_tail == st) p->ready_tail = prev;
    st->listed = 0;
  }
  st->next = p->detach;
  p->detach = st;
  if (p->sleeping) wake(p);
  while (!st->detached) pthread_cond_wait(&p->detached, &p->lock);
  pthread_mutex_unlock(&p->lock);
  st->pool = NULL;
}

int mps_ring_grow(void **ring, size_t elsize, unsigned *cap, unsigned *head, unsigned *tail) {
  unsigned ncap = *cap ? *cap * 2 : 16;
  char *grown = malloc(elsize * ncap), *old = *ring;
  if (!grown) return -1;
  for (unsigned i = 0; i < *cap; i++) memcpy(grown + i * elsize, old + ((*head + i) & (*cap - 1)) * elsize, elsize);
  free(old);
  *ring = grown;
  *tail -= *head;
  *head = 0;
  *cap = ncap;
  return 0;
}

int mps_engine_push(struct mps_stream *st, const struct mps_task *t) {
  struct mps_pool *p = st->pool;
  pthread_mutex_lock(&p->lock);
  /* grow when full: the thread reads the ring under this lock only */
  if (st->tail - st->head == st->cap &&
      mps_ring_grow((void **)&st->tasks, sizeof(*st->tasks), &st->cap, &st->head, &st->tail) != 0) {
    pthread_mutex_unlock(&p->lock);
    MP_WARN("socket: out of memory queueing a chunk (%u chunks queued on one stream, %zu bytes more)", st->cap,
            sizeof(*st->tasks) * (st->cap ? st->cap * 2 : 16));
    return -1;
  }
  st->tasks[st->tail++ & (st->cap - 1)] = *t;
  if (!st->listed) {
    st->listed = 1;
    st->next = NULL;
    if (p->ready_tail) p->ready_tail->next = st;
    else p->ready = st;
    p->ready_tail = st;
  }
  if (p->sleeping) {
    p->sleeping = 0; /* one wake-up is enough */
    wake(p);
  }
  pthread_mutex_unlock(&p->lock);
  return 0;
}

int mps_engine_take(struct mps_stream *st, struct mps_task *t) {
  struct mps_pool *p = st->pool;
  pthread_mutex_lock(&p->lock);
  int any = st->head != st->tail;
  if (any) *t = st->tasks[st->head++ & (st->cap - 1)];
  pthread_mutex_unlock(&p->lock);
  return any;
}

