/* Unit tests of the IB transport's pure functions: the NCCL_IB_HCA grammar, the RoCE GID choice, and
 * how a receive entry counts the chunks a peer sends. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>
#include <arpa/inet.h>

#include "net/ib/ib.h"
#include "net/tc.h"

static void test_hca_grammar(void **state) {
  (void)state;
  assert_true(mpib_hca_match("", "mlx5_0", 1));
  assert_true(mpib_hca_match("mlx5", "mlx5_0", 1));         /* prefix */
  assert_true(mpib_hca_match("mlx5_1", "mlx5_10", 1));      /* prefix, as NCCL */
  assert_false(mpib_hca_match("=mlx5_1", "mlx5_10", 1));    /* exact */
  assert_true(mpib_hca_match("=mlx5_1", "mlx5_1", 1));
  assert_false(mpib_hca_match("^mlx5_0", "mlx5_0", 1));     /* exclude */
  assert_true(mpib_hca_match("^mlx5_0", "mlx5_1", 1));
  assert_true(mpib_hca_match("mlx5_0:1,mlx5_1:2", "mlx5_1", 2));
  assert_false(mpib_hca_match("mlx5_0:1,mlx5_1:2", "mlx5_1", 1));
  assert_false(mpib_hca_match("^mlx5_0:1", "mlx5_0", 1));
  assert_true(mpib_hca_match("^mlx5_0:1", "mlx5_0", 2));
  assert_false(mpib_hca_match("^=mlx5_0", "mlx5_0", 1));
  assert_true(mpib_hca_match("^=mlx5_0", "mlx5_00", 1));
  assert_false(mpib_hca_match("ib", "mlx5_0", 1));
}

/* Side-channel addresses: IPv4 before IPv6, link-local IPv6 never, the family variable obeyed. */
static void test_oob_family(void **state) {
  (void)state;
  struct sockaddr_in v4 = {.sin_family = AF_INET};
  struct sockaddr_in6 v6 = {.sin6_family = AF_INET6}, ll = {.sin6_family = AF_INET6};
  inet_pton(AF_INET6, "2001:db8::1", &v6.sin6_addr);
  inet_pton(AF_INET6, "fe80::1", &ll.sin6_addr);
  assert_int_equal(mpib_oob_family_rank((struct sockaddr *)&v4, MPLANE_IB_FAMILY_ANY), 0);
  assert_int_equal(mpib_oob_family_rank((struct sockaddr *)&v6, MPLANE_IB_FAMILY_ANY), 1);
  assert_int_equal(mpib_oob_family_rank((struct sockaddr *)&ll, MPLANE_IB_FAMILY_ANY), -1);
  assert_int_equal(mpib_oob_family_rank((struct sockaddr *)&ll, MPLANE_IB_FAMILY_INET6), -1);
  assert_int_equal(mpib_oob_family_rank((struct sockaddr *)&v4, MPLANE_IB_FAMILY_INET6), -1);
  assert_int_equal(mpib_oob_family_rank((struct sockaddr *)&v6, MPLANE_IB_FAMILY_INET6), 1);
  assert_int_equal(mpib_oob_family_rank((struct sockaddr *)&v6, MPLANE_IB_FAMILY_INET), -1);
}

/* Port rates from IB's speed bits and widths: active_speed_ex wins when set (XDR does not fit
 * active_speed, which then reads 0). */
static void test_port_speed(void **state) {
  (void)state;
  assert_int_equal(mpib_port_speed_mbps(64, 0, 2), 200000);       /* HDR 4x, rdma-core < 48 */
  assert_int_equal(mpib_port_speed_mbps(64, 64, 2), 200000);      /* HDR 4x */
  assert_int_equal(mpib_port_speed_mbps(128, 128, 2), 400000);    /* NDR 4x */
  assert_int_equal(mpib_port_speed_mbps(128, 0, 16), 200000);     /* NDR 2x */
  assert_int_equal(mpib_port_speed_mbps(0, 256, 2), 800000);      /* XDR 4x */
  assert_int_equal(mpib_port_speed_mbps(0, 256, 1), 200000);      /* XDR 1x */
  assert_int_equal(mpib_port_speed_mbps(0, 0, 2), 800000);        /* 0 without speed_ex: beyond 8 bits */
  assert_int_equal(mpib_port_speed_mbps(32, 0, 8), 300000);       /* EDR 12x */
  assert_int_equal(mpib_port_speed_mbps(1, 0, 1), 2500);          /* SDR 1x */
  assert_int_equal(mpib_port_speed_mbps(0, 512, 2), 800000);      /* beyond the table: at least XDR */
}

