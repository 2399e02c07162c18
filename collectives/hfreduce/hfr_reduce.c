/* HFReduce's CPU reduction kernels (hfr_reduce.h).
 *
 * The SIMD versions are one body, written with gcc's vector extensions (16 floats at a time), compiled
 * once per target (AVX2 + F16C, AVX-512) with target attributes and picked at run time by
 * __builtin_cpu_supports. The tail of a block goes through the scalar code, whose arithmetic is the
 * same expression element by element, so every version gives the same bits.
 * Build with -ffp-contract=off: a fused multiply-add would change the bits of nothing here, but a
 * contracted sum in one version and not another would. */
#include "hfr_reduce.h"

#include <math.h>
#include <string.h>
#include <immintrin.h>

size_t mp_hfr_dtype_size(int dtype) {
  static const size_t size[MPLANE_HFREDUCE_NDTYPES] = {4, 2, 2, 1, 1};
  return dtype >= 0 && dtype < MPLANE_HFREDUCE_NDTYPES ? size[dtype] : 0;
}

const char *mp_hfr_dtype_name(int dtype) {
  static const char *const name[MPLANE_HFREDUCE_NDTYPES] = {"float32", "float16", "bfloat16", "fp8_e4m3",
                                                             "fp8_e5m2"};
  return dtype >= 0 && dtype < MPLANE_HFREDUCE_NDTYPES ? name[dtype] : "?";
}

const char *mp_hfr_op_name(int op) {
  static const char *const name[MPLANE_HFREDUCE_NOPS] = {"sum", "max", "min"};
  return op >= 0 && op < MPLANE_HFREDUCE_NOPS ? name[op] : "?";
}

const char *mp_hfr_isa_name(int isa) {
  static const char *const name[MP_HFR_NISA] = {"scalar", "avx2", "avx512"};
  return isa >= 0 && isa < MP_HFR_NISA ? name[isa] : "?";
}

int mp_hfr_isa_supported(int isa) {
  __builtin_cpu_init();
  switch (isa) {
    case MP_HFR_ISA_SCALAR: return 1;
    case MP_HFR_ISA_AVX2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
    case MP_HFR_ISA_AVX512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("f16c");
  }
  return 0;
}

int mp_hfr_isa_best(void) {
  for (int isa = MP_HFR_NISA - 1; isa > 0; isa--)
    if (mp_hfr_isa_supported(isa)) return isa;
  return MP_HFR_ISA_SCALAR;
}

/* ---- scalar conversions ---- */

static uint32_t f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
static float bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

float mp_hfr_bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

/* Round to nearest even on the upper 16 bits; a NaN stays a (quiet) NaN. The SIMD twin is
 * BF16_FROM_F32 below: the same operations on 16 lanes. */
uint16_t mp_hfr_f32_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

float mp_hfr_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
  if (e == 0x1f) return bits_f32(sign | 0x7f800000u | (m << 13)); /* inf, NaN */
  if (e == 0) return sign ? -ldexpf((float)m, -24) : ldexpf((float)m, -24);
  return bits_f32(sign | ((e + 112) << 23) | (m << 13));
}

/* IEEE binary16, round to nearest even (what F16C's vcvtps2ph does with _MM_FROUND_TO_NEAREST_INT). */
uint16_t mp_hfr_f32_to_f16(float f) {
  uint32_t u = f32_bits(f), sign = (u >> 16) & 0x8000, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00 | ((a >> 13) & 0x3ff));
  if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00); /* rounds to 65536 or more: inf */
  if (a < 0x38800000u) {                                 /* below 2^-14: subnormal (or zero) */
    float q = nearbyintf(bits_f32(a) * 16777216.0f);     /* in units of 2^-24, exact product */
    return (uint16_t)(sign | (uint32_t)q);               /* 1024 is the smallest normal: same bits */
  }
  uint32_t r = a + 0xfffu + ((a >> 13) & 1u);            /* round the 13 dropped bits to even */
  return (uint16_t)(sign | ((r - 0x38000000u) >> 13));
}

/* FP8: e4m3 (bias 7, 3 mantissa bits, no infinity, 0x7f NaN, max 448, overflow saturates) and
 * e5m2 (bias 15, 2 mantissa bits, IEEE-like: overflow gives infinity). */
