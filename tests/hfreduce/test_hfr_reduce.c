/* HFReduce's reduce kernels: every SIMD version this CPU runs against the scalar code, bit for bit,
 * for every dtype and op, 1 to 8 sources, lengths around the 16-lane blocks, in place; and the
 * scalar conversions on values worked out by hand (rounding to nearest even, FP8 saturation). */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "hfr_reduce.h"
#include "hfr_tree.h"

static uint32_t rng = 12345;
static uint32_t next_rand(void) {
  rng = rng * 1664525u + 1013904223u;
  return rng >> 8;
}

/* Random bits of the type, NaNs included for the float types (NaNs compare by being NaN). */
static void random_fill(int dtype, void *buf, size_t n) {
  size_t es = mp_hfr_dtype_size(dtype);
  for (size_t i = 0; i < n; i++) {
    uint32_t r = next_rand();
    if (dtype == MPLANE_HFREDUCE_FLOAT32) {
      float f = ldexpf((float)(int)(r % 20001) - 10000.0f, (int)(next_rand() % 40) - 20);
      memcpy((char *)buf + i * 4, &f, 4);
    } else {
      memcpy((char *)buf + i * es, &r, es);
    }
  }
}

static int same_element(int dtype, const void *a, const void *b, size_t i) {
  float x = mp_hfr_load_f32(dtype, a, i), y = mp_hfr_load_f32(dtype, b, i);
  if (isnan(x) || isnan(y)) return isnan(x) && isnan(y);
  size_t es = mp_hfr_dtype_size(dtype);
  return memcmp((const char *)a + i * es, (const char *)b + i * es, es) == 0;
}

static void simd_matches_scalar(void **state) {
  (void)state;
  const size_t lens[] = {1, 15, 16, 17, 31, 64, 100, 1027};
  int checked = 0;
  for (int isa = 1; isa < MP_HFR_NISA; isa++) {
    if (!mp_hfr_isa_supported(isa)) continue;
    for (int dtype = 0; dtype < MPLANE_HFREDUCE_NDTYPES; dtype++)
      for (int op = 0; op < MPLANE_HFREDUCE_NOPS; op++)
        for (int nsrc = 1; nsrc <= 8; nsrc++)
          for (size_t li = 0; li < sizeof(lens) / sizeof(lens[0]); li++) {
            size_t n = lens[li], bytes = n * mp_hfr_dtype_size(dtype);
            void *src[8], *want = malloc(bytes), *got = malloc(bytes);
            for (int k = 0; k < nsrc; k++) {
              src[k] = malloc(bytes);
              random_fill(dtype, src[k], n);
            }
            mp_hfr_reduce_isa(MP_HFR_ISA_SCALAR, dtype, op, want, (const void *const *)src, nsrc, n);
            mp_hfr_reduce_isa(isa, dtype, op, got, (const void *const *)src, nsrc, n);
            for (size_t i = 0; i < n; i++)
              if (!same_element(dtype, want, got, i))
                fail_msg("%s %s %s, %d sources, n %zu: element %zu differs from the scalar code", mp_hfr_isa_name(isa),
                         mp_hfr_dtype_name(dtype), mp_hfr_op_name(op), nsrc, n, i);
            /* in place: dst is the first source, as the tree's fold does */
            mp_hfr_reduce_isa(isa, dtype, op, src[0], (const void *const *)src, nsrc, n);
            for (size_t i = 0; i < n; i++)
              if (!same_element(dtype, want, src[0], i))
                fail_msg("%s %s %s in place, %d sources, n %zu: element %zu differs", mp_hfr_isa_name(isa),
                         mp_hfr_dtype_name(dtype), mp_hfr_op_name(op), nsrc, n, i);
            for (int k = 0; k < nsrc; k++) free(src[k]);
            free(want);
            free(got);
            checked++;
          }
  }
  if (!mp_hfr_isa_supported(MP_HFR_ISA_AVX2)) skip(); /* nothing to compare on this CPU */
  assert_true(checked > 0);
}