/* A well-behaved sender's chunks complete an entry; a bad one's are refused, whatever its order. */
static void test_recv_entry_chunks(void **state) {
  (void)state;
  struct mpib_recv_comm c;
  memset(&c, 0, sizeof(c));
  struct mpib_recv_entry en = {.cap = 100};
  /* two chunks, the second first */
  assert_null(mpib_recv_entry_accept(&c, &en, 40, mpib_imm(0, 0, 2, 1, 0, 0)));
  assert_int_equal(en.chunks, 1);
  assert_null(mpib_recv_entry_accept(&c, &en, 60, mpib_imm(0, 0, 2, 0, 0, 0)));
  assert_int_equal(en.chunks, en.nchunks);
  assert_int_equal(en.bytes, 100);
  assert_non_null(mpib_recv_entry_accept(&c, &en, 1, mpib_imm(0, 0, 2, 1, 0, 0))); /* a third: already complete */
  /* a count that changes: chunk 0 of 2, then "chunk 0 of 1" would complete it with half the bytes */
  memset(&en, 0, sizeof(en));
  en.cap = 100;
  assert_null(mpib_recv_entry_accept(&c, &en, 50, mpib_imm(0, 0, 2, 0, 0, 0)));
  assert_non_null(mpib_recv_entry_accept(&c, &en, 50, mpib_imm(0, 0, 1, 0, 0, 0)));
  /* the same chunk twice would count as the second */
  assert_non_null(mpib_recv_entry_accept(&c, &en, 50, mpib_imm(0, 0, 2, 0, 0, 0)));
  assert_int_equal(en.chunks, 1);
  /* bytes past the buffer are refused on the chunk that brings them, not only on the last */
  memset(&en, 0, sizeof(en));
  en.cap = 100;
  assert_non_null(mpib_recv_entry_accept(&c, &en, 101, mpib_imm(0, 0, 3, 0, 0, 0)));
  assert_null(mpib_recv_entry_accept(&c, &en, 100, mpib_imm(0, 0, 3, 0, 0, 0)));
  assert_non_null(mpib_recv_entry_accept(&c, &en, 1, mpib_imm(0, 0, 3, 1, 0, 0)));
  /* an index past the count; a 'does not fit' notice after data; data after the notice */
  memset(&en, 0, sizeof(en));
  en.cap = 100;
  assert_non_null(mpib_recv_entry_accept(&c, &en, 1, mpib_imm(0, 0, 2, 2, 0, 0)));
  assert_null(mpib_recv_entry_accept(&c, &en, 1, mpib_imm(0, 0, 2, 0, 0, 0)));
  assert_non_null(mpib_recv_entry_accept(&c, &en, 0, mpib_imm(0, 0, 1, 0, MPIB_IMM_TRUNC, 0)));
  memset(&en, 0, sizeof(en));
  en.cap = 100;
  assert_null(mpib_recv_entry_accept(&c, &en, 0, mpib_imm(0, 0, 1, 0, MPIB_IMM_TRUNC, 0)));
  assert_int_equal(en.trunc, 1);
  assert_non_null(mpib_recv_entry_accept(&c, &en, 10, mpib_imm(0, 0, 1, 0, 0, 0)));
  /* an empty message is one empty chunk */
  memset(&en, 0, sizeof(en));
  assert_null(mpib_recv_entry_accept(&c, &en, 0, mpib_imm(0, 0, 1, 0, 0, 0)));
  assert_int_equal(en.chunks, en.nchunks);
}