static float fp8_decode(int e4m3, uint8_t v) {
  int mbits = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15, emax = e4m3 ? 15 : 31;
  float sign = (v & 0x80) ? -1.0f : 1.0f;
  int e = (v & 0x7f) >> mbits, m = v & ((1 << mbits) - 1);
  if (e4m3 && (v & 0x7f) == 0x7f) return NAN;
  if (!e4m3 && e == emax) return m ? NAN : sign * INFINITY;
  if (e == 0) return sign * ldexpf((float)m, 1 - bias - mbits);
  return sign * ldexpf((float)((1 << mbits) | m), e - bias - mbits);
}

/* Round to nearest even by integer arithmetic, as mp_hfr_f32_to_f16 does: the magic-number add
 * rounds a subnormal's count (below 2^22) in the FPU's default mode, nearest even. */
static inline float rne_small(float x) { return (x + 12582912.0f) - 12582912.0f; }

static inline uint8_t fp8_encode(int e4m3, float f) {
  uint32_t u = f32_bits(f), a = u & 0x7fffffffu;
  uint8_t sign = (uint8_t)((u >> 24) & 0x80);
  if (e4m3) {
    if (a > 0x7f800000u) return sign | 0x7f;
    if (a > 0x43e00000u) return sign | 0x7e;                           /* past 448: saturate */
    if (a < 0x3c800000u) return sign | (uint8_t)rne_small(bits_f32(a) * 512.0f); /* below 2^-6 */
    uint32_t r = a + 0x7ffffu + ((a >> 20) & 1u);
    return sign | (uint8_t)((r - (120u << 23)) >> 20);
  }
  if (a > 0x7f800000u) return sign | 0x7e;
  if (a >= 0x47700000u) return sign | 0x7c;                            /* rounds past 57344: infinity */
  if (a < 0x38800000u) return sign | (uint8_t)rne_small(bits_f32(a) * 65536.0f); /* below 2^-14 */
  uint32_t r = a + 0xfffffu + ((a >> 21) & 1u);
  return sign | (uint8_t)((r - (112u << 23)) >> 21);
}

static float fp8_table[2][256];
static void fp8_tables_init(void) {
  for (int v = 0; v < 256; v++) {
    fp8_table[0][v] = fp8_decode(1, (uint8_t)v);
    fp8_table[1][v] = fp8_decode(0, (uint8_t)v);
  }
}
static __attribute__((constructor)) void hfr_reduce_init(void) { fp8_tables_init(); }

float mp_hfr_fp8_to_f32(int dtype, uint8_t v) { return fp8_table[dtype == MPLANE_HFREDUCE_FP8_E4M3 ? 0 : 1][v]; }
uint8_t mp_hfr_f32_to_fp8(int dtype, float f) { return fp8_encode(dtype == MPLANE_HFREDUCE_FP8_E4M3, f); }

float mp_hfr_load_f32(int dtype, const void *p, size_t i) {
  switch (dtype) {
    case MPLANE_HFREDUCE_FLOAT32: return ((const float *)p)[i];
    case MPLANE_HFREDUCE_FLOAT16: return mp_hfr_f16_to_f32(((const uint16_t *)p)[i]);
    case MPLANE_HFREDUCE_BFLOAT16: return mp_hfr_bf16_to_f32(((const uint16_t *)p)[i]);
    default: return mp_hfr_fp8_to_f32(dtype, ((const uint8_t *)p)[i]);
  }
}

void mp_hfr_store_f32(int dtype, void *p, size_t i, float v) {
  switch (dtype) {
    case MPLANE_HFREDUCE_FLOAT32: ((float *)p)[i] = v; break;
    case MPLANE_HFREDUCE_FLOAT16: ((uint16_t *)p)[i] = mp_hfr_f32_to_f16(v); break;
    case MPLANE_HFREDUCE_BFLOAT16: ((uint16_t *)p)[i] = mp_hfr_f32_to_bf16(v); break;
    default: ((uint8_t *)p)[i] = mp_hfr_f32_to_fp8(dtype, v); break;
  }
}

/* The one arithmetic rule, scalar; OP_V is its twin on vectors (a > b is false for a NaN: the same
 * operand is kept in both). */
