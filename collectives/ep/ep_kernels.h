/* libmplane-ep: the kernels' launch functions (ep_kernels.cu), called by the C host code. Each
 * returns a cudaError_t (as int) from the launch. Every kernel walks the planner's functions of
 * ep_plan.h; the CPU twin of each is in ep_sim.c. */
#ifndef MPLANE_EP_KERNELS_H
#define MPLANE_EP_KERNELS_H

#include <stdint.h>

#include <cuda_runtime_api.h>

#include "ep_plan.h"

#ifdef __cplusplus
extern "C" {
#endif

/* a fused-dispatch wait for a peer's row gives up (and fails the kernel) after this long (the
 * emulator's fault test builds with 2 s) */
#ifndef MP_EP_WAIT_NS
#define MP_EP_WAIT_NS (60ll * 1000000000ll)
#endif

#define MP_EP_BLOCK 1024 /* threads of a data-kernel block: 32 warps, one item (token, row) per warp */
/* pack and the fused dispatch: 16 warps, so that a thread has 128 registers for the loads it keeps
 * in flight (at 1024 threads, 64 registers: spills; measured on an H200, FP8 pack 106 vs 122 us) */
#define MP_EP_PACK_BLOCK 512

/* layout: cleaned ids (Treal rows of K * expand), scans, the A and B count messages, offsets */
int mp_ep_launch_sanitize(const mp_ep_view *v, const int32_t *idx, int Treal, cudaStream_t s);
int mp_ep_launch_scan(const mp_ep_view *v, cudaStream_t s);
int mp_ep_launch_msg_a(const mp_ep_view *v, cudaStream_t s);
int mp_ep_launch_msg_b(const mp_ep_view *v, cudaStream_t s);
int mp_ep_launch_offsets(const mp_ep_view *v, cudaStream_t s);
int mp_ep_launch_token_in_rank(const mp_ep_view *v, uint8_t *flags, cudaStream_t s);
/* dispatch */
int mp_ep_launch_pack(const mp_ep_view *v, const uint16_t *x, const float *w, int blocks, cudaStream_t s);
int mp_ep_launch_forward(const mp_ep_view *v, int blocks, cudaStream_t s);
int mp_ep_launch_unpack(const mp_ep_view *v, int blocks, cudaStream_t s);
/* one node, nvlink_direct: in one kernel of `blocks` blocks pack on [0, pack_blocks), copy the
 * staged rows to the peers on the next link_blocks, and unpack the peers' rows (waiting on their
 * flags) on the rest. host_epoch: this dispatch's epoch (normal mode), or 0: bump the device
 * epoch first and use that (worst-case mode, where a CUDA graph replays the launch) */
int mp_ep_launch_dispatch_fused(const mp_ep_view *v, const uint16_t *x, const float *w, int pack_blocks,
                                int link_blocks, int blocks, int host_epoch, cudaStream_t s);
/* combine */
int mp_ep_launch_combine_expert(const mp_ep_view *v, const uint16_t *y, int blocks, cudaStream_t s);
/* One node, nvlink_direct: the whole combine in one kernel (expert_blocks send, the rest sum).
 * host_depoch / host_cepoch: the dispatch's and this combine's epochs, 0: counted on the GPU. */
int mp_ep_launch_combine_fused(const mp_ep_view *v, const uint16_t *y, uint16_t *out, int expert_blocks, int blocks,
                               int host_depoch, int host_cepoch, cudaStream_t s);
int mp_ep_launch_combine_node(const mp_ep_view *v, int blocks, cudaStream_t s);
int mp_ep_launch_combine_out(const mp_ep_view *v, uint16_t *out, int blocks, cudaStream_t s);
/* helpers */
int mp_ep_launch_dequant(const mp_ep_view *v, uint16_t *y, int blocks, cudaStream_t s);
int mp_ep_launch_route(const float *logits, const float *bias, int T, int E, int K, int groups, int topk_groups,
                       float scaling, int normalize, int32_t *idx, float *w, cudaStream_t s);
/* The hardware FP8 conversion of n floats times inv (what pack does), for the GPU test to compare
 * with the CPU twin. */
int mp_ep_launch_fp8_probe(const float *in, float inv, uint8_t *out, long n, cudaStream_t s);

#ifdef __cplusplus
}
#endif

#endif
