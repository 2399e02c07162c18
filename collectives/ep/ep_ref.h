/* libmplane-ep CPU references that are not the all-to-all itself: DeepSeek-V3 group-limited
 * gating (the route kernel's twin), and random routings for tests. */
#ifndef MPLANE_EP_REF_H
#define MPLANE_EP_REF_H

#include <stdint.h>

/* Group-limited gating for T tokens of E logits:
 *   s = sigmoid(logit); b = s + bias (bias may be NULL);
 *   group score = sum of the two largest b of the group (the one b when a group has one expert);
 *   keep the topk_groups best groups (ties: lower group index), then the top-k experts of those
 *   by b (ties: lower expert index), in descending b;
 *   weight_k = s_k (unbiased), divided by their sum when normalize, times scaling.
 * E must be a multiple of num_groups. */
void mp_ep_route_ref(const float *logits, const float *bias, int T, int E, int K, int num_groups, int topk_groups,
                     float scaling, int normalize, int32_t *idx, float *w);

/* Deterministic generator for tests (splitmix64). */
uint64_t mp_ep_rand_next(uint64_t *state);
double mp_ep_rand_unit(uint64_t *state); /* [0, 1) */

#endif