static inline float op_f32(int op, float a, float b) {
  if (op == MPLANE_HFREDUCE_SUM) return a + b;
  if (op == MPLANE_HFREDUCE_MAX) return a > b ? a : b;
  return a < b ? a : b;
}

/* Elements [from, n) the scalar way; sized types by a fast path, FP8 through its table. */
static void reduce_scalar_range(int dtype, int op, void *dst, const void *const *src, int nsrc, size_t from,
                                size_t n) {
  if (dtype == MPLANE_HFREDUCE_FLOAT32) {
    float *d = dst;
    for (size_t i = from; i < n; i++) {
      float acc = ((const float *)src[0])[i];
      for (int k = 1; k < nsrc; k++) acc = op_f32(op, acc, ((const float *)src[k])[i]);
      d[i] = acc;
    }
    return;
  }
  if (dtype == MPLANE_HFREDUCE_FP8_E4M3 || dtype == MPLANE_HFREDUCE_FP8_E5M2) {
    const float *table = fp8_table[dtype == MPLANE_HFREDUCE_FP8_E4M3 ? 0 : 1];
    int e4m3 = dtype == MPLANE_HFREDUCE_FP8_E4M3;
    uint8_t *d = dst;
    for (size_t i = from; i < n; i++) {
      float acc = table[((const uint8_t *)src[0])[i]];
      for (int k = 1; k < nsrc; k++) acc = op_f32(op, acc, table[((const uint8_t *)src[k])[i]]);
      d[i] = fp8_encode(e4m3, acc);
    }
    return;
  }
  for (size_t i = from; i < n; i++) {
    float acc = mp_hfr_load_f32(dtype, src[0], i);
    for (int k = 1; k < nsrc; k++) acc = op_f32(op, acc, mp_hfr_load_f32(dtype, src[k], i));
    mp_hfr_store_f32(dtype, dst, i, acc);
  }
}

/* ---- SIMD: gcc vector types, W 32-bit lanes (8 for AVX2, 16 for AVX-512) ----
 *
 * FP32 and FP16 take W elements a block (FP16 through F16C), BF16 2W: a W-lane load of 32-bit words
 * holds 2W bf16 values, the even ones become floats by a shift and the odd ones by a mask, and the
 * results go back the same way; FP8 sums 4W, widened through FP16 by F16C and rounded back on the
 * FP8 grid (FP8_DECODE, FP8_ENCODE: no gather, which is microcode on AMD's cores), FP8 max and min
 * 16W on the codes themselves. Every lane computes what the scalar code computes. */

