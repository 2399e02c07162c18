/* libmplane-ep: the number formats on the wire, shared by the CUDA kernels, the CPU planner
 * simulation and the CPU reference model (plain C; compiled by nvcc as __host__ __device__).
 *
 * - BF16: round to nearest even (what __float2bfloat16_rn does).
 * - FP8 e4m3 (OCP / __nv_fp8_e4m3): bias 7, max 448, no infinity, NaN = S.1111.111. Encoding
 *   saturates to +-448 (cvt .satfinite) and rounds to nearest even, subnormals included.
 * - One float32 scale per 1x128 tile: scale = max(amax, 1e-4) / 448, q = e4m3(x / scale),
 *   dequantised value = float(q) * scale. Division and multiplication are the IEEE round-to-nearest
 *   operations on both sides (__fdiv_rn / __fmul_rn on the GPU), so CPU and GPU agree bit for bit.
 * - Sums that must match bit for bit use fmaf / plain float adds with no contraction (the C files
 *   are built with -ffp-contract=off, the kernels use the _rn intrinsics). */
#ifndef MPLANE_EP_NUM_H
#define MPLANE_EP_NUM_H

#include <stdint.h>
#include <math.h>

#if defined(__CUDACC__)
#define MP_HD __host__ __device__ static inline
#else
#define MP_HD static inline
#endif

#if defined(__CUDA_ARCH__)
#define MP_DIV(a, b) __fdiv_rn((a), (b))
#define MP_MUL(a, b) __fmul_rn((a), (b))
#define MP_ADD(a, b) __fadd_rn((a), (b))
#define MP_FMA(a, b, c) __fmaf_rn((a), (b), (c))
#else
#define MP_DIV(a, b) ((a) / (b))
#define MP_MUL(a, b) ((a) * (b))
#define MP_ADD(a, b) ((a) + (b))
#define MP_FMA(a, b, c) fmaf((a), (b), (c))
#endif

#define MP_EP_TILE 128           /* elements per FP8 scale */
#define MP_EP_FP8_MAX 448.0f     /* largest finite e4m3 */
#define MP_EP_AMAX_FLOOR 1e-4f   /* a tile of zeros still gets a finite, nonzero scale */

MP_HD uint32_t mp_f32_bits(float f) {
  union { float f; uint32_t u; } c;
  c.f = f;
  return c.u;
}

MP_HD float mp_bits_f32(uint32_t u) {
  union { float f; uint32_t u; } c;
  c.u = u;
  return c.f;
}

MP_HD float mp_bf16_to_f32(uint16_t b) { return mp_bits_f32((uint32_t)b << 16); }

MP_HD uint16_t mp_f32_to_bf16(float f) {
  uint32_t u = mp_f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

MP_HD float mp_e4m3_to_f32(uint8_t q) {
  uint32_t e = (q >> 3) & 0xFu, m = q & 7u;
  float v;
  if (e == 0xFu && m == 7u)
    v = mp_bits_f32(0x7fc00000u);
  else if (e == 0)
    v = (float)m * 0.001953125f; /* m * 2^-9, exact */
  else
    v = mp_bits_f32(((e + 120u) << 23) | (m << 20)); /* (1 + m/8) * 2^(e-7) */
  return (q & 0x80u) ? -v : v;
}

/* x >> s rounded to nearest, ties to even (s >= 1). */
MP_HD uint32_t mp_rne_shift(uint32_t x, int s) {
  if (s >= 32) return 0;
  uint32_t q = x >> s, rem = x & ((1u << s) - 1u), half = 1u << (s - 1);
  if (rem > half || (rem == half && (q & 1u))) q++;
  return q;
}

/* float -> e4m3, round to nearest even, saturating to +-448 (NaN stays NaN). */
MP_HD uint8_t mp_f32_to_e4m3(float f) {
  uint32_t u = mp_f32_bits(f);
  uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (uint8_t)(sign | 0x7fu);
  if (a >= 0x43e00000u) return (uint8_t)(sign | 0x7eu); /* >= 448, infinity included */
  int exp = (int)(a >> 23) - 127;
  uint32_t sig = a & 0x7fffffu;
  if (exp == -127)
    exp = -126; /* float subnormal: no implicit bit */
  else
    sig |= 0x800000u;
  if (exp >= -6) {
    uint32_t r = mp_rne_shift(sig, 20); /* 8..16: 1.mmm with 3 mantissa bits */
    int e = exp;
    if (r == 16u) {
      r = 8u;
      e++;
    }
    return (uint8_t)(sign | (uint32_t)((e + 7) << 3) | (r & 7u));
  }
  /* e4m3 subnormal (or rounds up to the smallest normal, code 8): value / 2^-9 */
  uint32_t r = mp_rne_shift(sig, 14 - exp);
  return (uint8_t)(sign | r);
}

MP_HD float mp_ep_tile_scale(float amax) {
  return MP_DIV(fmaxf(amax, MP_EP_AMAX_FLOOR), MP_EP_FP8_MAX);
}

/* The tile's inverse scale, 448 / max(amax, floor): the values are multiplied by it, so a tile costs
 * one division, not one per value (the kernels' quantisation is bound by instruction issue). */
MP_HD float mp_ep_tile_inv(float amax) {
  return MP_DIV(MP_EP_FP8_MAX, fmaxf(amax, MP_EP_AMAX_FLOOR));
}

MP_HD uint8_t mp_ep_quant(float x, float inv) { return mp_f32_to_e4m3(MP_MUL(x, inv)); }

MP_HD uint16_t mp_ep_dequant_bf16(uint8_t q, float scale) {
  return mp_f32_to_bf16(MP_MUL(mp_e4m3_to_f32(q), scale));
}

#endif
