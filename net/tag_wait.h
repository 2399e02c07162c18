/* mplane: a send that the oldest posted receive cannot take yet (shared comms).
 *
 * With maxRecvs > 1 NCCL puts several local ranks, one tag each, on one comm: the receiver posts
 * groups of all their tags, the senders progress on their own. A send for tag t whose oldest open
 * group has no untaken entry for t belongs to a later group; both transports then return a NULL
 * request and NCCL calls again, as NCCL's own net_ib does. Matching only the oldest group keeps
 * every message in the group it was meant for (the k-th send of a tag fills the k-th group).
 *
 * Such a wait is legitimate for as long as one local rank is late (a checkpoint on one GPU, say),
 * so it is never an error; but a tag no group ever offers would wait for ever, so the wait is
 * named in one WARN after MPLANE_CONNECT_TIMEOUT seconds. */
#ifndef MPLANE_NET_TAG_WAIT_H
#define MPLANE_NET_TAG_WAIT_H

#include <stdint.h>

#define MPLANE_TAG_WAIT_TAGS 8 /* tags timed at once; NCCL puts at most maxRecvs (8) on a comm */

struct mplane_tag_wait {
  int nwaiting; /* entries in use: 0 on the fast path */
  int warned;
  struct {
    int tag;
    uint64_t since_ns; /* first unmatched try since this tag last matched; 0 = entry free */
  } e[MPLANE_TAG_WAIT_TAGS];
};

void mplane_tag_wait_clear(struct mplane_tag_wait *w, int tag);

/* A send of `tag` matched: its next wait starts afresh. */
static inline void mplane_tag_wait_matched(struct mplane_tag_wait *w, int tag) {
  if (w->nwaiting) mplane_tag_wait_clear(w, tag);
}

/* A send of `tag` found no untaken entry in the oldest open group. Returns 1, once per comm, when
 * that tag has waited MPLANE_CONNECT_TIMEOUT seconds: the caller then calls mplane_tag_wait_warn. */
int mplane_tag_wait_unmatched(struct mplane_tag_wait *w, int tag);

/* The WARN: `who` names the transport and peer, open[0..nopen) the tags group `seq` still waits for. */
void mplane_tag_wait_warn(const char *who, int tag, unsigned long long seq, const int *open, int nopen);

#endif