/* GPU memory is advertised as NCCL's net_ib does: CUDA for nvidia-peermem, DMABUF for dma-bufs. */
static void test_ptr_support(void **state) {
  (void)state;
  assert_int_equal(mpib_ptr_support(0, 1, 1), NCCL_PTR_HOST); /* no NVIDIA driver */
  assert_int_equal(mpib_ptr_support(1, 0, 0), NCCL_PTR_HOST);
  assert_int_equal(mpib_ptr_support(1, 1, 0), NCCL_PTR_HOST | NCCL_PTR_CUDA);
  assert_int_equal(mpib_ptr_support(1, 0, 1), NCCL_PTR_HOST | NCCL_PTR_DMABUF); /* not CUDA: plain regMr would fail */
  assert_int_equal(mpib_ptr_support(1, 1, 1), NCCL_PTR_HOST | NCCL_PTR_CUDA | NCCL_PTR_DMABUF);
}

/* The side channel's interface when nothing names one: IPoIB first, never docker or loopback. */
static void test_oob_rank(void **state) {
  (void)state;
  assert_int_equal(mpib_oob_rank("ib0", 0), 0);
  assert_int_equal(mpib_oob_rank("ibp12s0", 0), 0);
  assert_int_equal(mpib_oob_rank("eth0", 0), 1);
  assert_int_equal(mpib_oob_rank("enp1s0f0", 0), 1);
  assert_int_equal(mpib_oob_rank("docker0", 0), -1);
  assert_int_equal(mpib_oob_rank("lo", 1), -1);
  assert_true(mpib_oob_rank("ib0", 0) < mpib_oob_rank("eth0", 0));
}

static void gid_v4(union ibv_gid *g, int a) {
  memset(g, 0, sizeof(*g));
  g->raw[10] = g->raw[11] = 0xff;
  g->raw[12] = 198; g->raw[13] = 18; g->raw[14] = 0; g->raw[15] = (unsigned char)a;
}
static void gid_ll(union ibv_gid *g) {
  memset(g, 0, sizeof(*g));
  g->raw[0] = 0xfe; g->raw[1] = 0x80; g->raw[15] = 1;
}

static void test_gid_choice(void **state) {
  (void)state;
  union ibv_gid g[5];
  int types[5], valid[5] = {1, 1, 1, 1, 1};
  gid_ll(&g[0]); types[0] = 0; /* v1 link-local */
  gid_ll(&g[1]); types[1] = 1; /* v2 link-local */
  gid_v4(&g[2], 1); types[2] = 0; /* v1 IPv4 */
  gid_v4(&g[3], 1); types[3] = 1; /* v2 IPv4 */
  memset(&g[4], 0, sizeof(g[4])); types[4] = 1; /* empty */
  assert_int_equal(mpib_pick_gid(5, g, types, valid), 3);
  valid[3] = 0;
  assert_int_equal(mpib_pick_gid(5, g, types, valid), 1); /* v2 beats v1 */
  types[1] = 0;
  assert_int_equal(mpib_pick_gid(5, g, types, valid), 0); /* only v1: the first */
  memset(valid, 0, sizeof(valid));
  assert_int_equal(mpib_pick_gid(5, g, types, valid), -1);
}

