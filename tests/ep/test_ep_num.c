/* libmplane-ep number formats (collectives/ep/ep_num.h): FP8 e4m3 and BF16 conversions, tile
 * scales. These are the CPU twins of the GPU conversions; the GPU test compares them on device. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <math.h>
#include <string.h>

#include <cmocka.h>

#include "ep_num.h"
#include "ep_ref.h"

/* e4m3 reference values from the format's definition (bias 7, 3 mantissa bits). */
static double e4m3_def(unsigned code) {
  unsigned s = code >> 7, e = (code >> 3) & 15, m = code & 7;
  double v = e ? ldexp(1.0 + m / 8.0, (int)e - 7) : ldexp(m / 8.0, -6);
  return s ? -v : v;
}

static void test_e4m3_decode_all(void **state) {
  (void)state;
  for (unsigned c = 0; c < 256; c++) {
    float f = mp_e4m3_to_f32((uint8_t)c);
    if ((c & 0x7f) == 0x7f) {
      assert_true(isnan(f));
      continue;
    }
    assert_true((double)f == e4m3_def(c));
  }
  assert_true(mp_e4m3_to_f32(0x7e) == 448.0f);
  assert_true(mp_e4m3_to_f32(0x01) == 0.001953125f); /* 2^-9 */
  assert_true(mp_e4m3_to_f32(0x08) == 0.015625f);    /* 2^-6 */
}

static void test_e4m3_roundtrip(void **state) {
  (void)state;
  for (unsigned c = 0; c < 256; c++) {
    if ((c & 0x7f) == 0x7f) continue;
    float f = mp_e4m3_to_f32((uint8_t)c);
    uint8_t back = mp_f32_to_e4m3(f);
    assert_int_equal(back, c);
  }
}

/* Brute force: the nearest representable value, ties to the even code. */
static uint8_t e4m3_nearest(float x) {
  double best_d = INFINITY;
  int best = -1;
  double ax = fabs((double)x);
  if (ax >= 448.0) return (uint8_t)((x < 0 ? 0x80 : 0) | 0x7e);
  for (unsigned c = 0; c < 0x7f; c++) {
    double d = fabs(e4m3_def(c) - ax);
    if (d < best_d || (d == best_d && (c & 1) == 0)) {
      best_d = d;
      best = (int)c;
    }
  }
  return (uint8_t)((signbit(x) ? 0x80 : 0) | best);
}

static void test_e4m3_rounding(void **state) {
  (void)state;
  uint64_t rs = 12345;
  for (int i = 0; i < 200000; i++) {
    /* magnitudes across the whole range, subnormals and saturation included */
    double mag = ldexp(mp_ep_rand_unit(&rs) * 2.0, (int)(mp_ep_rand_next(&rs) % 24) - 14);
    float x = (float)((mp_ep_rand_next(&rs) & 1) ? -mag : mag);
    uint8_t got = mp_f32_to_e4m3(x), want = e4m3_nearest(x);
    if (got != want) fail_msg("x=%.9g: got 0x%02x want 0x%02x", (double)x, got, want);
  }
  /* exact ties: halfway between two codes rounds to the even mantissa */
  for (unsigned c = 0x08; c < 0x7d; c++) {
    float mid = (float)((e4m3_def(c) + e4m3_def(c + 1)) / 2.0);
    uint8_t got = mp_f32_to_e4m3(mid);
    assert_int_equal(got, (c & 1) ? c + 1 : c);
  }
  /* subnormal ties */
  assert_int_equal(mp_f32_to_e4m3(ldexp(1.0, -10)), 0x00);      /* 0.5 ulp -> 0 (even) */
  assert_int_equal(mp_f32_to_e4m3(3 * ldexp(1.0, -10)), 0x02);  /* 1.5 ulp -> 2 */
  assert_int_equal(mp_f32_to_e4m3(1e-30f), 0x00);
  assert_int_equal(mp_f32_to_e4m3(-1e-30f), 0x80);
  assert_int_equal(mp_f32_to_e4m3(1e30f), 0x7e);
  assert_int_equal(mp_f32_to_e4m3(-INFINITY), 0xfe);
  assert_int_equal(mp_f32_to_e4m3(460.0f), 0x7e); /* saturates instead of rounding past 448 */
  assert_int_equal(mp_f32_to_e4m3(NAN) & 0x7f, 0x7f);
}

static void test_bf16(void **state) {
  (void)state;
  assert_int_equal(mp_f32_to_bf16(1.0f), 0x3f80);
  assert_true(mp_bf16_to_f32(0x3f80) == 1.0f);
  /* 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even -> 1 */
  assert_int_equal(mp_f32_to_bf16(1.0f + 0.00390625f), 0x3f80);
  /* 1 + 3 * 2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6 -> 1 + 2^-6 */
  assert_int_equal(mp_f32_to_bf16(1.0f + 3 * 0.00390625f), 0x3f82);
  assert_int_equal(mp_f32_to_bf16(1.0f + 0.0041f), 0x3f81); /* above the tie */
  assert_int_equal(mp_f32_to_bf16(-2.0f), 0xc000);
  assert_int_equal(mp_f32_to_bf16(INFINITY), 0x7f80);
  assert_true(isnan(mp_bf16_to_f32(mp_f32_to_bf16(NAN))));
  uint64_t rs = 7;
  for (int i = 0; i < 100000; i++) {
    float x = (float)((mp_ep_rand_unit(&rs) - 0.5) * ldexp(1.0, (int)(mp_ep_rand_next(&rs) % 60) - 30));
    float y = mp_bf16_to_f32(mp_f32_to_bf16(x));
    assert_true(fabs((double)y - x) <= fabs((double)x) * ldexp(1.0, -8));
  }
}

static void test_tile_scale(void **state) {
  (void)state;
  float s = mp_ep_tile_scale(448.0f);
  assert_true(s == 1.0f);
  assert_true(mp_ep_tile_inv(448.0f) == 1.0f);
  assert_int_equal(mp_ep_quant(448.0f, mp_ep_tile_inv(448.0f)), 0x7e);
  s = mp_ep_tile_scale(0.0f); /* a tile of zeros: floor, zeros stay zero */
  assert_true(s == 1e-4f / 448.0f);
  assert_true(mp_ep_tile_inv(0.0f) == 448.0f / 1e-4f);
  assert_int_equal(mp_ep_quant(0.0f, mp_ep_tile_inv(0.0f)), 0);
  /* the largest element of a tile maps to 448 (or saturates to it) */
  uint64_t rs = 99;
  for (int i = 0; i < 10000; i++) {
    float amax = (float)(mp_ep_rand_unit(&rs) * 100.0 + 1e-3);
    float sc = mp_ep_tile_scale(amax), inv = mp_ep_tile_inv(amax);
    assert_int_equal(mp_ep_quant(amax, inv), 0x7e);
    assert_int_equal(mp_ep_quant(-amax, inv), 0xfe);
    /* the inverse is the scale's reciprocal to within float rounding */
    assert_true(fabs((double)sc * inv - 1.0) <= 3 * ldexp(1.0, -24));
    float back = mp_bf16_to_f32(mp_ep_dequant_bf16(0x7e, sc));
    assert_true(fabs((double)back - amax) <= amax * 0.01);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_e4m3_decode_all), cmocka_unit_test(test_e4m3_roundtrip),
      cmocka_unit_test(test_e4m3_rounding),   cmocka_unit_test(test_bf16),
      cmocka_unit_test(test_tile_scale),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
