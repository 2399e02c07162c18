/* HFReduce's CPU reduction kernels (hfr_reduce.h).
 *
 * The SIMD versions are one body, written with gcc's vector extensions (16 floats at a time), compiled
 * once per target (AVX2 + F16C, AVX-512) with target attributes and picked at run time by
 * __builtin_cpu_supports. The tail of a block (n % 16) and FP8 go through the scalar code, whose
 * arithmetic is the same expression element by element, so every version gives the same bits.
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

/* ---- SIMD: 16 lanes in gcc vector types ---- */

typedef float v16f __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

/* Lane-wise m ? a : b, m all ones or all zeros per lane: the twin of op_f32's ?: */
#define SEL_V(m, a, b) ((v16f)((((v16u)(a)) & (m)) | (((v16u)(b)) & ~(m))))
#define OP_V(op, a, b)                                                             \
  ((op) == MPLANE_HFREDUCE_SUM ? (a) + (b)                                         \
   : (op) == MPLANE_HFREDUCE_MAX ? SEL_V((v16u)((a) > (b)), (a), (b))              \
                                 : SEL_V((v16u)((a) < (b)), (a), (b)))

#define BF16_TO_F32(h) ((v16f)(__builtin_convertvector((h), v16u) << 16))
/* The twin of mp_hfr_f32_to_bf16, into the v16h out. */
#define BF16_FROM_F32(out, f)                                                          \
  do {                                                                                 \
    v16u u_ = (v16u)(f);                                                               \
    v16u r_ = (u_ + 0x7fffu + ((u_ >> 16) & 1u)) >> 16;                                \
    v16u nan_ = (v16u)((u_ & 0x7fffffffu) > 0x7f800000u);                              \
    r_ = (r_ & ~nan_) | (((u_ >> 16) | 0x40u) & nan_);                                 \
    (out) = __builtin_convertvector(r_, v16h);                                         \
  } while (0)

/* Source k's 16 elements from i on, as floats, into x. */
#define LOAD_V(x, F16_LOAD, k)                                                         \
  do {                                                                                 \
    if (dtype == MPLANE_HFREDUCE_FLOAT32) {                                            \
      memcpy(&(x), (const float *)src[k] + i, 64);                                     \
    } else if (dtype == MPLANE_HFREDUCE_BFLOAT16) {                                    \
      v16h h_;                                                                         \
      memcpy(&h_, (const uint16_t *)src[k] + i, 32);                                   \
      (x) = BF16_TO_F32(h_);                                                           \
    } else {                                                                           \
      F16_LOAD(x, (const uint16_t *)src[k] + i);                                       \
    }                                                                                  \
  } while (0)

/* One ISA's kernel: 16-element blocks of the sized types, the rest (tail, FP8) the scalar way. The
 * body is inlined once per (dtype, op) with both constant, so the loop carries no branch on them. */
#define DEFINE_SIMD(NAME, TARGET, F16_LOAD, F16_STORE)                                           \
  __attribute__((target(TARGET), always_inline)) static inline void NAME##_body(                 \
      const int dtype, const int op, void *dst, const void *const *src, int nsrc, size_t n) {     \
    size_t blocks = n / 16;                                                                       \
    for (size_t b = 0; b < blocks; b++) {                                                         \
      size_t i = b * 16;                                                                          \
      v16f acc, x;                                                                                \
      LOAD_V(acc, F16_LOAD, 0);                                                                   \
      for (int k = 1; k < nsrc; k++) {                                                            \
        LOAD_V(x, F16_LOAD, k);                                                                   \
        acc = OP_V(op, acc, x);                                                                   \
      }                                                                                           \
      if (dtype == MPLANE_HFREDUCE_FLOAT32) {                                                     \
        memcpy((float *)dst + i, &acc, 64);                                                       \
      } else if (dtype == MPLANE_HFREDUCE_BFLOAT16) {                                             \
        v16h h;                                                                                   \
        BF16_FROM_F32(h, acc);                                                                    \
        memcpy((uint16_t *)dst + i, &h, 32);                                                      \
      } else {                                                                                    \
        F16_STORE((uint16_t *)dst + i, acc);                                                      \
      }                                                                                           \
    }                                                                                             \
    reduce_scalar_range(dtype, op, dst, src, nsrc, blocks * 16, n);                              \
  }                                                                                               \
  __attribute__((target(TARGET))) static void NAME(int dtype, int op, void *dst, const void *const *src, \
                                                   int nsrc, size_t n) {                         \
    if (dtype > MPLANE_HFREDUCE_BFLOAT16) {                                                       \
      reduce_scalar_range(dtype, op, dst, src, nsrc, 0, n);                                      \
      return;                                                                                     \
    }                                                                                             \
    _Pragma("GCC unroll 0")                                                                       \
    for (int d = MPLANE_HFREDUCE_FLOAT32; d <= MPLANE_HFREDUCE_BFLOAT16; d++)                     \
      for (int o = MPLANE_HFREDUCE_SUM; o <= MPLANE_HFREDUCE_MIN; o++)                            \
        if (d == dtype && o == op) {                                                              \
          SPECIALIZE(NAME, d, o, dst, src, nsrc, n);                                              \
          return;                                                                                 \
        }                                                                                         \
  }

/* The constant (dtype, op) pairs the bodies are inlined for. */
#define SPECIALIZE(NAME, d, o, dst, src, nsrc, n)                                                  \
  do {                                                                                             \
    switch ((d) * 3 + (o)) {                                                                       \
      case 0: NAME##_body(0, 0, dst, src, nsrc, n); break;                                         \
      case 1: NAME##_body(0, 1, dst, src, nsrc, n); break;                                         \
      case 2: NAME##_body(0, 2, dst, src, nsrc, n); break;                                         \
      case 3: NAME##_body(1, 0, dst, src, nsrc, n); break;                                         \
      case 4: NAME##_body(1, 1, dst, src, nsrc, n); break;                                         \
      case 5: NAME##_body(1, 2, dst, src, nsrc, n); break;                                         \
      case 6: NAME##_body(2, 0, dst, src, nsrc, n); break;                                         \
      case 7: NAME##_body(2, 1, dst, src, nsrc, n); break;                                         \
      case 8: NAME##_body(2, 2, dst, src, nsrc, n); break;                                         \
    }                                                                                              \
  } while (0)

#define F16_LOAD_AVX2(x, p)                                                       \
  do {                                                                            \
    __m256 lo_ = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)));          \
    __m256 hi_ = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p) + 1));      \
    memcpy(&(x), &lo_, 32);                                                       \
    memcpy((char *)&(x) + 32, &hi_, 32);                                          \
  } while (0)
#define F16_STORE_AVX2(p, v)                                                                   \
  do {                                                                                         \
    __m256 lo_, hi_;                                                                           \
    memcpy(&lo_, &(v), 32);                                                                    \
    memcpy(&hi_, (char *)&(v) + 32, 32);                                                       \
    _mm_storeu_si128((__m128i *)(p), _mm256_cvtps_ph(lo_, _MM_FROUND_TO_NEAREST_INT));         \
    _mm_storeu_si128((__m128i *)(p) + 1, _mm256_cvtps_ph(hi_, _MM_FROUND_TO_NEAREST_INT));     \
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

DEFINE_SIMD(reduce_avx2, "avx2,f16c", F16_LOAD_AVX2, F16_STORE_AVX2)
DEFINE_SIMD(reduce_avx512, "avx512f,avx512bw,avx2,f16c", F16_LOAD_AVX512, F16_STORE_AVX512)

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
