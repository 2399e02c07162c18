/* mplane: NCCL's aggregation hint (RMA ABI v15 and v16, ncclRmaOptFlagsAggregateRequests), turned
 * into holds of the transport (net/transport.h, mplane_rma_ops.hold).
 *
 * What NCCL 2.31/2.32's GIN proxy does with the flag: in one pass over a context's queues it takes up
 * to a batch of descriptors per rank and posts each; it sets the flag on an op when the same
 * (context, rank) queue already holds the next descriptor and the batch is not full, so the op that
 * follows at once goes to the same connection. A run of flagged ops ends with an op without the flag
 * or with an iflush to that rank; after the pass NCCL calls rmaProgress. NCCL keeps testing every
 * request it was given (a counter of the GPU's counts each completion), so each op still gets its own
 * request: nothing may report done before its bytes are where the op says.
 *
 * Here a run is a hold on the transport: begun before the first flagged op of (context, rank), ended
 * after the op that closes it, before an iflush or rmaProgress, and before the context set goes. A
 * transport without holds gets nothing (every op goes out as posted, which the hint allows too).
 *
 * One caller drives a context set at a time (NCCL's GIN progress thread), so no lock. */
#ifndef MPLANE_PLUGIN_RMA_HINT_H
#define MPLANE_PLUGIN_RMA_HINT_H

#include <stdint.h>

#include "../net/transport.h"

struct mplane_rma_hint {
  uint8_t *held; /* [ncontexts * nranks]: 1 while a hold of that (context, rank) is open; NULL: no holds */
  int ncontexts, nranks;
  int nheld; /* holds open now: progress has nothing to end when 0 */
};

/* Holds only where the transport has them; 0, or ncclSystemError when out of memory. */
ncclResult_t mplane_rma_hint_init(struct mplane_rma_hint *h, const struct mplane_rma_ops *o, int ncontexts,
                                  int nranks);
void mplane_rma_hint_free(struct mplane_rma_hint *h);

/* Around posting an op to (context, rank): aggregate is the op's hint; res what the post returned
 * (a failed post ends the hold: nothing more is coming from a caller that saw the error). */
void mplane_rma_hint_before(struct mplane_rma_hint *h, const struct mplane_rma_ops *o, void *ctx, int context,
                            uint32_t rank, int aggregate);
void mplane_rma_hint_after(struct mplane_rma_hint *h, const struct mplane_rma_ops *o, void *ctx, int context,
                           uint32_t rank, int aggregate, ncclResult_t res);

/* End the hold of one (context, rank) (before an iflush to it), or all of them (before progress or
 * destroy_context). */
void mplane_rma_hint_end(struct mplane_rma_hint *h, const struct mplane_rma_ops *o, void *ctx, int context,
                         uint32_t rank);
void mplane_rma_hint_end_all(struct mplane_rma_hint *h, const struct mplane_rma_ops *o, void *ctx);

#endif