typedef float v16f __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint8_t v16b __attribute__((vector_size(16)));
typedef float v8f __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint8_t v8b __attribute__((vector_size(8)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef int16_t v16s __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef int16_t v8s __attribute__((vector_size(16)));
typedef int8_t v64c __attribute__((vector_size(64)));
typedef int8_t v32c __attribute__((vector_size(32)));

/* Lane-wise m ? a : b, m all ones or all zeros per lane: the twin of op_f32's ?: */
#define SEL_V(VF, VU, m, a, b) ((VF)((((VU)(a)) & (m)) | (((VU)(b)) & ~(m))))
#define OP_V(VF, VU, op, a, b)                                                     \
  ((op) == MPLANE_HFREDUCE_SUM ? (a) + (b)                                         \
   : (op) == MPLANE_HFREDUCE_MAX ? SEL_V(VF, VU, (VU)((a) > (b)), (a), (b))        \
                                 : SEL_V(VF, VU, (VU)((a) < (b)), (a), (b)))

/* The twin of mp_hfr_f32_to_bf16 on lanes holding float bits: the bf16 in the low 16 bits. */
#define BF16_ROUND(VU, out, bits)                                                      \
  do {                                                                                 \
    VU u_ = (bits);                                                                    \
    VU r_ = (u_ + 0x7fffu + ((u_ >> 16) & 1u)) >> 16;                                  \
    VU nan_ = (VU)((u_ & 0x7fffffffu) > 0x7f800000u);                                  \
    (out) = (r_ & ~nan_) | (((u_ >> 16) | 0x40u) & nan_ & 0xffffu);                    \
  } while (0)

/* The twin of fp8_encode on lanes, W codes to out (VB), from f: the float sum, for e4m3 scaled by 2^-8
 * as FP8_DECODE leaves it (exact: the scaled sums are the sums scaled, being multiples of 2^-17, never
 * float subnormals). Round to nearest even to the FP8 grid by adding and taking away c, a power of two
 * 23 - mantissa bits above the value's exponent (clamped below at FP16's least normal exponent, where
 * the FP8 subnormals' fixed step starts, scaled): the add rounds at that grid's step, ties to even. The
 * magnitude is first clamped at 448 (e4m3, scaled: saturation) or 2^16 (e5m2: past the largest finite
 * value, widening gives infinity), so c stays finite. The rounded value is an FP8 value, so FP16 holds
 * it exactly and vcvtps2ph makes its code: e5m2 is the FP16's top byte, e4m3 the magnitude's bits 13-7
 * beside the sign. An e5m2 NaN becomes, before the sign goes back on, the float that widens to FP16's
 * quiet NaN, whose top byte is the NaN code; e4m3 sums are never NaNs here (FP8_DECODE leaves e4m3
 * NaN codes finite, the sum block writes their code over the result). */
/* Unsigned 32-bit lane min and max (vpminud, vpmaxud: gcc's vector extensions have no ?: in C). */
__attribute__((target("avx2"), always_inline)) static inline v8u minu_v8(v8u a, v8u b) {
  return (v8u)_mm256_min_epu32((__m256i)a, (__m256i)b);
}
__attribute__((target("avx2"), always_inline)) static inline v8u maxu_v8(v8u a, v8u b) {
  return (v8u)_mm256_max_epu32((__m256i)a, (__m256i)b);
}
__attribute__((target("avx512f"), always_inline)) static inline v16u minu_v16(v16u a, v16u b) {
  return (v16u)_mm512_min_epu32((__m512i)a, (__m512i)b);
}
__attribute__((target("avx512f"), always_inline)) static inline v16u maxu_v16(v16u a, v16u b) {
  return (v16u)_mm512_max_epu32((__m512i)a, (__m512i)b);
}
#define MINU_V(a, b) _Generic((a), v8u: minu_v8, v16u: minu_v16)((a), (b))
#define MAXU_V(a, b) _Generic((a), v8u: maxu_v8, v16u: maxu_v16)((a), (b))

#define FP8_ENCODE(VF, VU, VH, VB, F32_TO_H, out, f, e4m3)                                               \
  do {                                                                                                  \
    const uint32_t cap_ = (e4m3) ? 0x3fe00000u : 0x47800000u;     /* 1.75 (448 scaled), 65536 */         \
    const uint32_t step_ = (e4m3) ? 20u << 23 : 21u << 23;        /* 2^(23 - mantissa bits) */          \
    VU u_ = (VU)(f), a_ = u_ & 0x7fffffffu;                                                             \
    VU nan_ = (VU)(a_ > 0x7f800000u);                                                                   \
    a_ = MINU_V(a_, (VU){0} + cap_);                                                                    \
    VU c_ = MAXU_V(a_ & 0x7f800000u, (VU){0} + 0x38800000u) + step_;                                    \
    VU y_ = (VU)(((VF)a_ + (VF)c_) - (VF)c_);                                                           \
    if (!(e4m3)) y_ = (y_ & ~nan_) | (nan_ & 0x7fc00000u);                                              \
    y_ |= u_ & 0x80000000u;                                                                             \
    VH h_;                                                                                              \
    F32_TO_H(h_, (VF)y_);                                                                               \
    if (e4m3) h_ = ((h_ >> 8) & 0x80u) | ((h_ >> 7) & 0x7fu);                                           \
    else h_ = h_ >> 8;                                                                                  \
    (out) = __builtin_convertvector(h_, VB);                                                            \
  } while (0)

/* FP8 codes at p (W of them) to floats on lanes, bit for bit the table's values (fp8_decode), through
 * FP16, which holds every FP8 value exactly: an e5m2 code is the top byte of its FP16, an e4m3 code's
 * magnitude shifted to FP16's mantissa is its value times 2^-8 (exponent bias 15 against 7, FP16's
 * subnormals matching e4m3's), so F16C's widening gives the value, for e4m3 scaled by 2^-8 (the sum
 * is kept scaled, FP8_ENCODE takes it so). e5m2 NaN codes become FP16's quiet NaN 0x7e00, which
 * widens to the table's NaN (0x7fc00000); e4m3 ones are found on the bytes, a block at a time: e4m3
 * has no infinity, so a sum is a NaN, the table's, exactly when one of its inputs is. */
#define FP8_DECODE(VF, VH, VS, BYTES_TO_U16, H_TO_F32, x, p, e4m3)                                   \
  do {                                                                                              \
    VH v_, h_, nan_;                                                                                \
    BYTES_TO_U16(v_, (p));                                                                          \
    if (e4m3) { /* NaN codes left as 480 scaled: the sum block marks them on the bytes */         \
      h_ = ((v_ & 0x80u) << 8) | ((v_ & 0x7fu) << 7);                                               \
    } else {                                                                                        \
      h_ = v_ << 8;                                                                                 \
      nan_ = (VH)((VS)(v_ & 0x7fu) > 0x7c);                                                         \
      h_ = (h_ & ~nan_) | (nan_ & 0x7e00u);                                                         \
    }                                                                                               \
    H_TO_F32(x, h_);                                                                                \
  } while (0)

/* a + b with a the instruction's first source: when both are NaNs, x86 returns the first source's,
 * as the scalar fold's addss keeps the running sum's (an e5m2 inf - inf's negative default NaN before
 * a NaN code's positive one: the sign is the code's). Written out because the compiler may swap the
 * operands of a + b, which changes nothing but that NaN. */
#define ADD_ACC_FIRST(a, b)                                                                             \
  ({                                                                                                    \
    __typeof__(a) r_;                                                                                   \
    __asm__("vaddps %2, %1, %0" : "=v"(r_) : "v"(a), "vm"(b));                                          \
    r_;                                                                                                 \
  })

/* FP8 max and min on the codes themselves, 4W a block: what op_f32 picks is always one of its
 * operands, so the result is the chosen source's code, compared by a signed key (the magnitude, negated
 * when the sign is set: -0 and +0 tie, as in float) and never chosen over a NaN's neighbour the way
 * a > b never holds for a NaN. A NaN result is the code fp8_encode gives the table's NaN. */
#define FP8_KEY(c) ((((c) & 0x7f) ^ ((c) < 0)) - ((c) < 0))
#define FP8_ISNAN(c, e4m3) ((e4m3) ? ((c) & 0x7f) == 0x7f : ((c) & 0x7f) > 0x7c)
#define FP8_MINMAX_BLOCK(VC, op, e4m3, dst, src, nsrc, i)                                               \
  do {                                                                                                  \
    VC a_[4], x_, keep_; /* four vectors side by side: each source's fold is a chain of compares */     \
    _Pragma("GCC unroll 4") for (int j_ = 0; j_ < 4; j_++)                                              \
      memcpy(&a_[j_], (const uint8_t *)(src)[0] + (i) + j_ * sizeof(VC), sizeof(VC));                   \
    for (int k_ = 1; k_ < (nsrc); k_++) {                                                               \
      const uint8_t *p_ = (const uint8_t *)(src)[k_] + (i);                                             \
      _Pragma("GCC unroll 4") for (int j_ = 0; j_ < 4; j_++) {                                          \
        memcpy(&x_, p_ + j_ * sizeof(VC), sizeof(VC));                                                  \
        keep_ = (op) == MPLANE_HFREDUCE_MAX ? FP8_KEY(a_[j_]) > FP8_KEY(x_) : FP8_KEY(a_[j_]) < FP8_KEY(x_); \
        keep_ &= ~(FP8_ISNAN(a_[j_], e4m3) | FP8_ISNAN(x_, e4m3));                                      \
        a_[j_] = (a_[j_] & keep_) | (x_ & ~keep_);                                                      \
      }                                                                                                 \
    }                                                                                                   \
    _Pragma("GCC unroll 4") for (int j_ = 0; j_ < 4; j_++) {                                            \
      VC nan_ = FP8_ISNAN(a_[j_], e4m3);                                                                \
      a_[j_] = (a_[j_] & ~nan_) | (nan_ & ((VC){0} + (int8_t)((e4m3) ? 0x7f : 0x7e)));                  \
      memcpy((uint8_t *)(dst) + (i) + j_ * sizeof(VC), &a_[j_], sizeof(VC));                            \
    }                                                                                                   \
  } while (0)

/* One ISA's kernel. The body is inlined once per (dtype, op) with both constant, so the block loop
 * carries no branch on them; the tail (n % block) goes the scalar way. */
#define DEFINE_SIMD(NAME, TARGET, VF, VU, VI, VB, VH, VS, VC, W, F16_LOAD, F16_STORE, BYTES_TO_U16, H_TO_F32, F32_TO_H)                      \
  __attribute__((target(TARGET), always_inline)) static inline void NAME##_body(                          \
      const int dtype, const int op, void *dst, const void *const *src, int nsrc, size_t n) {              \
    const int e4m3 = dtype == MPLANE_HFREDUCE_FP8_E4M3;                                                    \
    const int fp8 = e4m3 || dtype == MPLANE_HFREDUCE_FP8_E5M2;                                              \
    const size_t per = !fp8 ? (dtype == MPLANE_HFREDUCE_BFLOAT16 ? 2 * (W) : (W))                            \
                       : op == MPLANE_HFREDUCE_SUM ? sizeof(VC) : 4 * sizeof(VC);                          \
    const size_t blocks = n / per;                                                                         \
    for (size_t b = 0; b < blocks; b++) {                                                                  \
      const size_t i = b * per;                                                                            \
      if (fp8 && op != MPLANE_HFREDUCE_SUM) {                                                              \
        FP8_MINMAX_BLOCK(VC, op, e4m3, dst, src, nsrc, i);                                                 \
        continue;                                                                                          \
      }                                                                                                    \
      if (fp8) { /* 4W a block, four sums side by side: a source's pointer read once per 4W */             \
        VF s4[4], x4;                                                                                      \
        VC nanb = {0}, xb; /* e4m3: the lanes with a NaN input */                                          \
        _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++)                                                \
          FP8_DECODE(VF, VH, VS, BYTES_TO_U16, H_TO_F32, s4[j], (const uint8_t *)src[0] + i + j * (W), e4m3); \
        if (e4m3) {                                                                                        \
          memcpy(&xb, (const uint8_t *)src[0] + i, sizeof(VC));                                            \
          nanb |= (xb | (int8_t)0x80) == (int8_t)-1;                                                       \
        }                                                                                                  \
        for (int k = 1; k < nsrc; k++) {                                                                   \
          const uint8_t *p_ = (const uint8_t *)src[k] + i;                                                 \
          if (e4m3) {                                                                                      \
            memcpy(&xb, p_, sizeof(VC));                                                                   \
            nanb |= (xb | (int8_t)0x80) == (int8_t)-1;                                                     \
          }                                                                                                \
          _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) {                                            \
            FP8_DECODE(VF, VH, VS, BYTES_TO_U16, H_TO_F32, x4, p_ + j * (W), e4m3);                        \
            s4[j] = ADD_ACC_FIRST(s4[j], x4);                                                              \
          }                                                                                                \
        }                                                                                                  \
        VC out;                                                                                            \
        _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) {                                              \
          VB bytes;                                                                                        \
          FP8_ENCODE(VF, VU, VH, VB, F32_TO_H, bytes, s4[j], e4m3);                                        \
          memcpy((uint8_t *)&out + j * (W), &bytes, (W));                                                  \
        }                                                                                                  \
        if (e4m3) out = (out & ~nanb) | (nanb & (int8_t)0x7f);                                             \
        memcpy((uint8_t *)dst + i, &out, sizeof(VC));                                                      \
        continue;                                                                                          \
      }                                                                                                    \
      if (dtype == MPLANE_HFREDUCE_BFLOAT16) {                                                             \
        VU w;                                                                                              \
        memcpy(&w, (const uint16_t *)src[0] + i, (W) * 4);                                                 \
        VF ae = (VF)(w << 16), ao = (VF)(w & 0xffff0000u);                                                 \
        for (int k = 1; k < nsrc; k++) {                                                                   \
          memcpy(&w, (const uint16_t *)src[k] + i, (W) * 4);                                               \
          VF xe = (VF)(w << 16), xo = (VF)(w & 0xffff0000u);                                               \
          ae = OP_V(VF, VU, op, ae, xe);                                                                   \
          ao = OP_V(VF, VU, op, ao, xo);                                                                   \
        }                                                                                                  \
        VU re, ro;                                                                                         \
        BF16_ROUND(VU, re, (VU)ae);                                                                        \
        BF16_ROUND(VU, ro, (VU)ao);                                                                        \
        w = re | (ro << 16);                                                                               \
        memcpy((uint16_t *)dst + i, &w, (W) * 4);                                                          \
        continue;                                                                                          \
      }                                                                                                    \
      VF acc = {0}, x; /* nsrc >= 1: the first source sets it */                                         \
      for (int k = 0; k < nsrc; k++) {                                                                     \
        if (dtype == MPLANE_HFREDUCE_FLOAT32) memcpy(&x, (const float *)src[k] + i, (W) * 4);              \
        else F16_LOAD(x, (const uint16_t *)src[k] + i);                                                    \
        acc = k == 0 ? x : OP_V(VF, VU, op, acc, x);                                                       \
      }                                                                                                    \
      if (dtype == MPLANE_HFREDUCE_FLOAT32) {                                                              \
        memcpy((float *)dst + i, &acc, (W) * 4);                                                           \
      } else {                                                                                             \
        F16_STORE((uint16_t *)dst + i, acc);                                                               \
      }                                                                                                    \
    }                                                                                                      \
    reduce_scalar_range(dtype, op, dst, src, nsrc, blocks * per, n);                                      \
  }                                                                                                        \
  __attribute__((target(TARGET))) static void NAME(int dtype, int op, void *dst, const void *const *src,  \
                                                   int nsrc, size_t n) {                                   \
    switch (dtype * 3 + op) {                                                                              \
      case 0: NAME##_body(0, 0, dst, src, nsrc, n); break;                                                 \
      case 1: NAME##_body(0, 1, dst, src, nsrc, n); break;                                                 \
      case 2: NAME##_body(0, 2, dst, src, nsrc, n); break;                                                 \
      case 3: NAME##_body(1, 0, dst, src, nsrc, n); break;                                                 \
      case 4: NAME##_body(1, 1, dst, src, nsrc, n); break;                                                 \
      case 5: NAME##_body(1, 2, dst, src, nsrc, n); break;                                                 \
      case 6: NAME##_body(2, 0, dst, src, nsrc, n); break;                                                 \
      case 7: NAME##_body(2, 1, dst, src, nsrc, n); break;                                                 \
      case 8: NAME##_body(2, 2, dst, src, nsrc, n); break;                                                 \
      case 9: NAME##_body(3, 0, dst, src, nsrc, n); break;                                                 \
      case 10: NAME##_body(3, 1, dst, src, nsrc, n); break;                                                \
      case 11: NAME##_body(3, 2, dst, src, nsrc, n); break;                                                \
      case 12: NAME##_body(4, 0, dst, src, nsrc, n); break;                                                \
      case 13: NAME##_body(4, 1, dst, src, nsrc, n); break;                                                \
      case 14: NAME##_body(4, 2, dst, src, nsrc, n); break;                                                \
    }                                                                                                      \
  }

