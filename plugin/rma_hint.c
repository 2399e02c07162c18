/* mplane: NCCL's aggregation hint as transport holds; what and why in rma_hint.h. */
#include "rma_hint.h"

#include <stdlib.h>

ncclResult_t mplane_rma_hint_init(struct mplane_rma_hint *h, const struct mplane_rma_ops *o, int ncontexts,
                                  int nranks) {
  *h = (struct mplane_rma_hint){.ncontexts = ncontexts, .nranks = nranks};
  if (!o || !o->hold || ncontexts < 1 || nranks < 1) return ncclSuccess;
  h->held = calloc((size_t)ncontexts * (size_t)nranks, 1);
  return h->held ? ncclSuccess : ncclSystemError;
}

void mplane_rma_hint_free(struct mplane_rma_hint *h) {
  free(h->held);
  h->held = NULL;
  h->nheld = 0;
}

/* The slot of (context, rank), NULL where there are no holds or the op names no connection (the
 * transport refuses such an op itself, and there is nothing to hold). */
static uint8_t *slot(struct mplane_rma_hint *h, int context, uint32_t rank) {
  if (!h->held || context < 0 || context >= h->ncontexts || rank >= (uint32_t)h->nranks) return NULL;
  return &h->held[(size_t)context * (size_t)h->nranks + rank];
}

static void end_slot(struct mplane_rma_hint *h, const struct mplane_rma_ops *o, void *ctx, int context,
                     uint32_t rank, uint8_t *s) {
  if (!*s) return;
  *s = 0;
  h->nheld--;
  o->hold(ctx, context, rank, 0);
}

void mplane_rma_hint_before(struct mplane_rma_hint *h, const struct mplane_rma_ops *o, void *ctx, int context,
                            uint32_t rank, int aggregate) {
  uint8_t *s = slot(h, context, rank);
  if (!s || !aggregate || *s) return;
  *s = 1;
  h->nheld++;
  o->hold(ctx, context, rank, 1);
}

/* The op that closes a run (no hint) is posted inside the hold, so it goes out with the run. */
void mplane_rma_hint_after(struct mplane_rma_hint *h, const struct mplane_rma_ops *o, void *ctx, int context,
                           uint32_t rank, int aggregate, ncclResult_t res) {
  uint8_t *s = slot(h, context, rank);
  if (s && (!aggregate || res != ncclSuccess)) end_slot(h, o, ctx, context, rank, s);
}

void mplane_rma_hint_end(struct mplane_rma_hint *h, const struct mplane_rma_ops *o, void *ctx, int context,
                         uint32_t rank) {
  uint8_t *s = slot(h, context, rank);
  if (s) end_slot(h, o, ctx, context, rank, s);
}

void mplane_rma_hint_end_all(struct mplane_rma_hint *h, const struct mplane_rma_ops *o, void *ctx) {
  for (int c = 0; h->nheld > 0 && c < h->ncontexts; c++)
    for (int r = 0; h->nheld > 0 && r < h->nranks; r++) end_slot(h, o, ctx, c, (uint32_t)r, slot(h, c, (uint32_t)r));
}
