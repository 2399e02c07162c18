/* libmplane-ep CPU references (see ep_ref.h). */
#include "ep_ref.h"

#include <math.h>
#include <stdlib.h>

uint64_t mp_ep_rand_next(uint64_t *state) {
  uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

double mp_ep_rand_unit(uint64_t *state) { return (double)(mp_ep_rand_next(state) >> 11) * (1.0 / 9007199254740992.0); }

void mp_ep_route_ref(const float *logits, const float *bias, int T, int E, int K, int num_groups, int topk_groups,
                     float scaling, int normalize, int32_t *idx, float *w) {
  int gs = E / num_groups;
  float *s = malloc(sizeof(float) * (size_t)E), *b = malloc(sizeof(float) * (size_t)E),
        *gscore = malloc(sizeof(float) * (size_t)num_groups);
  char *keep = malloc((size_t)num_groups), *used = malloc((size_t)E);
  if (!s || !b || !gscore || !keep || !used) goto out;
  for (int t = 0; t < T; t++) {
    const float *lg = logits + (long)t * E;
    for (int e = 0; e < E; e++) {
      s[e] = 1.0f / (1.0f + expf(-lg[e]));
      b[e] = bias ? s[e] + bias[e] : s[e];
      used[e] = 0;
    }
    for (int g = 0; g < num_groups; g++) {
      float m1 = -INFINITY, m2 = -INFINITY;
      for (int i = 0; i < gs; i++) {
        float v = b[g * gs + i];
        if (v > m1) {
          m2 = m1;
          m1 = v;
        } else if (v > m2) {
          m2 = v;
        }
      }
      gscore[g] = gs >= 2 ? m1 + m2 : m1;
      keep[g] = 0;
    }
    for (int r = 0; r < topk_groups && r < num_groups; r++) {
      int best = -1;
      for (int g = 0; g < num_groups; g++)
        if (!keep[g] && (best < 0 || gscore[g] > gscore[best])) best = g;
      keep[best] = 1;
    }
    float sum = 0.f;
    for (int k = 0; k < K; k++) {
      int best = -1;
      for (int e = 0; e < E; e++)
        if (keep[e / gs] && !used[e] && (best < 0 || b[e] > b[best])) best = e;
      if (best < 0) {
        idx[(long)t * K + k] = -1;
        w[(long)t * K + k] = 0.f;
        continue;
      }
      used[best] = 1;
      idx[(long)t * K + k] = best;
      w[(long)t * K + k] = s[best];
      sum += s[best];
    }
    for (int k = 0; k < K; k++) {
      float v = w[(long)t * K + k];
      if (normalize) v = v / sum;
      w[(long)t * K + k] = v * scaling;
    }
  }
out:
  free(s);
  free(b);
  free(gscore);
  free(keep);
  free(used);
}