#define F16_LOAD_AVX2(x, p)                                                    \
  do {                                                                         \
    __m256 v_ = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)));        \
    memcpy(&(x), &v_, 32);                                                     \
  } while (0)
#define F16_STORE_AVX2(p, v)                                                                   \
  do {                                                                                         \
    __m256 v_;                                                                                 \
    memcpy(&v_, &(v), 32);                                                                     \
    _mm_storeu_si128((__m128i *)(p), _mm256_cvtps_ph(v_, _MM_FROUND_TO_NEAREST_INT));          \
  } while (0)
#define F16_LOAD_AVX512(x, p)                                                      \
  do {                                                                             \
    __m512 v_ = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)));         \
    memcpy(&(x), &v_, 64);                                                         \
  } while (0)
#define F16_STORE_AVX512(p, v)                                                                        \
  do {                                                                                                \
    __m512 v_;                                                                                        \
    memcpy(&v_, &(v), 64);                                                                            \
    _mm256_storeu_si256((__m256i *)(p), _mm512_cvtps_ph(v_, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)); \
  } while (0)
/* W bytes at p zero-extended to W 16-bit lanes (vpmovzxbw: gcc's __builtin_convertvector does it
 * byte by byte), and W FP16 lanes widened to floats (F16C) */
#define BYTES_TO_U16_AVX2(v, p)                                                        \
  do {                                                                                 \
    __m128i w_ = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(p)));            \
    memcpy(&(v), &w_, 16);                                                             \
  } while (0)
