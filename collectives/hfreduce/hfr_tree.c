/* The double binary tree (hfr_tree.h). */
#include "hfr_tree.h"

static int to_node(int tree, int n, int p) { return tree == 0 ? p : n - 1 - p; }

void mp_hfr_tree_pos(int tree, int n, int node, struct mp_hfr_tree_pos *pos) {
  int p = to_node(tree, n, node); /* the mirror is its own inverse */
  pos->parent = p == 0 ? -1 : to_node(tree, n, (p - 1) / 2);
  pos->nchildren = 0;
  pos->child[0] = pos->child[1] = -1;
  for (int k = 1; k <= 2; k++)
    if (2 * p + k < n) pos->child[pos->nchildren++] = to_node(tree, n, 2 * p + k);
}
