/* mplane: the connect states a transport has in flight.
 *
 * NCCL calls connect again and again with the same handle buffer until a comm comes back; both
 * transports keep a pointer to their connect state in that buffer, past the handle's own bytes.
 * A buffer that was never ours (another build's handle, garbage) may hold anything there, so a
 * pointer read back from it is trusted only if this set holds it. No cap: NCCL sets up peers x
 * channels x GPUs connections at once and has no limit of its own. */
#ifndef MPLANE_NET_STAGE_SET_H
#define MPLANE_NET_STAGE_SET_H

#include <pthread.h>
#include <stddef.h>

struct mplane_stage_set {
  pthread_mutex_t lock;
  void **slots; /* open addressing; NULL empty, MPLANE_STAGE_GONE a removed entry */
  size_t cap, used, live;
};

#define MPLANE_STAGE_SET_INIT {PTHREAD_MUTEX_INITIALIZER, NULL, 0, 0, 0}

/* 0 on success, -1 when out of memory. */
int mplane_stage_add(struct mplane_stage_set *s, void *stage);
void mplane_stage_remove(struct mplane_stage_set *s, void *stage);
/* 1 if stage (any pointer value, NULL included) is one this set holds. */
int mplane_stage_live(struct mplane_stage_set *s, const void *stage);

#endif