#define BYTES_TO_U16_AVX512(v, p)                                                      \
  do {                                                                                 \
    __m256i w_ = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(p)));         \
    memcpy(&(v), &w_, 32);                                                             \
  } while (0)
#define H_TO_F32_AVX2(x, h)                                                            \
  do {                                                                                 \
    __m128i hh_;                                                                       \
    memcpy(&hh_, &(h), 16);                                                            \
    __m256 f_ = _mm256_cvtph_ps(hh_);                                                  \
    memcpy(&(x), &f_, 32);                                                             \
  } while (0)
#define H_TO_F32_AVX512(x, h)                                                          \
  do {                                                                                 \
    __m256i hh_;                                                                       \
    memcpy(&hh_, &(h), 32);                                                            \
    __m512 f_ = _mm512_cvtph_ps(hh_);                                                  \
    memcpy(&(x), &f_, 64);                                                             \
  } while (0)
#define F32_TO_H_AVX2(h, x)                                                            \
  do {                                                                                 \
    __m256 f_;                                                                         \
    VF_COPY(f_, x);                                                                    \
    __m128i hh_ = _mm256_cvtps_ph(f_, _MM_FROUND_TO_NEAREST_INT);                      \
    memcpy(&(h), &hh_, 16);                                                            \
  } while (0)
