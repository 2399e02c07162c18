/* mplane topo tests: shared helpers. */
#ifndef MPLANE_TOPO_TEST_UTIL_H
#define MPLANE_TOPO_TEST_UTIL_H

#include <stddef.h>

/* A node of an NCCL topology XML, read with NCCL's own rules: no declaration or comments, double
 * quoted values, one space between attributes, at most 16 attributes, names and values under 255
 * characters. */
#define XT_MAX_ATTRS 16
struct xt_node {
  char name[256];
  int nattrs;
  char key[XT_MAX_ATTRS][256];
  char value[XT_MAX_ATTRS][256];
  struct xt_node *parent;
  struct xt_node *kids[640];
  int nkids;
};

/* Parse text; NULL with why on a violation. */
struct xt_node *xt_parse(const char *text, char *why, size_t whylen);
void xt_free(struct xt_node *n);
const char *xt_attr(const struct xt_node *n, const char *key);
/* First node (depth first) named name whose attribute key equals value (key NULL: any). */
struct xt_node *xt_find(struct xt_node *root, const char *name, const char *key, const char *value);
int xt_count(struct xt_node *root, const char *name);

/* 0 when text is one valid JSON value (and nothing else), else -1 with where in why. */
int json_check(const char *text, char *why, size_t whylen);

/* Whole file into a malloc'ed string; NULL when it cannot be read. */
char *slurp(const char *path);
/* Path of a fixture: $TOPO_FIXTURES/name. */
const char *fixture(const char *name);
/* The line of text holding every one of the (up to 3, NULL-ended) substrings, copied into line. */
int line_with(const char *text, const char *a, const char *b, const char *c, char *line, size_t len);
/* Split a line on blanks into at most max tokens; returns how many. */
int tokens(const char *line, char tok[][64], int max);
/* A fresh /tmp/<prefix>.XXXXXX folder in dir (size len) for a test's files; 0 on success. */
int tmpdir_make(char *dir, size_t len, const char *prefix);
/* Remove that folder and everything in it; 0 on success. */
int tmpdir_remove(const char *dir);

/* A fake sysfs under root, for the sysfs fallback. sysfs_mkfile writes root/rel (making its
 * folders); sysfs_mkpci makes a PCI function at sys/devices/<devpath> (class, vendor, device,
 * numa_node) and its sys/bus/pci/devices link. Either aborts the test when the file cannot be made. */
void sysfs_mkfile(const char *root, const char *rel, const char *text);
void sysfs_mkpci(const char *root, const char *devpath, const char *cls, const char *vendor, const char *numa);

#endif