/* A site's GID wishes: version, family (IPv4-mapped is AF_INET), range of either family. */
static void test_gid_want(void **state) {
  (void)state;
  union ibv_gid g[4];
  int types[4] = {1, 0, 1, 1}, valid[4] = {1, 1, 1, 1};
  gid_v4(&g[0], 1);
  gid_v4(&g[1], 2);
  gid_v4(&g[2], 2);
  memset(&g[3], 0, sizeof(g[3]));
  inet_pton(AF_INET6, "2001:db8::5", g[3].raw);
  gid_v4(&g[0], 1);
  g[0].raw[12] = 198, g[0].raw[13] = 18, g[0].raw[14] = 0, g[0].raw[15] = 1;
  g[1].raw[12] = 198, g[1].raw[13] = 19, g[1].raw[14] = 5, g[1].raw[15] = 1;
  g[2].raw[12] = 198, g[2].raw[13] = 19, g[2].raw[14] = 5, g[2].raw[15] = 1;
  struct mpib_gid_want w = {0};
  char why[128];
  assert_int_equal(mpib_pick_gid_want(4, g, types, valid, &w), 0);
  assert_int_equal(mplane_cidr_parse("198.19.0.0/16", &w.range, why, sizeof(why)), 0);
  w.has_range = 1;
  assert_int_equal(mpib_pick_gid_want(4, g, types, valid, &w), 2); /* in range, v2 first */
  w.version = 1;
  assert_int_equal(mpib_pick_gid_want(4, g, types, valid, &w), 1);
  w = (struct mpib_gid_want){.family = MPLANE_IB_FAMILY_INET6};
  assert_int_equal(mpib_pick_gid_want(4, g, types, valid, &w), 3);
  assert_int_equal(mplane_cidr_parse("2001:db8::/32", &w.range, why, sizeof(why)), 0);
  w = (struct mpib_gid_want){.has_range = 1, .range = w.range};
  assert_int_equal(mpib_pick_gid_want(4, g, types, valid, &w), 3);
  assert_int_equal(mplane_cidr_parse("10.0.0.0/8", &w.range, why, sizeof(why)), 0);
  assert_int_equal(mpib_pick_gid_want(4, g, types, valid, &w), -1);
  assert_int_equal(mplane_cidr_parse("198.19.0.0", &w.range, why, sizeof(why)), -1);
  assert_int_equal(mplane_cidr_parse("198.19.0.0/33", &w.range, why, sizeof(why)), -1);
  assert_int_equal(mplane_cidr_parse("fd00::/129", &w.range, why, sizeof(why)), -1);
  assert_int_equal(mplane_cidr_parse("0.0.0.0/0", &w.range, why, sizeof(why)), 0);
}

static void test_imm_layout(void **state) {
  (void)state;
  uint32_t imm = mpib_imm(31, 7, 16, 15, MPIB_IMM_AR, 0x12345);
  assert_int_equal(MPIB_IMM_SLOT(imm), 31);
  assert_int_equal(MPIB_IMM_ENTRY(imm), 7);
  assert_int_equal(MPIB_IMM_NCHUNKS(imm), 16);
  assert_int_equal(MPIB_IMM_CHUNK(imm), 15);
  assert_true(imm & MPIB_IMM_AR);
  assert_false(imm & MPIB_IMM_TRUNC);
  assert_int_equal(MPIB_IMM_SEQ(imm), 0x345);
}

/* A FIFO slot is taken only when every element shows its sequence, whatever order they land in. */
static void test_fifo_take(void **state) {
  (void)state;
  assert_int_equal(sizeof(struct mpib_fifo_elem), 64);
  assert_int_equal(offsetof(struct mpib_fifo_wire, e[1]), 64);
  static struct mpib_fifo_wire w;
  struct mpib_fifo_slot out;
  memset(&w, 0, sizeof(w));
  assert_int_equal(mpib_fifo_take(&w, 0, &out), 0); /* never written */
  for (int i = 0; i < 3; i++)
    w.e[i] = (struct mpib_fifo_elem){.addr = 0x1000u * (unsigned)(i + 1), .size = 100u + (unsigned)i, .rkey = 7,
                                      .tag = 10 + i, .nreqs = 3, .rec_rkey = 9, .rec_addr = 0x5000};
  /* elements 0 and 2 landed, 1 not yet: not taken */
  w.e[0].seq = w.e[2].seq = 5;
  assert_int_equal(mpib_fifo_take(&w, 4, &out), 0);
  w.e[1].seq = 5;
  assert_int_equal(mpib_fifo_take(&w, 4, &out), 1);
  assert_int_equal(out.n, 3);
  assert_int_equal(out.e[1].addr, 0x2000);
  assert_int_equal(out.e[2].tag, 12);
  assert_int_equal(out.rec_addr, 0x5000);
  /* the previous use of the slot (seq 4 - 32 + 1) is not this one */
  assert_int_equal(mpib_fifo_take(&w, 36, &out), 0);
  /* counts that disagree, or none, are the peer's error */
  w.e[2].nreqs = 2;
  assert_int_equal(mpib_fifo_take(&w, 4, &out), -1);
  w.e[0].nreqs = 0;
  assert_int_equal(mpib_fifo_take(&w, 4, &out), -1);
  w.e[0].nreqs = MPIB_MAX_RECVS + 1;
  assert_int_equal(mpib_fifo_take(&w, 4, &out), -1);
}

