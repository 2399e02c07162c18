/* HFReduce's CPU reduction: dst[i] = op(src[0][i], ..., src[nsrc-1][i]), folded left to right in
 * float32 and rounded once to the element type (round to nearest even). One scalar version and
 * SIMD ones (gcc vector extensions compiled per target, chosen at run time); every version gives
 * the same bits as the scalar one, which the tests check. dst may be src[0]. */
#ifndef MPLANE_HFR_REDUCE_H
#define MPLANE_HFR_REDUCE_H

#include <stddef.h>
#include <stdint.h>
#include "mplane_hfreduce.h"

enum mp_hfr_isa { MP_HFR_ISA_SCALAR = 0, MP_HFR_ISA_AVX2 = 1, MP_HFR_ISA_AVX512 = 2, MP_HFR_NISA = 3 };

size_t mp_hfr_dtype_size(int dtype);
const char *mp_hfr_dtype_name(int dtype);
const char *mp_hfr_op_name(int op);
const char *mp_hfr_isa_name(int isa);
int mp_hfr_isa_supported(int isa);
int mp_hfr_isa_best(void);

/* The best supported version. */
void mp_hfr_reduce(int dtype, int op, void *dst, const void *const *src, int nsrc, size_t n);
/* One version (the tests compare them); the ISA must be supported. */
void mp_hfr_reduce_isa(int isa, int dtype, int op, void *dst, const void *const *src, int nsrc, size_t n);

/* Scalar conversions, exact twins of the SIMD ones (NaN aside: any NaN stays a NaN). */
float mp_hfr_load_f32(int dtype, const void *p, size_t i);
void mp_hfr_store_f32(int dtype, void *p, size_t i, float v);
float mp_hfr_bf16_to_f32(uint16_t h);
uint16_t mp_hfr_f32_to_bf16(float f);
float mp_hfr_f16_to_f32(uint16_t h);
uint16_t mp_hfr_f32_to_f16(float f);
float mp_hfr_fp8_to_f32(int dtype, uint8_t v);
uint8_t mp_hfr_f32_to_fp8(int dtype, float f);

#endif