#define F32_TO_H_AVX512(h, x)                                                          \
  do {                                                                                 \
    __m512 f_;                                                                         \
    VF_COPY(f_, x);                                                                    \
    __m256i hh_ = _mm512_cvtps_ph(f_, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);  \
    memcpy(&(h), &hh_, 32);                                                            \
  } while (0)
#define VF_COPY(dst, x)                                                                \
  do {                                                                                 \
    __typeof__(x) x_ = (x);                                                            \
    memcpy(&(dst), &x_, sizeof(dst));                                                  \
  } while (0)

DEFINE_SIMD(reduce_avx2, "avx2,f16c", v8f, v8u, v8i, v8b, v8h, v8s, v32c, 8, F16_LOAD_AVX2, F16_STORE_AVX2,
            BYTES_TO_U16_AVX2, H_TO_F32_AVX2, F32_TO_H_AVX2)
DEFINE_SIMD(reduce_avx512, "avx512f,avx512bw,avx2,f16c", v16f, v16u, v16i, v16b, v16h, v16s, v64c, 16, F16_LOAD_AVX512,
            F16_STORE_AVX512, BYTES_TO_U16_AVX512, H_TO_F32_AVX512, F32_TO_H_AVX512)

void mp_hfr_reduce_isa(int isa, int dtype, int op, void *dst, const void *const *src, int nsrc, size_t n) {
  if (nsrc <= 0 || n == 0) return;
  switch (isa) {
    case MP_HFR_ISA_AVX512: reduce_avx512(dtype, op, dst, src, nsrc, n); return;
    case MP_HFR_ISA_AVX2: reduce_avx2(dtype, op, dst, src, nsrc, n); return;
    default: reduce_scalar_range(dtype, op, dst, src, nsrc, 0, n); return;
  }
}

static int best_isa = -1;
void mp_hfr_reduce(int dtype, int op, void *dst, const void *const *src, int nsrc, size_t n) {
  int isa = __atomic_load_n(&best_isa, __ATOMIC_RELAXED);
  if (isa < 0) {
    isa = mp_hfr_isa_best();
    __atomic_store_n(&best_isa, isa, __ATOMIC_RELAXED);
  }
  mp_hfr_reduce_isa(isa, dtype, op, dst, src, nsrc, n);
}
