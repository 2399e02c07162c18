/* mplane: the shared-comm send wait (see tag_wait.h). */
#include "tag_wait.h"

#include <stdio.h>

#include "../common/clock.h"
#include "../common/config.h"
#include "../common/log.h"

void mplane_tag_wait_clear(struct mplane_tag_wait *w, int tag) {
  for (int i = 0; i < MPLANE_TAG_WAIT_TAGS; i++)
    if (w->e[i].since_ns && w->e[i].tag == tag) {
      w->e[i].since_ns = 0;
      w->nwaiting--;
      return;
    }
}

/* The entry timing `tag`, a free one started now, or NULL when every entry times another tag. */
static uint64_t *wait_since(struct mplane_tag_wait *w, int tag, uint64_t now) {
  int free_i = -1;
  for (int i = 0; i < MPLANE_TAG_WAIT_TAGS; i++) {
    if (w->e[i].since_ns && w->e[i].tag == tag) return &w->e[i].since_ns;
    if (!w->e[i].since_ns && free_i < 0) free_i = i;
  }
  if (free_i < 0) return NULL;
  w->e[free_i].tag = tag;
  w->e[free_i].since_ns = now;
  w->nwaiting++;
  return &w->e[free_i].since_ns;
}

int mplane_tag_wait_unmatched(struct mplane_tag_wait *w, int tag) {
  if (w->warned) return 0;
  uint64_t now = mplane_now_ns();
  uint64_t *since = wait_since(w, tag, now);
  int limit_s = mplane_config_get()->connect_timeout_s;
  if (!since || now - *since < (uint64_t)limit_s * 1000000000ull) return 0;
  w->warned = 1;
  return 1;
}

void mplane_tag_wait_warn(const char *who, int tag, unsigned long long seq, const int *open, int nopen) {
  char list[160] = "";
  size_t len = 0;
  for (int i = 0; i < nopen && len + 16 < sizeof(list); i++)
    len += (size_t)snprintf(list + len, sizeof(list) - len, "%s%d", len ? "," : "", open[i]);
  MP_WARN("%s: a send with tag %d has waited %d s (MPLANE_CONNECT_TIMEOUT) for receive %llu, which still "
          "waits for tags %s: a local rank of the peer's shared comm is late, or the ranks disagree on tags "
          "(still waiting)", who, tag, mplane_config_get()->connect_timeout_s, seq, list[0] ? list : "(none)");
}