/* FP8 byte for byte, NaN codes included (simd_matches_scalar lets any NaN match any): every pair of
 * codes, then every pair after a third source of each code that rounds, saturates or makes a NaN
 * (infinities of both signs, the largest values, NaN codes, zeros, the least subnormal), for every
 * op, on every ISA; as many elements as pairs, so the blocks and their tails see every code. */
static void fp8_every_code_exact(void **state) {
  (void)state;
  const size_t n = 65536 + 7; /* and a tail */
  const uint8_t thirds[] = {0x00, 0x80, 0x01, 0x81, 0x7b, 0xfb, 0x7c, 0xfc, 0x7d, 0xfd, 0x7e, 0xfe, 0x7f, 0xff};
  uint8_t *a = malloc(n), *b = malloc(n), *c = malloc(n), *want = malloc(n), *got = malloc(n);
  assert_non_null(a && b && c && want && got);
  for (size_t i = 0; i < n; i++) a[i] = (uint8_t)i, b[i] = (uint8_t)(i >> 8);
  int checked = 0;
  for (int isa = 1; isa < MP_HFR_NISA; isa++) {
    if (!mp_hfr_isa_supported(isa)) continue;
    for (int dtype = MPLANE_HFREDUCE_FP8_E4M3; dtype <= MPLANE_HFREDUCE_FP8_E5M2; dtype++)
      for (int op = 0; op < MPLANE_HFREDUCE_NOPS; op++)
        for (int t = -1; t < (int)sizeof(thirds); t++) {
          if (t >= 0) memset(c, thirds[t], n);
          const void *src[3] = {t >= 0 ? c : a, t >= 0 ? a : b, b};
          int nsrc = t >= 0 ? 3 : 2;
          for (int k = 1; k <= nsrc; k++) { /* the first k sources: one source is the codes alone */
            mp_hfr_reduce_isa(MP_HFR_ISA_SCALAR, dtype, op, want, src, k, n);
            mp_hfr_reduce_isa(isa, dtype, op, got, src, k, n);
            for (size_t i = 0; i < n; i++)
              if (want[i] != got[i])
                fail_msg("%s %s %s, %d sources (third 0x%02x), element %zu: 0x%02x, the scalar code 0x%02x",
                         mp_hfr_isa_name(isa), mp_hfr_dtype_name(dtype), mp_hfr_op_name(op), k,
                         t >= 0 ? thirds[t] : 0, i, got[i], want[i]);
            checked++;
          }
        }
  }
  free(a), free(b), free(c), free(want), free(got);
  if (!mp_hfr_isa_supported(MP_HFR_ISA_AVX2)) skip();
  assert_true(checked > 0);
}