/* maxComms counts QPs per connection (it was 65536 whatever a connection used) and the CQ per comm. */
static void test_max_comms(void **state) {
  (void)state;
  assert_int_equal(mpib_max_comms(65536, 65536, 1, 2), 21845); /* 2 QPs + the flush QP */
  assert_int_equal(mpib_max_comms(65536, 65536, 1, 4), 13107);
  assert_int_equal(mpib_max_comms(65536, 65536, 2, 2), 10922);  /* two ports share the HCA's QPs */
  assert_int_equal(mpib_max_comms(262144, 16384, 1, 2), 16384); /* a CQ per comm: max_cq bounds it */
  assert_int_equal(mpib_max_comms(2, 1, 1, 16), 1);              /* never 0 */
  assert_int_equal(mpib_max_comms(65536, 65536, 0, 0), 32768);   /* nonsense counts taken as 1 */
}

/* A site's RoCE traffic classes, as NCCL reads them: NCCL_GIN_IB_TC for the one-sided QPs, else
 * NCCL_IB_TC; without an MPLANE_TC_MAP of the user's they win over the class's DSCP (main sets them). */
static void test_site_tclass(void **state) {
  (void)state;
  assert_int_equal(mplane_tc_hints_choose_class(), 0);
  assert_int_equal(mplane_tc_roce_tclass(3, 1), 98);  /* NCCL_GIN_IB_TC */
  assert_int_equal(mplane_tc_roce_tclass(3, 0), 106); /* NCCL_IB_TC */
  assert_int_equal(mplane_tc_roce_tclass(5, 0), 106);
}

/* NCCL_IB_DEVICE_PCI_ORDER's order: by the bus id of the path's last component, unknown last. */
static void test_pci_order(void **state) {
  (void)state;
  const char *a = "/sys/devices/pci0000:00/0000:00:01.0/0000:1a:00.0";
  const char *b = "/sys/devices/pci0000:80/0000:80:01.0/0000:0c:00.1";
  const char *c = "/sys/devices/pci0000:00/0000:00:01.0/0000:1a:00.1";
  assert_true(mpib_pci_order_cmp(b, a) < 0); /* 0c before 1a, whatever the root */
  assert_true(mpib_pci_order_cmp(a, c) < 0); /* functions of one device in order */
  assert_true(mpib_pci_order_cmp(a, a) == 0);
  assert_true(mpib_pci_order_cmp("", a) > 0);
  assert_true(mpib_pci_order_cmp(a, "") < 0);
  assert_true(mpib_pci_order_cmp("", "") == 0);
}

int main(void) {
  unsetenv("MPLANE_TC_MAP");
  unsetenv("MPLANE_IB_TC");
  unsetenv("MPLANE_GIN_IB_TC");
  setenv("NCCL_IB_TC", "106", 1);
  setenv("NCCL_GIN_IB_TC", "98", 1);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_site_tclass),
      cmocka_unit_test(test_hca_grammar),
      cmocka_unit_test(test_gid_choice),
      cmocka_unit_test(test_imm_layout),
      cmocka_unit_test(test_recv_entry_chunks),
      cmocka_unit_test(test_ptr_support),
      cmocka_unit_test(test_max_comms),
      cmocka_unit_test(test_fifo_take),
      cmocka_unit_test(test_oob_rank),
      cmocka_unit_test(test_port_speed),
      cmocka_unit_test(test_oob_family),
      cmocka_unit_test(test_gid_want),
      cmocka_unit_test(test_pci_order),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
