/* HFReduce's double binary tree between nodes (the pure rule; docs/hfreduce.md).
 *
 * Tree 0 is the heap over node indices (parent (p-1)/2, children 2p+1, 2p+2); tree 1 the same heap
 * over the mirrored indices (n-1-p). The interior nodes of tree 0 are the first half of the nodes
 * and those of tree 1 the second half, so each node forwards (receives two, sends one, then the
 * reverse) in one tree at most where n is even, and the two halves of a slice load the links alike. */
#ifndef MPLANE_HFR_TREE_H
#define MPLANE_HFR_TREE_H

struct mp_hfr_tree_pos {
  int parent;      /* node index, -1 for the root */
  int child[2];    /* node indices, -1 where absent */
  int nchildren;
};

/* Where node `node` of n sits in tree `tree` (0 or 1). */
void mp_hfr_tree_pos(int tree, int n, int node, struct mp_hfr_tree_pos *pos);

#endif