static void conversions(void **state) {
  (void)state;
  /* bf16: 1 + 2^-8 is a tie between 1 and 1 + 2^-7: even is 1.0 (0x3f80); 1 + 3*2^-8 rounds up */
  assert_int_equal(mp_hfr_f32_to_bf16(1.0f + 0x1p-8f), 0x3f80);
  assert_int_equal(mp_hfr_f32_to_bf16(1.0f + 3 * 0x1p-8f), 0x3f82);
  assert_true(isnan(mp_hfr_bf16_to_f32(mp_hfr_f32_to_bf16(NAN))));
  /* fp16: 65504 is the largest; 65520 rounds to infinity; 2^-24 the smallest subnormal */
  assert_int_equal(mp_hfr_f32_to_f16(65504.0f), 0x7bff);
  assert_int_equal(mp_hfr_f32_to_f16(65520.0f), 0x7c00);
  assert_int_equal(mp_hfr_f32_to_f16(0x1p-24f), 0x0001);
  assert_int_equal(mp_hfr_f32_to_f16(-2.0f), 0xc000);
  assert_true(mp_hfr_f16_to_f32(0x3555) > 0.333f && mp_hfr_f16_to_f32(0x3555) < 0.334f);
  /* e4m3: 448 the largest (0x7e), beyond it saturates; 2^-9 the smallest subnormal; 0x7f NaN */
  assert_int_equal(mp_hfr_f32_to_fp8(MPLANE_HFREDUCE_FP8_E4M3, 448.0f), 0x7e);
  assert_int_equal(mp_hfr_f32_to_fp8(MPLANE_HFREDUCE_FP8_E4M3, 1e6f), 0x7e);
  assert_int_equal(mp_hfr_f32_to_fp8(MPLANE_HFREDUCE_FP8_E4M3, -1e6f), 0xfe);
  assert_int_equal(mp_hfr_f32_to_fp8(MPLANE_HFREDUCE_FP8_E4M3, 0x1p-9f), 0x01);
  assert_int_equal(mp_hfr_f32_to_fp8(MPLANE_HFREDUCE_FP8_E4M3, 1.0f), 0x38);
  assert_int_equal(mp_hfr_f32_to_fp8(MPLANE_HFREDUCE_FP8_E4M3, 1.0625f), 0x38); /* tie: to even */
  assert_int_equal(mp_hfr_f32_to_fp8(MPLANE_HFREDUCE_FP8_E4M3, 1.1875f), 0x3a); /* tie: to even (up) */
  assert_true(isnan(mp_hfr_fp8_to_f32(MPLANE_HFREDUCE_FP8_E4M3, 0x7f)));
  /* e5m2: 57344 the largest, beyond it infinity */
  assert_int_equal(mp_hfr_f32_to_fp8(MPLANE_HFREDUCE_FP8_E5M2, 57344.0f), 0x7b);
  assert_int_equal(mp_hfr_f32_to_fp8(MPLANE_HFREDUCE_FP8_E5M2, 1e6f), 0x7c);
  assert_int_equal(mp_hfr_f32_to_fp8(MPLANE_HFREDUCE_FP8_E5M2, 1.0f), 0x3c);
  /* every code decodes and encodes back to itself (NaNs aside) */
  for (int d = MPLANE_HFREDUCE_FP8_E4M3; d <= MPLANE_HFREDUCE_FP8_E5M2; d++)
    for (int v = 0; v < 256; v++) {
      float f = mp_hfr_fp8_to_f32(d, (uint8_t)v);
      if (!isnan(f)) assert_int_equal(mp_hfr_f32_to_fp8(d, f), v);
    }
  for (uint32_t v = 0; v < 0x10000; v++) {
    float f = mp_hfr_f16_to_f32((uint16_t)v);
    if (!isnan(f)) assert_int_equal(mp_hfr_f32_to_f16(f), v);
  }
}

/* Tree: every node but the root has one parent, which lists it as a child; the interior nodes of
 * the two trees are disjoint for an even count (each node forwards in one tree at most). */
static void double_tree(void **state) {
  (void)state;
  for (int n = 1; n <= 33; n++) {
    int interior[2][64] = {{0}};
    for (int t = 0; t < 2; t++) {
      int roots = 0;
      for (int v = 0; v < n; v++) {
        struct mp_hfr_tree_pos p;
        mp_hfr_tree_pos(t, n, v, &p);
        if (p.parent < 0) roots++;
        else {
          struct mp_hfr_tree_pos pp;
          mp_hfr_tree_pos(t, n, p.parent, &pp);
          assert_true(pp.child[0] == v || pp.child[1] == v);
        }
        interior[t][v] = p.nchildren > 0;
      }
      assert_int_equal(roots, 1);
    }
    if (n % 2 == 0)
      for (int v = 0; v < n; v++) assert_false(interior[0][v] && interior[1][v]);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(conversions),
      cmocka_unit_test(simd_matches_scalar),
      cmocka_unit_test(fp8_every_code_exact),
      cmocka_unit_test(double_tree),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
