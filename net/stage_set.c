/* mplane: the connect states in flight, a hash set of pointers (see stage_set.h). */
#include "stage_set.h"

#include <stdint.h>
#include <stdlib.h>

static char gone_marker;
#define MPLANE_STAGE_GONE ((void *)&gone_marker)

static size_t slot_of(const void *p, size_t cap) {
  uint64_t x = (uint64_t)(uintptr_t)p;
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  return (size_t)x & (cap - 1);
}

/* Index of p, or of the slot where it would go (the first removed one on its path, else the empty
 * one that ends it). Needs cap > used. */
static size_t find(const struct mplane_stage_set *s, const void *p, int *found) {
  size_t i = slot_of(p, s->cap), spare = (size_t)-1;
  for (;; i = (i + 1) & (s->cap - 1)) {
    void *q = s->slots[i];
    if (q == p) {
      *found = 1;
      return i;
    }
    if (q == MPLANE_STAGE_GONE && spare == (size_t)-1) spare = i;
    if (q == NULL) {
      *found = 0;
      return spare != (size_t)-1 ? spare : i;
    }
  }
}

/* Rehash into a table where live entries fill at most a quarter: removed markers go. */
static int grow(struct mplane_stage_set *s) {
  size_t cap = 64;
  while (cap < 4 * (s->live + 1)) cap *= 2;
  void **old = s->slots;
  size_t old_cap = s->cap;
  s->slots = calloc(cap, sizeof(void *));
  if (!s->slots) {
    s->slots = old;
    return -1;
  }
  s->cap = cap;
  s->used = s->live;
  for (size_t i = 0; i < old_cap; i++) {
    if (old[i] == NULL || old[i] == MPLANE_STAGE_GONE) continue;
    int found;
    s->slots[find(s, old[i], &found)] = old[i];
  }
  free(old);
  return 0;
}

int mplane_stage_add(struct mplane_stage_set *s, void *stage) {
  int rc = 0;
  pthread_mutex_lock(&s->lock);
  if (2 * (s->used + 1) > s->cap && grow(s) != 0) {
    rc = -1;
  } else {
    int found;
    size_t i = find(s, stage, &found);
    if (!found) {
      if (s->slots[i] == NULL) s->used++;
      s->slots[i] = stage;
      s->live++;
    }
  }
  pthread_mutex_unlock(&s->lock);
  return rc;
}

void mplane_stage_remove(struct mplane_stage_set *s, void *stage) {
  pthread_mutex_lock(&s->lock);
  int found = 0;
  size_t i = s->cap ? find(s, stage, &found) : 0;
  if (found) {
    s->slots[i] = MPLANE_STAGE_GONE;
    s->live--;
  }
  pthread_mutex_unlock(&s->lock);
}

int mplane_stage_live(struct mplane_stage_set *s, const void *stage) {
  if (stage == NULL || stage == MPLANE_STAGE_GONE) return 0;
  pthread_mutex_lock(&s->lock);
  int found = 0;
  if (s->cap) find(s, stage, &found);
  pthread_mutex_unlock(&s->lock);
  return found;
}
