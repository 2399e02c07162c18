/* libmplane-ep kernels (CUDA C). Where a token goes is decided by the planner functions of
 * ep_plan.h, called here by one thread per token or row and kept in shared memory; the other
 * threads only move bytes (16-byte vectors) and do the arithmetic of the number formats. The CPU
 * twin of every kernel is in ep_sim.c, and CI checks that twin against the reference model.
 *
 * SMs: the data kernels (pack, forward, unpack, combine x3, dequant) run `blocks` blocks of
 * MP_EP_BLOCK threads, one block per SM (blocks = the context's num_sms); the layout kernels run
 * R + N + E + 1 short scan blocks, and the count kernels one block. NCCL's send/receive kernels run
 * between them on the same stream, with NCCL's own channel count. Nothing here runs concurrently
 * with NCCL, so the SM count matters for overlap with other work on other streams only. */
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>

#include "ep_kernels.h"

/* Launches go through one macro so that tests/ep/emu can run this very file on the CPU (each CUDA
 * thread an OS thread, barriers and warp exchanges emulated, software FP8). */
#ifdef MP_EP_EMU
#define MP_LAUNCH(k, grid, block, smem, stream, ...) emu_launch((grid), (block), (smem), [=]() { k(__VA_ARGS__); })
#else
#define MP_LAUNCH(k, grid, block, smem, stream, ...) k<<<(grid), (block), (smem), (stream)>>>(__VA_ARGS__)
#endif

#define MP_TID ((int)threadIdx.x)
#define MP_BDIM ((int)blockDim.x)

/* x times the tile's inverse scale, to e4m3 (ep_num.h's mp_ep_quant is the CPU twin). */
static __device__ __forceinline__ uint8_t fp8_of(float x, float inv) {
#ifdef MP_EP_SOFT_FP8
  return mp_ep_quant(x, inv);
#else
  return (uint8_t)__nv_cvt_float_to_fp8(__fmul_rn(x, inv), __NV_SATFINITE, __NV_E4M3);
#endif
}

/* Two of them, a in the low byte: one conversion instruction for the pair. */
static __device__ __forceinline__ uint32_t fp8x2_of(float a, float b, float inv) {
#ifdef MP_EP_SOFT_FP8
  return (uint32_t)mp_ep_quant(a, inv) | ((uint32_t)mp_ep_quant(b, inv) << 8);
#else
  return (uint32_t)__nv_cvt_float2_to_fp8x2(make_float2(__fmul_rn(a, inv), __fmul_rn(b, inv)), __NV_SATFINITE, __NV_E4M3);
#endif
}

static __device__ __forceinline__ void unpack_bf16x8(uint4 r, float *f) {
  uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
  for (int i = 0; i < 4; i++) {
    f[2 * i] = mp_bf16_to_f32((uint16_t)(w[i] & 0xffffu));
    f[2 * i + 1] = mp_bf16_to_f32((uint16_t)(w[i] >> 16));
  }
}

static __device__ __forceinline__ uint4 pack_bf16x8(const float *f) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; i++) w[i] = (uint32_t)mp_f32_to_bf16(f[2 * i]) | ((uint32_t)mp_f32_to_bf16(f[2 * i + 1]) << 16);
  return make_uint4(w[0], w[1], w[2], w[3]);
}

static int launched(void) { return (int)cudaGetLastError(); }

/* ---------------- layout ---------------- */

__global__ void k_sanitize(mp_ep_view v, const int32_t *idx, int Treal) {
  int Kin = v.K * v.expand;
  for (long t = (long)blockIdx.x * blockDim.x + threadIdx.x; t < Treal; t += (long)gridDim.x * blockDim.x)
    mp_ep_sanitize_row(idx + t * Kin, v.topk + t * Kin, Kin, v.E);
}

/* One block per scan unit: an exclusive prefix sum over the tokens, in token order. */
__global__ void k_scan(mp_ep_view v) {
  __shared__ int warp_base[32];
  __shared__ int carry;
  int role, target;
  mp_ep_scan_unit(&v, blockIdx.x, &role, &target);
  int *out = mp_ep_scan_out(&v, role);
  int lane = MP_TID & 31, wid = MP_TID >> 5, nw = MP_BDIM >> 5;
  if (MP_TID == 0) carry = 0;
  __syncthreads();
  for (int base = 0; base < v.T; base += MP_BDIM) {
    int t = base + MP_TID;
    uint32_t m = t < v.T ? mp_ep_scan_mask(&v, v.topk + (long)t * v.K, role, target) : 0u;
    if (role == MP_EP_SCAN_CLEAR) { /* block-uniform branch */
      if (t < v.T) mp_ep_scan_clear(&v, t, m);
      continue;
    }
    unsigned ballot = __ballot_sync(0xffffffffu, m != 0u);
    int before = __popc(ballot & ((1u << lane) - 1u));
    if (lane == 0) warp_base[wid] = __popc(ballot);
    __syncthreads();
    if (MP_TID == 0) {
      int acc = carry;
      for (int w = 0; w < nw; w++) {
        int c = warp_base[w];
        warp_base[w] = acc;
        acc += c;
      }
      carry = acc;
    }
    __syncthreads();
    if (m) {
      int pos = warp_base[wid] + before;
      for (int k = 0; k < v.K; k++)
        if (m & (1u << k)) out[(long)t * v.K + k] = pos;
    }
    __syncthreads();
  }
  if (MP_TID == 0) {
    int ti = mp_ep_scan_total_index(&v, role, target);
    if (ti >= 0) v.cnt[ti] = carry;
  }
}

__global__ void k_msg_a(mp_ep_view v) {
  const mp_ep_cnt_layout *L = &v.cl;
  for (int i = MP_TID; i < v.N * L->la; i += MP_BDIM) {
    int n = i / L->la, w = i % L->la;
    int val = mp_ep_a_word(&v, v.cnt, n, w);
    v.cnt[L->a_send + i] = val;
    if (n == v.my_node) v.cnt[L->a_recv + i] = val;
  }
}

__global__ void k_msg_b(mp_ep_view v) {
  const mp_ep_cnt_layout *L = &v.cl;
  for (int i = MP_TID; i < v.G * L->lb; i += MP_BDIM) {
    int j = i / L->lb, w = i % L->lb;
    int val = mp_ep_b_word(&v, v.cnt, j, w);
    v.cnt[L->b_send + i] = val;
    if (j == v.my_local) v.cnt[L->b_recv + i] = val;
  }
}

__global__ void k_offsets(mp_ep_view v) {
  if (MP_TID == 0) mp_ep_offsets_segments(&v, v.cnt);
  for (int e = MP_TID; e < v.Er; e += MP_BDIM) v.cnt[v.cl.ex_off + e + 1] = mp_ep_expert_total(&v, v.cnt, e);
  __syncthreads();
  if (MP_TID == 0) mp_ep_offsets_experts_prefix(&v, v.cnt);
  __syncthreads();
  for (int e = MP_TID; e < v.Er; e += MP_BDIM) mp_ep_offsets_expert_bases(&v, v.cnt, e);
  __syncthreads();
  if (MP_TID == 0) mp_ep_offsets_status(&v, v.cnt);
}

__global__ void k_token_in_rank(mp_ep_view v, uint8_t *flags) {
  int Kin = v.K * v.expand, Treal = v.T / v.expand;
  for (long t = (long)blockIdx.x * blockDim.x + threadIdx.x; t < Treal; t += (long)gridDim.x * blockDim.x) {
    uint8_t *f = flags + t * v.R;
    for (int r = 0; r < v.R; r++) f[r] = 0;
    for (int k = 0; k < Kin; k++) {
      int e = v.topk[t * Kin + k];
      if (e >= 0) f[mp_ep_expert_rank(&v, e)] = 1;
    }
  }
}

/* ---------------- dispatch ----------------
 * Data kernels: one warp per item (token, row or arrival), MP_EP_WARPS items in flight per block.
 * Lane 0 runs the item's plan (a few dependent loads) into the warp's shared-memory slot; the
 * warp then moves the bytes with 16-byte vectors, loads issued ahead of stores. */

#define MP_EP_WARPS (MP_EP_BLOCK / 32)
#define MP_LANE (MP_TID & 31)
#define MP_WARP (MP_TID >> 5)

/* items of this warp when `nb` blocks share the work and this block is number b of them: warp w
 * of block b takes b * W + w, then strides by all nb blocks */
#define FOR_ITEMS(i, n, b, nb) \
  for (long i = (long)(b) * (MP_BDIM >> 5) + MP_WARP; i < (n); i += (long)(nb) * (MP_BDIM >> 5))
#define FOR_WARP_ITEMS(i, n) FOR_ITEMS(i, n, blockIdx.x, gridDim.x)

/* Copy nv 16-byte vectors from src to dst[0..nd) (and nothing else), lane-strided, MP_COPY_UNROLL
 * loads in flight per lane: the copy kernels wait on memory latency (few rows per warp), so the
 * more bytes a warp has in flight, the faster. */
#define MP_COPY_UNROLL 8
static __device__ __forceinline__ void warp_copy(const uint4 *src, uint4 *const *dst, int nd, int nv) {
  for (int base = MP_LANE; base < nv; base += 32 * MP_COPY_UNROLL) {
    uint4 v[MP_COPY_UNROLL];
#pragma unroll
    for (int u = 0; u < MP_COPY_UNROLL; u++) {
      const int j = base + 32 * u;
      if (j < nv) v[u] = src[j];
    }
#pragma unroll
    for (int u = 0; u < MP_COPY_UNROLL; u++) {
      const int j = base + 32 * u;
      if (j < nv)
        for (int d = 0; d < nd; d++) dst[d][j] = v[u];
    }
  }
}

/* ---- the ready flags of the fused direct dispatch ----
 * A row's writer stores the dispatch's epoch into the row's flag once the whole warp's stores of
 * the row are done: with release semantics at system scope (a peer reads it; or one system fence
 * before the relaxed flag stores of several rows), or at GPU scope (a block of the same GPU reads
 * it); the reader loads it with acquire, so the row's bytes are visible once the flag matches.
 * (Raising a pack warp's peer flags behind one fence every N tokens instead of per token measured
 * slower for every N > 1 on 2x H200, 2026-11-30: FP8 170 us at N = 1, 196-200 at N = 4..64.) */
static __device__ __forceinline__ void flag_raise(int *flag, int epoch) {
#ifdef MP_EP_EMU
  __atomic_store_n(flag, epoch, __ATOMIC_RELEASE);
#else
  asm volatile("st.release.sys.global.s32 [%0], %1;" ::"l"(flag), "r"(epoch) : "memory");
#endif
}

/* A flag store after a fence that already ordered the row's bytes before it. */
static __device__ __forceinline__ void flag_store_relaxed(int *flag, int epoch) {
#ifdef MP_EP_EMU
  __atomic_store_n(flag, epoch, __ATOMIC_RELEASE);
#else
  asm volatile("st.relaxed.sys.global.s32 [%0], %1;" ::"l"(flag), "r"(epoch) : "memory");
#endif
}

/* Release at GPU scope: the pack blocks tell the link blocks of their GPU a row is staged. */
static __device__ __forceinline__ void flag_raise_gpu(int *flag, int epoch) {
#ifdef MP_EP_EMU
  __atomic_store_n(flag, epoch, __ATOMIC_RELEASE);
#else
  asm volatile("st.release.gpu.global.s32 [%0], %1;" ::"l"(flag), "r"(epoch) : "memory");
#endif
}

/* Wait until *flag == epoch; 0 after MP_EP_WAIT_NS without it (a peer that never dispatches).
 * sys: the flag is raised by another GPU, else by this one. */
static __device__ int flag_wait(const int *flag, int epoch, bool sys = true) {
#ifdef MP_EP_EMU
  (void)sys;
  return emu_wait_flag(flag, epoch, MP_EP_WAIT_NS);
#else
  uint64_t t0 = 0;
  for (long spin = 0;; spin++) {
    int x;
    if (sys) asm volatile("ld.acquire.sys.global.s32 %0, [%1];" : "=r"(x) : "l"(flag) : "memory");
    else asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(x) : "l"(flag) : "memory");
    if (x == epoch) return 1;
    __nanosleep(32); /* leave the memory system to the blocks that move data */
    if ((spin & 1023) == 0) {
      uint64_t now;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
      if (spin == 0) t0 = now;
      else if (now - t0 > MP_EP_WAIT_NS) return 0;
    }
  }
#endif
}

/* End the kernel with an error (cudaErrorLaunchFailure at the caller's next synchronisation). */
static __device__ void kernel_fail() {
#ifdef MP_EP_EMU
  emu_trap();
#else
  __trap();
#endif
}

/* A wait that timed out: the peer is gone or never called dispatch. Say which row, then fail the
 * kernel: never hang. */
static __device__ void flag_timeout(const mp_ep_view &v, long row, int seg, bool own = false) {
  if (own)
    printf("libmplane-ep: rank %d waited %d s for its own pack blocks to stage p2s row %ld for local GPU %d "
           "(nvlink_direct dispatch; a bug: please report)\n",
           v.me, (int)(MP_EP_WAIT_NS / 1000000000ll), row, seg);
  else
    printf("libmplane-ep: rank %d waited %d s for p2r row %ld from local GPU %d (nvlink_direct dispatch): "
           "the peer process died or never called mplane_ep_dispatch\n",
           v.me, (int)(MP_EP_WAIT_NS / 1000000000ll), row, seg);
  kernel_fail();
}

/* ---- the fused dispatch's start handshake (instead of an all-gather before it) ----
 * Every rank's block 0 first writes its p2r segment starts into each same-node peer's flag buffer
 * and then, behind a system fence, its start flag there: "this rank's dispatch has begun, so its
 * earlier work on the stream (the experts reading its token rows, combine) is done and its p2r
 * may be written". A warp waits for a peer's start flag before its first write to that peer and
 * remembers it in `ready` (a bit per local GPU). */
static __device__ void announce_start(const mp_ep_view &v, int epoch) {
  const int lane = MP_LANE, G1 = v.G + 1;
  for (int j = 0; j < v.G; j++) {
    if (j == v.my_local) continue;
    int *peer = v.peer_flag[j] + v.start_off;
    if (lane < G1) peer[v.R + (long)v.me * G1 + lane] = v.cnt[v.cl.off2r + lane];
    if (lane < G1 && v.cflag_off) peer[mp_ep_p2s_starts_at(&v, v.me) - v.start_off + lane] = v.cnt[v.cl.off2s + lane];
    __syncwarp();
    if (lane == 0) {
      __threadfence_system();
      flag_store_relaxed(peer + v.me, epoch);
    }
    __syncwarp();
  }
}

static __device__ void await_peer(const mp_ep_view &v, int j, int epoch, unsigned &ready) {
  if ((ready >> j) & 1u) return;
  const int r = v.rank_of[v.my_node * v.G + j];
  if (!flag_wait(v.p2r_flag + v.start_off + r, epoch)) {
    printf("libmplane-ep: rank %d waited %d s for local GPU %d (rank %d) to start its nvlink_direct dispatch: "
           "the peer process died or never called mplane_ep_dispatch\n",
           v.me, (int)(MP_EP_WAIT_NS / 1000000000ll), j, r);
    kernel_fail();
  }
  ready |= 1u << j;
}

/* the local GPU a p2s row goes to. (Why the pack and the link resolve a peer row's wait, address
 * and flag with separate look-ups: one shared helper returning all three through pointers made
 * the fused dispatch 30-45% slower on an H200, 2026-11-30, code generation in the pack loop.) */
static __device__ __forceinline__ int p2s_target(const mp_ep_view &v, long row) {
  return mp_ep_seg_find(v.cnt + v.cl.off2s, v.G, row);
}

/* Per warp: the token's expert ids, weights and stream slots (copied in by the whole warp at once,
 * so the plan reads shared memory, not a chain of global loads), its plan, and the address of each
 * staging row and of its peer ready flag (resolved once per token). Dynamic shared memory: a
 * block's slots exceed the 48 KB static limit. */
struct pack_slot {
  int32_t row[MP_EP_MAX_TOPK];
  int nslot[MP_EP_MAX_TOPK], rrank[MP_EP_MAX_TOPK], erank[MP_EP_MAX_TOPK];
  float w[MP_EP_MAX_TOPK];
  /* per top-k slot, from pack_plan_warp: the expert (-1: dropped or a repeat), its class, and its
   * GPU's node and local index */
  int eff[MP_EP_MAX_TOPK], cls[MP_EP_MAX_TOPK], node[MP_EP_MAX_TOPK], loc[MP_EP_MAX_TOPK];
  mp_ep_pack_plan p;
  int nd;                                   /* rows to write: staging rows, then expert rows */
  char *dst[MP_EP_MAX_DST + MP_EP_MAX_TOPK]; /* their payloads */
  float *sc[MP_EP_MAX_DST + MP_EP_MAX_TOPK]; /* their FP8 scales */
  int *flag[MP_EP_MAX_DST];                 /* staging rows: the peer's ready flag, or NULL */
};

/* The data kernels' per-warp slots live in dynamic shared memory (the emulator has its own). */
#ifdef MP_EP_EMU
#define MP_DYN_SLOTS(T, name) T *name = (T *)emu_dynamic_smem()
#else
#define MP_DYN_SLOTS(T, name)                        \
  extern __shared__ __align__(16) char mp_dyn_smem[]; \
  T *name = (T *)mp_dyn_smem
#endif

/* |x| of the two BF16 values of w as float bits (sign cleared, NaN as 0 so that, as fmaxf does in
 * the CPU twin, a NaN never becomes the amax); non-negative floats order as their bits do. */
static __device__ __forceinline__ uint32_t umax32(uint32_t a, uint32_t b) { return a > b ? a : b; }

static __device__ __forceinline__ uint32_t bf16x2_absmax_bits(uint32_t w) {
  uint32_t lo = w & 0x7fffu, hi = (w >> 16) & 0x7fffu;
  lo = lo > 0x7f80u ? 0u : lo;
  hi = hi > 0x7f80u ? 0u : hi;
  return umax32(lo, hi) << 16;
}

/* Four BF16 pairs (one 16-byte vector) times inv to 8 e4m3 bytes. */
static __device__ __forceinline__ uint2 quant_bf16x8(uint4 r, float inv) {
  const uint32_t w[4] = {r.x, r.y, r.z, r.w};
  uint32_t q[4];
#pragma unroll
  for (int i = 0; i < 4; i++) q[i] = fp8x2_of(mp_bits_f32(w[i] << 16), mp_bits_f32(w[i] & 0xffff0000u), inv);
  return make_uint2(q[0] | (q[1] << 16), q[2] | (q[3] << 16));
}

/* FP8: a tile of 128 values is 8 lanes x 16 values (two 16-byte loads); a pass covers 4 tiles and
 * MP_FP8_PASSES passes are loaded before any is converted, so a lane has 2 * MP_FP8_PASSES loads in
 * flight. The kernel waits on those loads (one memory latency per round, a token takes
 * ntile / (4 * MP_FP8_PASSES) rounds), so the values stay packed in the loaded registers (no float
 * copies) to leave room for more of them. Every store is 16 bytes. */
#ifndef MP_FP8_PASSES
#define MP_FP8_PASSES 4
#endif
/* One round's loads: tiles [base, base + 4P) of the token, this lane's two vectors of each. */
static __device__ __forceinline__ void load_round(const uint16_t *xr, int ntile, int base, uint4 (&raw)[MP_FP8_PASSES][2]) {
  const int lane = MP_LANE, ql = lane & 7, grp = lane >> 3;
#pragma unroll
  for (int u = 0; u < MP_FP8_PASSES; u++) {
    const int tile = base + 4 * u + grp;
    const uint4 *src = (const uint4 *)(xr + tile * MP_EP_TILE + ql * 16);
    raw[u][0] = tile < ntile ? src[0] : make_uint4(0, 0, 0, 0);
    raw[u][1] = tile < ntile ? src[1] : make_uint4(0, 0, 0, 0);
  }
}

/* first: the first round, loaded by the caller before it planned the token (so that the plan's
 * latency and the first loads overlap) */
static __device__ __forceinline__ void pack_fp8(const mp_ep_view &v, const uint16_t *xr, const pack_slot &s,
                                                const uint4 (&first)[MP_FP8_PASSES][2]) {
  const int H = v.H, ntile = H / MP_EP_TILE, lane = MP_LANE, ql = lane & 7, grp = lane >> 3;
  const int nd = s.nd;
  constexpr int P = MP_FP8_PASSES;
  for (int base = 0; base < ntile; base += 4 * P) {
    uint4 raw[P][2];
    if (base == 0) {
#pragma unroll
      for (int u = 0; u < P; u++) raw[u][0] = first[u][0], raw[u][1] = first[u][1];
    } else {
      load_round(xr, ntile, base, raw);
    }
#pragma unroll
    for (int u = 0; u < P; u++) {
      const int tile = base + 4 * u + grp;
      uint32_t m = 0;
#pragma unroll
      for (int h = 0; h < 2; h++) {
        const uint4 r = raw[u][h];
        m = umax32(m, umax32(umax32(bf16x2_absmax_bits(r.x), bf16x2_absmax_bits(r.y)),
                             umax32(bf16x2_absmax_bits(r.z), bf16x2_absmax_bits(r.w))));
      }
#pragma unroll
      for (int off = 4; off > 0; off >>= 1) m = umax32(m, (uint32_t)__shfl_xor_sync(0xffffffffu, (int)m, off, 8));
      if (tile >= ntile) continue;
      const float amax = mp_bits_f32(m);
      const float scale = mp_ep_tile_scale(amax), inv = mp_ep_tile_inv(amax);
      const uint2 a = quant_bf16x8(raw[u][0], inv), b = quant_bf16x8(raw[u][1], inv);
      const uint4 qv = make_uint4(a.x, a.y, b.x, b.y);
      const long off = (long)tile * MP_EP_TILE + ql * 16;
      for (int d = 0; d < nd; d++) {
        *(uint4 *)(s.dst[d] + off) = qv;
        if (ql == 0) s.sc[d][tile] = scale;
      }
    }
  }
}

/* An input that came in FP8 (mplane_ep_dispatch_fp8): the row's bytes and scales as they are, to
 * every row the plan names. */
static __device__ void copy_fp8(const mp_ep_view &v, long row, const pack_slot &s) {
  const int ntile = v.H / MP_EP_TILE;
  warp_copy((const uint4 *)(v.xq + row * v.H), (uint4 *const *)s.dst, s.nd, v.H / 16);
  const float *sc = v.xq_scale + row * ntile;
  for (int j = MP_LANE; j < ntile; j += 32) {
    const float x = sc[j];
    for (int d = 0; d < s.nd; d++) s.sc[d][j] = x;
  }
}

/* Where a top-k slot's expert lives, seen from the packing GPU. */
enum { SLOT_NONE, SLOT_REMOTE, SLOT_PEER, SLOT_OWN }; /* dropped; another node; a GPU of this node; this GPU */

/* mp_ep_pack_plan_make and mp_ep_pack_plan_commit (ep_plan.h, the CPU model's planner) with a lane
 * per top-k slot (K <= 32): the same plan - staging rows in slot order of their first slot, expert
 * rows in slot order, the same fwd_pos and dest_rows entries. Why: in one thread the plan's K
 * dependent steps through shared and global memory took most of a token's ~15 us in pack (2x H200,
 * MP_EP_TRACE: tokens finished in waves 20 us apart), as the unpack plan's did (unpack_plan_warp). */
static __device__ void pack_plan_warp(const mp_ep_view &v, pack_slot &s) {
  mp_ep_pack_plan &p = s.p;
  const int lane = MP_LANE, K = v.K, G = v.G;
  const int *c = v.cnt;
  const mp_ep_cnt_layout &L = v.cl;
  int e = -1, cls = SLOT_NONE, nd = -1, jd = -1;
  if (lane < K) {
    e = s.row[lane];
    if (e >= v.E) e = -1;
    for (int i = 0; i < lane && e >= 0; i++)
      if (s.row[i] == e) e = -1; /* a repeat (the layout's copy has none; the model drops them too) */
    if (e >= 0) {
      const int d = mp_ep_expert_rank(&v, e);
      nd = v.node_of[d];
      jd = v.local_of[d];
      cls = nd != v.my_node ? SLOT_REMOTE : jd != v.my_local ? SLOT_PEER : SLOT_OWN;
    }
    s.eff[lane] = e < 0 ? -1 : e;
    s.cls[lane] = cls;
    s.node[lane] = nd;
    s.loc[lane] = jd;
  }
  if (lane < G) p.fwd[lane] = -1;
  __syncwarp();
  /* a staging row per remote node and per other GPU of this node, made by its first slot */
  bool first = cls == SLOT_REMOTE || cls == SLOT_PEER;
  const int key = cls == SLOT_REMOTE ? nd : jd;
  for (int i = 0; i < lane && first; i++)
    if (s.cls[i] == cls && (cls == SLOT_REMOTE ? s.node[i] : s.loc[i]) == key) first = false;
  const unsigned below = (1u << lane) - 1u;
  const unsigned made = __ballot_sync(0xffffffffu, first), own = __ballot_sync(0xffffffffu, cls == SLOT_OWN),
                 here = __ballot_sync(0xffffffffu, cls == SLOT_PEER || cls == SLOT_OWN);
  if (first) {
    const int at = __popc(made & below);
    if (cls == SLOT_REMOTE) {
      p.dst_buf[at] = MP_EP_BUF_P1S;
      p.dst_row[at] = c[L.off1s + nd] + s.nslot[lane];
      p.dst_node[at] = nd;
    } else {
      const int r2 = c[L.off2s + jd] + c[L.sub2s + jd * (v.N + 1) + v.my_node] + s.rrank[lane];
      p.dst_buf[at] = MP_EP_BUF_P2S;
      p.dst_row[at] = r2;
      p.dst_node[at] = v.my_node;
      p.fwd[jd] = r2;
    }
  }
  /* expert rows at this GPU, in slot order; the token's p2r entry and own-node row from the
   * last slot that names them (as the serial planner leaves them) */
  if (cls == SLOT_OWN) {
    const int at = __popc(own & below);
    p.exp_row[at] = mp_ep_expert_row(&v, c, v.my_local, v.my_node, e - v.me * v.Er, s.erank[lane]);
    p.exp_k[at] = lane;
    if (lane == 31 - __clz(own)) {
      p.entry = c[L.off2r + v.my_local] + c[L.sub2r + v.my_local * (v.N + 1) + v.my_node] + s.rrank[lane];
      p.fwd[v.my_local] = p.entry;
    }
  }
  if (here && lane == 31 - __clz(here)) p.v_self = c[L.off1r + v.my_node] + s.nslot[lane];
  if (lane == 0) {
    p.ndst = __popc(made);
    p.nexp = __popc(own);
    if (!own) p.entry = -1;
    if (!here) p.v_self = -1;
  }
  __syncwarp();
  /* commit: the index arrays combine needs */
  if (p.v_self >= 0 && lane < G) v.fwd_pos[(long)p.v_self * G + lane] = p.fwd[lane];
  if (p.entry >= 0 && lane < K) v.dest_rows[(long)p.entry * K + lane] = cls == SLOT_OWN ? p.exp_row[__popc(own & below)] : -1;
}

#ifdef MP_EP_EMU
/* The emulator checks every token's warp plan against the serial planner's (the CPU model's),
 * field by field, so each emulated case compares the two on all of its tokens. */
static void check_plan_twin(const mp_ep_view &v, const pack_slot &s, int t) {
  if (MP_LANE != 0) return;
  mp_ep_pack_plan q;
  mp_ep_pack_plan_make(&v, v.cnt, s.row, s.nslot, s.rrank, s.erank, &q);
  const mp_ep_pack_plan &p = s.p;
  bool same = p.ndst == q.ndst && p.nexp == q.nexp && p.entry == q.entry && p.v_self == q.v_self;
  for (int d = 0; same && d < q.ndst; d++)
    same = p.dst_buf[d] == q.dst_buf[d] && p.dst_row[d] == q.dst_row[d] && p.dst_node[d] == q.dst_node[d];
  for (int i = 0; same && i < q.nexp; i++) same = p.exp_row[i] == q.exp_row[i] && p.exp_k[i] == q.exp_k[i];
  for (int j = 0; same && j < v.G; j++) same = p.fwd[j] == q.fwd[j];
  if (!same) {
    fprintf(stderr, "emu: rank %d token %d: pack_plan_warp's plan differs from mp_ep_pack_plan_make's\n", v.me, t);
    emu_trap();
  }
}
#endif

/* mp_ep_meta_write with a lane per word group: the meta of a staging row bound for `node`. */
static __device__ void meta_write_warp(const mp_ep_view &v, int32_t *m, int t, const pack_slot &s, int node) {
  const int lane = MP_LANE, K = v.K;
  if (lane == 0) {
    m[0] = v.me;
    m[1] = t;
  }
  if (lane < K) {
    const int e = s.eff[lane];
    m[2 + lane] = e;
    m[2 + K + lane] = e >= 0 ? (int32_t)mp_f32_bits(s.w[lane]) : 0;
    m[2 + 2 * K + lane] = e >= 0 ? s.erank[lane] : -1;
  }
  if (lane < v.G) { /* the token's slot in (source, GPU lane of `node`)'s stream; the last slot's */
    int r = -1;
    for (int k = 0; k < K; k++)
      if (s.eff[k] >= 0 && s.node[k] == node && s.loc[k] == lane) r = s.rrank[k];
    m[2 + 3 * K + lane] = r;
  }
}

/* Source side, one token per warp: quantise it once and write it to every staging row its plan
 * names (one per remote node, one per other target GPU of the own node) and to its own expert
 * rows. epoch != 0 (fused direct dispatch): with `staged` the phase-2 rows go to the own p2s, each
 * with a ready flag (p2s_flag) that the kernel's link blocks wait for before they copy it to the
 * peer; without, straight into the peers' p2r, raising the peer's flag for each. */
static __device__ void pack_token(const mp_ep_view &v, const uint16_t *x, const float *w, int t, pack_slot &s,
                                  int epoch, bool staged, unsigned &ready) {
  mp_ep_pack_plan &p = s.p;
  const int lane = MP_LANE;
  const long tk = (long)t * v.K;
  const uint16_t *xr = v.xq ? NULL : x + (long)(t / v.expand) * v.H;
  uint4 first[MP_FP8_PASSES][2];
  if (v.fmt == MP_EP_FMT_FP8 && !v.xq) load_round(xr, v.H / MP_EP_TILE, 0, first);
  for (int k = lane; k < v.K; k += 32) {
    s.row[k] = v.topk[tk + k];
    s.nslot[k] = v.nslot_k[tk + k];
    s.rrank[k] = v.rrank_k[tk + k];
    s.erank[k] = v.erank_k[tk + k];
    s.w[k] = w[tk + k];
  }
  __syncwarp();
  pack_plan_warp(v, s);
#ifdef MP_EP_EMU
  check_plan_twin(v, s, t);
#endif
  const int ndst = p.ndst, nexp = p.nexp;
  if (ndst + nexp == 0) return;
  const long elem = v.fmt == MP_EP_FMT_FP8 ? 1 : 2;
  for (int d = lane; d < ndst; d += 32) {
    const bool p2 = p.dst_buf[d] == MP_EP_BUF_P2S;
    if (epoch && p2 && !staged && v.start_off) await_peer(v, p2s_target(v, p.dst_row[d]), epoch, ready);
    char *dst = !p2 ? v.p1s + (long)p.dst_row[d] * v.dstride
                : staged ? v.p2s + (long)p.dst_row[d] * v.dstride
                         : mp_ep_p2s_dst(&v, p.dst_row[d], v.dstride);
    s.dst[d] = dst;
    s.sc[d] = (float *)(dst + v.H);
    s.flag[d] = !epoch || !p2 ? NULL : staged ? v.p2s_flag + p.dst_row[d] : mp_ep_p2s_flag(&v, p.dst_row[d]);
  }
  __syncwarp();
  for (int d = 0; d < ndst; d++) meta_write_warp(v, (int32_t *)(s.dst[d] + v.meta_off), t, s, p.dst_node[d]);
  /* after the staging rows: the expert rows (not dropped), in plan order; with token rows
   * instead the token's own p2r entry, once, which the expert rows then name */
  const bool has = lane < nexp && p.exp_row[lane] >= 0;
  const unsigned ball = __ballot_sync(0xffffffffu, has);
  if (has) {
    const int r = p.exp_row[lane], at = ndst + __popc(ball & ((1u << lane) - 1u));
    v.ex_w[r] = s.w[p.exp_k[lane]];
    v.ex_src[2L * r] = v.me;
    v.ex_src[2L * r + 1] = t / v.expand;
    if (v.token_rows) {
      v.row_token[r] = p.entry;
    } else {
      s.dst[at] = (char *)(v.ex_x + (long)r * v.H * elem);
      s.sc[at] = v.ex_scale + (long)r * (v.H / MP_EP_TILE);
    }
  }
  const bool own = v.token_rows && p.entry >= 0;
  if (lane == 0) {
    if (own) {
      s.dst[ndst] = v.p2r + (long)p.entry * v.dstride;
      s.sc[ndst] = (float *)(s.dst[ndst] + v.H);
    }
    s.nd = ndst + (v.token_rows ? (own ? 1 : 0) : __popc(ball));
  }
  __syncwarp();
  if (v.xq) copy_fp8(v, t / v.expand, s);
  else if (v.fmt == MP_EP_FMT_FP8) pack_fp8(v, xr, s, first);
  else warp_copy((const uint4 *)xr, (uint4 *const *)s.dst, s.nd, v.H / 8);
  if (epoch) {
    __syncwarp(); /* every lane's stores of the rows come before the flags */
    for (int d = lane; d < ndst; d += 32) {
      if (!s.flag[d]) continue;
      if (staged) flag_raise_gpu(s.flag[d], epoch);
      else flag_raise(s.flag[d], epoch);
    }
  }
}

__global__ void __launch_bounds__(MP_EP_PACK_BLOCK, 1) k_pack(mp_ep_view v, const uint16_t *x, const float *w) {
  MP_DYN_SLOTS(pack_slot, slots);
  unsigned ready = 0;
  FOR_WARP_ITEMS(t, v.T) {
    pack_token(v, x, w, (int)t, slots[MP_WARP], 0, false, ready);
    __syncwarp();
  }
  if (v.direct) __threadfence_system(); /* peer rows written before the barrier */
}

/* An arrival's expert rows get its top-k weight for that expert and its source (rank, token);
 * with token rows (token >= 0) also the arrival's p2r entry, where its payload is. */
static __device__ void expert_row_meta(const mp_ep_view &v, const int32_t *m, const int *rows, const int *ks, int nexp,
                                       long token) {
  const int lane = MP_LANE;
  if (lane < nexp && rows[lane] >= 0) {
    const int r = rows[lane];
    v.ex_w[r] = mp_bits_f32((uint32_t)m[2 + v.K + ks[lane]]);
    v.ex_src[2L * r] = m[0];
    v.ex_src[2L * r + 1] = m[1] / v.expand;
    if (token >= 0) v.row_token[r] = (int32_t)token;
  }
}

/* Expert rows from a wire row (payload, scales, weight, source): forward and unpack share it. */
static __device__ void warp_expert_rows(const mp_ep_view &v, const char *src, const int32_t *m, const int *rows,
                                        const int *ks, int nexp, uint4 **dst) {
  const int H = v.H, ntile = H / MP_EP_TILE, lane = MP_LANE;
  const long elem = v.fmt == MP_EP_FMT_FP8 ? 1 : 2;
  /* dst (the warp's scratch in shared memory): the rows not dropped, in order */
  const bool has = lane < nexp && rows[lane] >= 0;
  const unsigned ball = __ballot_sync(0xffffffffu, has);
  if (has) dst[__popc(ball & ((1u << lane) - 1u))] = (uint4 *)(v.ex_x + (long)rows[lane] * H * elem);
  __syncwarp();
  warp_copy((const uint4 *)src, dst, __popc(ball), (int)(H * elem / 16));
  if (v.fmt == MP_EP_FMT_FP8) {
    const float *sc = (const float *)(src + H);
    for (int j = lane; j < ntile; j += 32) {
      const float s = sc[j];
      for (int e = 0; e < nexp; e++)
        if (rows[e] >= 0) v.ex_scale[(long)rows[e] * ntile + j] = s;
    }
  }
  expert_row_meta(v, m, rows, ks, nexp, -1);
}

/* Forwarder: each phase-1 row from a remote node goes to the other target GPUs of this node
 * (phase-2 staging rows) and, when this GPU is a target, straight into its expert rows. */
__global__ void __launch_bounds__(MP_EP_BLOCK, 1) k_forward(mp_ep_view v) {
  __shared__ mp_ep_fwd_plan plans[MP_EP_WARPS];
  __shared__ int gos[MP_EP_WARPS];
  __shared__ uint4 *scratch[MP_EP_WARPS][MP_EP_MAX_TOPK];
  __shared__ int32_t metas[MP_EP_WARPS][2 + 3 * MP_EP_MAX_TOPK + MP_EP_MAX_GPN];
  mp_ep_fwd_plan &p = plans[MP_WARP];
  int32_t *m = metas[MP_WARP]; /* the row's meta, copied by the whole warp before planning */
  const long n1 = v.cnt[v.cl.off1r + v.N];
  FOR_WARP_ITEMS(i, n1) {
    const char *src = v.p1r + i * v.dstride;
    if (MP_LANE == 0) {
      int seg;
      gos[MP_WARP] = mp_ep_p1r_valid(&v, v.cnt, i, &seg) && seg != v.my_node;
    }
    __syncwarp();
    if (gos[MP_WARP]) {
      const int32_t *gm = (const int32_t *)(src + v.meta_off);
      for (int q = MP_LANE; q < mp_ep_meta_words(v.K, v.G); q += 32) m[q] = gm[q];
    }
    __syncwarp();
    if (MP_LANE == 0 && gos[MP_WARP]) {
      mp_ep_fwd_plan_make(&v, v.cnt, m, &p);
      mp_ep_fwd_plan_commit(&v, i, &p);
    }
    __syncwarp();
    if (gos[MP_WARP]) {
      uint4 *dst[MP_EP_MAX_GPN + 1];
      for (int d = 0; d < p.ndst; d++) dst[d] = (uint4 *)mp_ep_p2s_dst(&v, p.dst_row[d], v.dstride);
      if (v.token_rows && p.entry >= 0) dst[p.ndst] = (uint4 *)(v.p2r + (long)p.entry * v.dstride);
      const int own = v.token_rows && p.entry >= 0 ? 1 : 0;
      warp_copy((const uint4 *)src, dst, p.ndst + own, (int)(v.dstride / 16));
      if (v.token_rows) expert_row_meta(v, m, p.exp_row, p.exp_k, p.nexp, p.entry);
      else warp_expert_rows(v, src, m, p.exp_row, p.exp_k, p.nexp, scratch[MP_WARP]);
    }
    __syncwarp();
  }
  if (v.direct) __threadfence_system(); /* peer rows written before the barrier */
}

/* Per warp: one arrival's meta words (copied in by the whole warp at once) and the expert rows
 * (and top-k slots) it goes to. */
struct unpack_slot {
  int32_t m[2 + 3 * MP_EP_MAX_TOPK + MP_EP_MAX_GPN];
  int rows[MP_EP_MAX_TOPK], ks[MP_EP_MAX_TOPK];
  int n;
  uint4 *dst[MP_EP_MAX_TOPK];
};

/* mp_ep_unpack_plan with a lane per top-k slot (K <= 32): the same rows, in the same (slot) order,
 * and the same dest_rows entries. Why: in one thread the K dependent load/store pairs took about
 * 10 us a row (the planner's stores may alias its loads), the whole of a token-rows unpack. */
static __device__ void unpack_plan_warp(const mp_ep_view &v, long u, unpack_slot &s) {
  const int lane = MP_LANE, K = v.K, src = s.m[0];
  int r = -1;
  if (lane < K) {
    const int e = s.m[2 + lane];
    if (e >= 0 && mp_ep_expert_rank(&v, e) == v.me)
      r = mp_ep_expert_row(&v, v.cnt, v.local_of[src], v.node_of[src], e - v.me * v.Er, s.m[2 + 2 * K + lane]);
    v.dest_rows[u * K + lane] = r;
  }
  const unsigned ball = __ballot_sync(0xffffffffu, r >= 0);
  if (r >= 0) {
    const int at = __popc(ball & ((1u << lane) - 1u));
    s.rows[at] = r;
    s.ks[at] = lane;
  }
  if (lane == 0) s.n = __popc(ball);
}

/* Destination, one p2r row per warp: a row from one of the node's other forwarders goes into its
 * expert rows. epoch != 0 (fused direct dispatch): wait for the row's flag first. */
static __device__ void unpack_row(const mp_ep_view &v, long u, unpack_slot &s, int epoch) {
  const char *src = v.p2r + u * v.dstride;
  if (MP_LANE == 0) {
    int seg;
    s.n = 0;
    if (mp_ep_p2r_valid(&v, v.cnt, u, &seg) && seg != v.my_local) {
      if (epoch && !flag_wait(v.p2r_flag + u, epoch)) flag_timeout(v, u, seg);
      s.n = 1;
    }
  }
  __syncwarp();
  if (s.n == 0) return;
  const int32_t *m = (const int32_t *)(src + v.meta_off);
  for (int i = MP_LANE; i < mp_ep_meta_words(v.K, v.G); i += 32) s.m[i] = m[i];
  __syncwarp();
  unpack_plan_warp(v, u, s);
  __syncwarp();
  if (s.n <= 0) return;
  if (v.token_rows) expert_row_meta(v, s.m, s.rows, s.ks, s.n, u); /* the payload stays where it arrived */
  else warp_expert_rows(v, src, s.m, s.rows, s.ks, s.n, s.dst);
}

__global__ void __launch_bounds__(MP_EP_BLOCK, 1) k_unpack(mp_ep_view v) {
  MP_DYN_SLOTS(unpack_slot, slots);
  const long n2 = v.cnt[v.cl.off2r + v.G];
  FOR_WARP_ITEMS(u, n2) {
    unpack_row(v, u, slots[MP_WARP], 0);
    __syncwarp();
  }
}

/* Link side of the fused dispatch: a warp takes MP_EP_LINK_BATCH consecutive p2s rows. Rows of one
 * segment are consecutive at the peer too, so each run of them (a batch is one run unless it
 * crosses a segment end) is one copy: lane 0 resolves the run's segment and peer address once and
 * waits until a pack block has staged each row, the warp copies the run into the peer's p2r over
 * NVLink, and lane 0 raises the run's flags at the peer behind one system-scope fence. Why: the
 * fence waits until every earlier NVLink store of the warp is acknowledged, and resolving a row's
 * address is a chain of dependent loads; per row, both left the link at about 224 GB/s (2x H200,
 * in-kernel timestamps), against 310 GB/s for 8 SMs that only copy. */
#ifndef MP_EP_LINK_BATCH
#define MP_EP_LINK_BATCH 8
#endif
struct link_run {
  long rows, next; /* rows to copy from the run's start, rows to step over (padding, own segment) */
  char *dst;       /* the first row's place at the peer */
  int *flag;       /* its ready flag there */
};

/* Lane 0: the run starting at p2s row `row`, at most up to `last`; waits for its rows. */
static __device__ void link_run_plan(const mp_ep_view &v, long row, long last, int epoch, link_run &r,
                                     unsigned &ready) {
  const int *c = v.cnt;
  const mp_ep_cnt_layout &L = v.cl;
  const int seg = mp_ep_seg_find(c + L.off2s, v.G, row);
  const long seg_end = c[L.off2s + seg + 1], valid_end = c[L.off2s + seg] + c[L.sub2s + seg * (v.N + 1) + v.N];
  const long end = last < seg_end ? last : seg_end;
  r.next = end - row;
  r.rows = seg == v.my_local ? 0 : (end < valid_end ? end : valid_end) - row; /* the own segment is virtual */
  if (r.rows < 0) r.rows = 0;
  if (r.rows == 0) return;
  if (v.start_off) await_peer(v, seg, epoch, ready);
  r.dst = mp_ep_p2s_dst(&v, row, v.dstride);
  r.flag = mp_ep_p2s_flag(&v, row);
  for (long i = 0; i < r.rows; i++)
    if (!flag_wait(v.p2s_flag + row + i, epoch, false)) flag_timeout(v, row + i, seg, true);
}

static __device__ void link_rows(const mp_ep_view &v, long first, long n2s, int epoch, link_run &r, unsigned &ready) {
  const long last = first + MP_EP_LINK_BATCH < n2s ? first + MP_EP_LINK_BATCH : n2s;
  for (long row = first; row < last;) {
    if (MP_LANE == 0) link_run_plan(v, row, last, epoch, r, ready);
    __syncwarp();
    const long n = r.rows, next = r.next;
    if (n > 0) {
      uint4 *dst[1] = {(uint4 *)r.dst};
      warp_copy((const uint4 *)(v.p2s + row * v.dstride), dst, 1, (int)(n * v.dstride / 16));
      __syncwarp(); /* every lane's stores of the run come before the fence */
      if (MP_LANE == 0) {
        __threadfence_system();
        for (long i = 0; i < n; i++) flag_store_relaxed(r.flag + i, epoch);
      }
    }
    __syncwarp();
    row += next;
  }
}

/* MP_EP_TRACE (a debug build: scripts/ep-bench.sh with EP_NVCC_FLAGS=-DMP_EP_TRACE): each fused
 * launch prints, from the block that ends last, when the last pack, link and unpack block ended
 * after the first block began, and how many tokens were packed, link batches copied and peer rows
 * unpacked by each 10 us step - the timeline the link and unpack tails were found with. */
#if defined(MP_EP_TRACE) && !defined(MP_EP_EMU)
#define MP_TRACE_ITEMS 16384
__device__ unsigned long long mp_trace_t0[1024], mp_trace_t1[1024];
__device__ unsigned long long mp_trace_item[3][MP_TRACE_ITEMS]; /* pack token, link batch, unpack row */
__device__ unsigned mp_trace_done;
static __device__ unsigned long long trace_now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
static __device__ void trace_begin(int b) {
  if (MP_TID == 0 && b < 1024) mp_trace_t0[b] = trace_now();
}
/* lane 0: item i of kind k (0 pack, 1 link, 2 unpack) is done */
static __device__ void trace_item(int k, long i) {
  if (MP_LANE == 0 && i < MP_TRACE_ITEMS) mp_trace_item[k][i] = trace_now();
}
static __device__ void trace_end(const mp_ep_view &v, int b, int pack_blocks, int link_blocks) {
  __syncthreads();
  if (MP_TID != 0 || b >= 1024) return;
  mp_trace_t1[b] = trace_now();
  __threadfence();
  if (atomicAdd(&mp_trace_done, 1) != gridDim.x - 1) return;
  __threadfence();
  unsigned long long s0 = ~0ull, end[3] = {0, 0, 0};
  for (int i = 0; i < (int)gridDim.x && i < 1024; i++) {
    s0 = mp_trace_t0[i] < s0 ? mp_trace_t0[i] : s0;
    const int k = i < pack_blocks ? 0 : i < pack_blocks + link_blocks ? 1 : 2;
    end[k] = mp_trace_t1[i] > end[k] ? mp_trace_t1[i] : end[k];
  }
  printf("MP_EP_TRACE rank %d fused dispatch (%s in, %s rows, %s): pack %.1f link %.1f unpack %.1f us\n", v.me,
         v.xq ? "FP8" : "BF16", v.token_rows ? "token" : "expert", v.fmt == MP_EP_FMT_FP8 ? "FP8" : "BF16",
         (end[0] - s0) / 1e3, end[1] ? (end[1] - s0) / 1e3 : 0.0, (end[2] - s0) / 1e3);
  const long n2s = v.cnt[v.cl.off2s + v.G], n2r = v.cnt[v.cl.off2r + v.G];
  const long n[3] = {v.T, (n2s + MP_EP_LINK_BATCH - 1) / MP_EP_LINK_BATCH, n2r};
  static const char *kind[3] = {"packed", "linked", "unpacked"};
  for (int k = 0; k < 3; k++) {
    int h[20] = {0};
    for (long i = 0; i < n[k] && i < MP_TRACE_ITEMS; i++) {
      const unsigned long long t = mp_trace_item[k][i];
      if (t < s0) continue; /* not traced this launch (a skipped row) */
      const long bin = (long)((t - s0) / 10000);
      h[bin < 19 ? bin : 19]++;
      mp_trace_item[k][i] = 0;
    }
    printf("MP_EP_TRACE rank %d %s of %ld by 10us: %d %d %d %d %d %d %d %d %d %d %d %d %d %d %d %d %d %d %d %d\n",
           v.me, kind[k], n[k], h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7], h[8], h[9], h[10], h[11], h[12], h[13],
           h[14], h[15], h[16], h[17], h[18], h[19]);
  }
  mp_trace_done = 0;
}
#else
static __device__ void trace_begin(int) {}
static __device__ void trace_item(int, long) {}
static __device__ void trace_end(const mp_ep_view &, int, int, int) {}
#endif

/* Fused direct dispatch (one node, nvlink_direct), up to three kinds of blocks:
 *   [0, pack_blocks): pack - quantise each token once, write its own expert rows (or token row)
 *     and the rows for the node's other GPUs: staged in the own p2s with a flag per row when there
 *     are link blocks, else straight into the peers' p2r, raising the peer's flag per row;
 *   [pack_blocks, pack_blocks + link_blocks): link - copy each staged row into its peer's p2r over
 *     NVLink as soon as it is staged, and raise the peer's flag;
 *   the rest: unpack - the rows the peers write here, as their flags rise.
 * Why link blocks: a pack warp that also writes over NVLink waits, per token, for the system
 * fence behind its flag (every NVLink store acknowledged). With token rows (little to unpack)
 * staging wins (2x H200, FP8, before the start handshake: 165-171 us vs 173-179); with expert rows
 * the pack blocks also copy the own tokens' expert rows, and writing straight to the peer wins
 * (172-175 vs 199-210): the defaults follow (MPLANE_EP_LINK_SMS). Blocks wait only on lower-numbered
 * blocks (pack never waits, link waits on pack, unpack on the peers): a GPU starts blocks in
 * order, the CPU emulator runs them in order. */
__global__ void __launch_bounds__(MP_EP_PACK_BLOCK, 1) k_dispatch_fused(mp_ep_view v, const uint16_t *x, const float *w,
                                                                    int pack_blocks, int link_blocks, int host_epoch) {
  const int epoch = host_epoch ? host_epoch : *v.epoch, b = (int)blockIdx.x;
  unsigned ready = 0; /* local GPUs whose start flag this thread has seen */
  trace_begin(b);
  if (b == 0 && v.start_off) { /* before any warp of the block can wait (the emulator runs one at a time) */
    if (MP_WARP == 0) announce_start(v, epoch);
    __syncthreads();
  }
  if (b < pack_blocks) {
    MP_DYN_SLOTS(pack_slot, slots);
    FOR_ITEMS(t, v.T, b, pack_blocks) {
      pack_token(v, x, w, (int)t, slots[MP_WARP], epoch, link_blocks > 0, ready);
      __syncwarp();
      trace_item(0, t);
    }
  } else if (b < pack_blocks + link_blocks) {
    __shared__ link_run runs[MP_EP_PACK_BLOCK / 32];
    const long n2s = v.cnt[v.cl.off2s + v.G], nbatch = (n2s + MP_EP_LINK_BATCH - 1) / MP_EP_LINK_BATCH;
    FOR_ITEMS(i, nbatch, b - pack_blocks, link_blocks) {
      link_rows(v, i * MP_EP_LINK_BATCH, n2s, epoch, runs[MP_WARP], ready);
      __syncwarp();
      trace_item(1, i);
    }
  } else {
    MP_DYN_SLOTS(unpack_slot, slots);
    const long n2 = v.cnt[v.cl.off2r + v.G];
    const int ub = pack_blocks + link_blocks;
    FOR_ITEMS(u, n2, b - ub, gridDim.x - ub) {
      unpack_row(v, u, slots[MP_WARP], epoch);
      __syncwarp();
      trace_item(2, u);
    }
  }
  trace_end(v, b, pack_blocks, link_blocks);
}

/* One thread: the next dispatch's epoch (every rank bumps its own once per fused dispatch, so the
 * ranks agree on it without talking). */
__global__ void k_epoch_bump(int *epoch) {
  if (MP_TID == 0) *epoch = mp_ep_next_epoch(*epoch);
}

/* ---------------- combine ---------------- */

/* At the expert's GPU: per arrival, the weighted sum of its local experts' outputs, rounded to
 * BF16 once, into the phase-2 row it arrived on (sent back to its forwarder). */
/* Values [8c, 8c + 8) of an arrival's weighted sum over its nr expert rows (rows, wts), FP32 in
 * row order, rounded to BF16 once. */
static __device__ __forceinline__ uint4 expert_sum_chunk(const uint16_t *y, int H, const int *rows, const float *wts,
                                                         int nr, int c) {
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  uint4 yv[MP_EP_MAX_TOPK > 8 ? 8 : MP_EP_MAX_TOPK];
  for (int k0 = 0; k0 < nr; k0 += 8) {
    const int kn = nr - k0 < 8 ? nr - k0 : 8;
    for (int k = 0; k < kn; k++) yv[k] = ((const uint4 *)(y + (long)rows[k0 + k] * H))[c];
    for (int k = 0; k < kn; k++) {
      float f[8];
      unpack_bf16x8(yv[k], f);
#pragma unroll
      for (int q = 0; q < 8; q++) acc[q] = __fmaf_rn(wts[k0 + k], f[q], acc[q]);
    }
  }
  return pack_bf16x8(acc);
}

/* lane 0: the expert rows of p2r entry u (rows, wts, in top-k order); their count */
static __device__ int entry_rows(const mp_ep_view &v, long u, int *rows, float *wts) {
  int n = 0;
  for (int k = 0; k < v.K; k++) {
    const int r = v.dest_rows[u * v.K + k];
    if (r < 0) continue;
    rows[n] = r;
    wts[n] = v.ex_w[r];
    n++;
  }
  return n;
}

__global__ void __launch_bounds__(MP_EP_BLOCK, 1) k_combine_expert(mp_ep_view v, const uint16_t *y) {
  __shared__ int rows[MP_EP_WARPS][MP_EP_MAX_TOPK];
  __shared__ float wts[MP_EP_WARPS][MP_EP_MAX_TOPK];
  __shared__ int nrs[MP_EP_WARPS];
  const int H = v.H, wp = MP_WARP, lane = MP_LANE;
  const long n2 = v.cnt[v.cl.off2r + v.G];
  FOR_WARP_ITEMS(u, n2) {
    if (lane == 0) {
      int seg, n = -1;
      if (mp_ep_p2r_valid(&v, v.cnt, u, &seg)) n = entry_rows(v, u, rows[wp], wts[wp]); /* padding: no indices */
      nrs[wp] = n;
    }
    __syncwarp();
    const int nr = nrs[wp];
    if (nr >= 0) {
      uint4 *dst = (uint4 *)(v.p2r + u * v.cstride);
      for (int c = lane; c < H / 8; c += 32) dst[c] = expert_sum_chunk(y, H, rows[wp], wts[wp], nr, c);
    }
    __syncwarp();
  }
}

/* At the forwarder: per phase-1 row, the sum over the node's target GPUs, ascending local index,
 * rounded to BF16 once, into the phase-1 row (sent back to the source). */
__global__ void __launch_bounds__(MP_EP_BLOCK, 1) k_combine_node(mp_ep_view v) {
  __shared__ const char *srcs[MP_EP_WARPS][MP_EP_MAX_GPN];
  __shared__ int ns[MP_EP_WARPS];
  const int H = v.H, wp = MP_WARP, lane = MP_LANE;
  const long n1 = v.cnt[v.cl.off1r + v.N];
  FOR_WARP_ITEMS(i, n1) {
    if (lane == 0) {
      int seg, n = -1;
      if (mp_ep_p1r_valid(&v, v.cnt, i, &seg)) {
        n = 0;
        for (int j = 0; j < v.G; j++) {
          const int pos = v.fwd_pos[i * v.G + j];
          if (pos >= 0) srcs[wp][n++] = (j == v.my_local ? v.p2r : v.p2s) + (long)pos * v.cstride;
        }
      }
      ns[wp] = n;
    }
    __syncwarp();
    const int n = ns[wp];
    if (n >= 0) {
      uint4 *dst = (uint4 *)(v.p1r + i * v.cstride);
      for (int c = lane; c < H / 8; c += 32) {
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        uint4 sv[MP_EP_MAX_GPN];
        for (int j = 0; j < n; j++) sv[j] = ((const uint4 *)srcs[wp][j])[c];
        for (int j = 0; j < n; j++) {
          float f[8];
          unpack_bf16x8(sv[j], f);
#pragma unroll
          for (int q = 0; q < 8; q++) acc[q] = __fadd_rn(acc[q], f[q]);
        }
        dst[c] = pack_bf16x8(acc);
      }
    }
    __syncwarp();
  }
}

/* At the source: per token, the sum over its nodes, ascending, rounded to BF16 once. */
__global__ void __launch_bounds__(MP_EP_BLOCK, 1) k_combine_out(mp_ep_view v, uint16_t *out) {
  __shared__ const char *srcs[MP_EP_WARPS][MP_EP_MAX_TOPK];
  __shared__ int ns[MP_EP_WARPS];
  const int H = v.H, Treal = v.T / v.expand, wp = MP_WARP, lane = MP_LANE;
  FOR_WARP_ITEMS(ti, Treal) {
    const int t = (int)ti;
    if (lane == 0) {
      int n = 0;
      for (int q = t * v.expand; q < (t + 1) * v.expand; q++) {
        int bufs[MP_EP_MAX_TOPK];
        long rws[MP_EP_MAX_TOPK];
        const int c = mp_ep_out_sources(&v, v.cnt, q, v.topk + (long)q * v.K, bufs, rws);
        for (int i = 0; i < c && n < MP_EP_MAX_TOPK; i++)
          srcs[wp][n++] = (bufs[i] == MP_EP_BUF_P1R ? v.p1r : v.p1s) + rws[i] * v.cstride;
      }
      ns[wp] = n;
    }
    __syncwarp();
    const int n = ns[wp];
    uint4 *dst = (uint4 *)(out + (long)t * H);
    for (int c = lane; c < H / 8; c += 32) {
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int i0 = 0; i0 < n; i0 += 8) {
        uint4 sv[8];
        const int kn = n - i0 < 8 ? n - i0 : 8;
        for (int i = 0; i < kn; i++) sv[i] = ((const uint4 *)srcs[wp][i0 + i])[c];
        for (int i = 0; i < kn; i++) {
          float f[8];
          unpack_bf16x8(sv[i], f);
#pragma unroll
          for (int q = 0; q < 8; q++) acc[q] = __fadd_rn(acc[q], f[q]);
        }
      }
      dst[c] = pack_bf16x8(acc);
    }
    __syncwarp();
  }
}

/* ---------------- fused direct combine (one node, nvlink_direct) ----------------
 * Two kinds of blocks in one kernel, no NCCL call and no staging pass:
 *   [0, expert_blocks): per arrival from a peer (its p2r entries), the weighted sum over this
 *     GPU's experts (as k_combine_expert), written straight into the peer's p2s row the token left
 *     from (CUDA IPC), whose flag at the peer then rises to the combine's epoch;
 *   the rest: per own token, the sum over the node's GPUs in ascending local index, rounded once,
 *     then once more as the sum over its one node (k_combine_node, then k_combine_out): the own
 *     GPU's part computed in place, the peers' read from the own p2s as their flags rise.
 * Bit for bit the staged combine's result. Why: that one runs its expert sums, NCCL's send back
 * and the two sums one after another (~500 us at the DeepSeek-V3 shape on 2x H200, 230 in NCCL).
 * A send warp writes into a peer's p2s only after the peer said its combine started (its earlier
 * combine and its dispatch no longer read it): a second combine of one dispatch must not overwrite
 * rows the peer's first one still sums. */

/* The start of local peer j's p2s segment for this GPU (announced in the dispatch's handshake). */
static __device__ long peer_p2s_start(const mp_ep_view &v, int j) {
  return v.p2r_flag[mp_ep_p2s_starts_at(&v, v.rank_of[v.my_node * v.G + j]) + v.my_local];
}

/* Block 0, warp 0, first thing: tell every local peer this GPU's combine started - its p2s (where
 * the peers write) is no longer read by an earlier combine or dispatch of this GPU (stream order). */
static __device__ void announce_combine(const mp_ep_view &v, int cepoch) {
  for (int j = MP_LANE; j < v.G; j += 32)
    if (j != v.my_local) flag_raise(v.peer_flag[j] + mp_ep_combine_start_at(&v, v.me), cepoch);
  __syncwarp();
}

/* Lane 0 of a send warp, before its first write into local peer j: j's combine has started. */
static __device__ void await_combine(const mp_ep_view &v, int j, int cepoch, unsigned &cready) {
  if ((cready >> j) & 1u) return;
  const int r = v.rank_of[v.my_node * v.G + j];
  if (!flag_wait(v.p2r_flag + mp_ep_combine_start_at(&v, r), cepoch)) {
    printf("libmplane-ep: rank %d waited %d s for local GPU %d (rank %d) to start its nvlink_direct combine: the "
           "peer process died or never called mplane_ep_combine\n", v.me, (int)(MP_EP_WAIT_NS / 1000000000ll), j, r);
    kernel_fail();
  }
  cready |= 1u << j;
}

static __device__ void combine_timeout(const mp_ep_view &v, long row, int j) {
  printf("libmplane-ep: rank %d waited %d s for local GPU %d's combine sum into its p2s row %ld: the peer process "
         "died or never called mplane_ep_combine\n", v.me, (int)(MP_EP_WAIT_NS / 1000000000ll), j, row);
  kernel_fail();
}

/* 512 threads a block: 1024 left 64 registers a thread and the sums spilled */
#define MP_EP_CF_BLOCK 512
#define MP_EP_CF_WARPS (MP_EP_CF_BLOCK / 32)
__global__ void __launch_bounds__(MP_EP_CF_BLOCK, 1) k_combine_fused(mp_ep_view v, const uint16_t *y, uint16_t *out,
                                                                  int expert_blocks, int host_depoch, int host_cepoch) {
  __shared__ int rows[MP_EP_CF_WARPS][MP_EP_MAX_TOPK];
  __shared__ float wts[MP_EP_CF_WARPS][MP_EP_MAX_TOPK];
  __shared__ int nrs[MP_EP_CF_WARPS], nss[MP_EP_CF_WARPS];
  __shared__ uint4 *dsts[MP_EP_CF_WARPS];
  __shared__ int *flags[MP_EP_CF_WARPS];
  __shared__ const uint4 *srcs[MP_EP_CF_WARPS][MP_EP_MAX_GPN]; /* NULL: the own GPU's part */
  const int depoch = host_depoch ? host_depoch : *v.epoch, cepoch = host_cepoch ? host_cepoch : *v.cepoch;
  const int H = v.H, wp = MP_WARP, lane = MP_LANE, b = (int)blockIdx.x;
  unsigned ready = 0, cready = 0;
  if (b == 0) { /* before any warp of the block can wait (the emulator runs one block at a time) */
    if (wp == 0) announce_combine(v, cepoch);
    __syncthreads();
  }
  if (b < expert_blocks) {
    const long n2 = v.cnt[v.cl.off2r + v.G];
    FOR_ITEMS(u, n2, b, expert_blocks) {
      if (lane == 0) {
        int seg, n = -1;
        if (mp_ep_p2r_valid(&v, v.cnt, u, &seg) && seg != v.my_local) {
          if (v.start_off) await_peer(v, seg, depoch, ready); /* its p2s starts came with its start flag */
          await_combine(v, seg, cepoch, cready);
          const long pr = peer_p2s_start(v, seg) + (u - v.cnt[v.cl.off2r + seg]);
          dsts[wp] = (uint4 *)(v.peer_p2s[seg] + pr * v.cstride);
          flags[wp] = v.peer_flag[seg] + v.cflag_off + pr;
          n = entry_rows(v, u, rows[wp], wts[wp]);
        }
        nrs[wp] = n;
      }
      __syncwarp();
      const int nr = nrs[wp];
      if (nr >= 0) {
        uint4 *dst = dsts[wp];
        for (int c = lane; c < H / 8; c += 32) dst[c] = expert_sum_chunk(y, H, rows[wp], wts[wp], nr, c);
        __syncwarp(); /* every lane's stores of the row come before its flag */
        if (lane == 0) flag_raise(flags[wp], cepoch);
      }
      __syncwarp();
    }
    return;
  }
  FOR_ITEMS(ti, v.T, b - expert_blocks, gridDim.x - expert_blocks) {
    const int t = (int)ti;
    if (lane == 0) {
      int n = 0, nr = 0, k = 0;
      const int32_t *row = v.topk + (long)t * v.K; /* the layout's ids: dropped and repeated slots are -1 */
      while (k < v.K && (row[k] < 0 || row[k] >= v.E)) k++;
      if (k < v.K) { /* one node: the token's one own-node row (mp_ep_out_sources) */
        const long i = v.cnt[v.cl.off1r + v.my_node] + v.nslot_k[(long)t * v.K + k];
        for (int j = 0; j < v.G; j++) {
          const int pos = v.fwd_pos[i * v.G + j];
          if (pos < 0) continue;
          if (j == v.my_local) {
            srcs[wp][n++] = NULL;
            nr = entry_rows(v, pos, rows[wp], wts[wp]);
          } else {
            if (!flag_wait(v.p2r_flag + v.cflag_off + pos, cepoch)) combine_timeout(v, pos, j);
            srcs[wp][n++] = (const uint4 *)(v.p2s + (long)pos * v.cstride);
          }
        }
      }
      nss[wp] = n;
      nrs[wp] = nr;
    }
    __syncwarp();
    const int n = nss[wp], nr = nrs[wp];
    uint4 *dst = (uint4 *)(out + (long)t * H);
    for (int c = lane; c < H / 8; c += 32) {
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, f[8];
      const uint4 own = nr > 0 ? expert_sum_chunk(y, H, rows[wp], wts[wp], nr, c) : make_uint4(0, 0, 0, 0);
      for (int s = 0; s < n; s++) {
        unpack_bf16x8(srcs[wp][s] ? srcs[wp][s][c] : own, f);
#pragma unroll
        for (int q = 0; q < 8; q++) acc[q] = __fadd_rn(acc[q], f[q]);
      }
      unpack_bf16x8(pack_bf16x8(acc), f); /* the node's sum, rounded; then the sum over the one node */
#pragma unroll
      for (int q = 0; q < 8; q++) f[q] = __fadd_rn(0.f, f[q]);
      dst[c] = pack_bf16x8(f);
    }
    __syncwarp();
  }
}

/* ---------------- helpers ---------------- */

/* Where expert row r's payload and FP8 scales are: its own row, or with token rows the p2r entry
 * it names. 0 for an entry that names no row. */
static __device__ int expert_row_src(const mp_ep_view &v, long r, const uint8_t **x, const float **sc) {
  const int H = v.H;
  if (!v.token_rows) {
    *x = v.ex_x + r * H * (v.fmt == MP_EP_FMT_FP8 ? 1 : 2);
    *sc = v.ex_scale + r * (H / MP_EP_TILE);
    return 1;
  }
  const int u = v.row_token[r];
  if (u < 0 || u >= v.cnt[v.cl.off2r + v.G]) return 0;
  *x = (const uint8_t *)v.p2r + (long)u * v.dstride;
  *sc = (const float *)(*x + H);
  return 1;
}

__global__ void __launch_bounds__(MP_EP_BLOCK, 1) k_dequant(mp_ep_view v, uint16_t *y) {
  const int H = v.H, lane = MP_LANE;
  long rows = v.cnt[v.cl.status + MP_EP_ST_EXTOTAL];
  if (rows > v.cap_rows) rows = v.cap_rows;
  FOR_WARP_ITEMS(r, rows) {
    uint4 *dst = (uint4 *)(y + r * H);
    const uint8_t *x;
    const float *sc;
    if (!expert_row_src(v, r, &x, &sc)) { /* a token row that was never written: zeros */
      for (int c = lane; c < H / 8; c += 32) dst[c] = make_uint4(0, 0, 0, 0);
      continue;
    }
    if (v.fmt == MP_EP_FMT_FP8) {
      const uint2 *q2 = (const uint2 *)x;
      for (int c = lane; c < H / 8; c += 32) {
        const float s = sc[(c * 8) / MP_EP_TILE];
        const uint2 q = q2[c];
        float f[8];
#pragma unroll
        for (int i = 0; i < 4; i++) {
          f[i] = mp_bf16_to_f32(mp_ep_dequant_bf16((uint8_t)(q.x >> (8 * i)), s));
          f[4 + i] = mp_bf16_to_f32(mp_ep_dequant_bf16((uint8_t)(q.y >> (8 * i)), s));
        }
        dst[c] = pack_bf16x8(f);
      }
    } else {
      uint4 *d1[1] = {dst};
      warp_copy((const uint4 *)x, d1, 1, H / 8);
    }
  }
}

/* DeepSeek-V3 gating, one warp per token (ep_ref.c's mp_ep_route_ref is the CPU twin). */
__global__ void k_route(const float *logits, const float *bias, int T, int E, int K, int groups, int topk_groups,
                        float scaling, int normalize, int32_t *idx, float *wout) {
#ifdef MP_EP_EMU
  float *sm = (float *)emu_dynamic_smem();
#else
  extern __shared__ float sm[];
#endif
  const int lane = MP_TID & 31, warp = MP_TID >> 5, wpb = MP_BDIM >> 5;
  const int t = blockIdx.x * wpb + warp;
  /* per warp: b[E], s[E], group score[groups], availability bytes[E] (+ group keep bytes) */
  float *b = sm + (long)warp * (2 * E + groups + (E + groups + 3) / 4);
  float *s = b + E;
  float *gsc = s + E;
  unsigned char *avail = (unsigned char *)(gsc + groups);
  unsigned char *keep = avail + E;
  if (t >= T) return; /* warp-uniform */
  const float *lg = logits + (long)t * E;
  for (int e = lane; e < E; e += 32) {
    const float sg = 1.0f / (1.0f + expf(-lg[e]));
    s[e] = sg;
    b[e] = bias ? sg + bias[e] : sg;
  }
  __syncwarp();
  const int gs = E / groups;
  for (int g = lane; g < groups; g += 32) {
    float m1 = -INFINITY, m2 = -INFINITY;
    for (int i = 0; i < gs; i++) {
      const float x = b[g * gs + i];
      if (x > m1) {
        m2 = m1;
        m1 = x;
      } else if (x > m2) {
        m2 = x;
      }
    }
    gsc[g] = gs >= 2 ? m1 + m2 : m1;
    keep[g] = 0;
  }
  __syncwarp();
  if (lane == 0)
    for (int r = 0; r < topk_groups && r < groups; r++) {
      int best = -1;
      for (int g = 0; g < groups; g++)
        if (!keep[g] && (best < 0 || gsc[g] > gsc[best])) best = g;
      keep[best] = 1;
    }
  __syncwarp();
  for (int e = lane; e < E; e += 32) avail[e] = keep[e / gs];
  __syncwarp();
  float sum = 0.f;
  for (int k = 0; k < K; k++) {
    float bv = 0.f;
    int be = -1;
    for (int e = lane; e < E; e += 32)
      if (avail[e] && (be < 0 || b[e] > bv)) {
        bv = b[e];
        be = e;
      }
    for (int off = 16; off > 0; off >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, off);
      const int oe = __shfl_xor_sync(0xffffffffu, be, off);
      if (oe >= 0 && (be < 0 || ov > bv || (ov == bv && oe < be))) {
        bv = ov;
        be = oe;
      }
    }
    if (lane == 0) {
      idx[(long)t * K + k] = be;
      wout[(long)t * K + k] = be >= 0 ? s[be] : 0.f;
      if (be >= 0) {
        avail[be] = 0;
        sum = __fadd_rn(sum, s[be]);
      }
    }
    __syncwarp();
  }
  if (lane == 0)
    for (int k = 0; k < K; k++) {
      float x = wout[(long)t * K + k];
      if (normalize) x = __fdiv_rn(x, sum);
      wout[(long)t * K + k] = __fmul_rn(x, scaling);
    }
}

__global__ void k_fp8_probe(const float *in, float inv, uint8_t *out, long n) {
  for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
    out[i] = fp8_of(in[i], inv);
}

/* ---------------- launches ---------------- */

/* A kernel that takes more than the default 48 KB of dynamic shared memory must say so first. */
template <typename K> static int smem_opt_in(K kernel, size_t bytes) {
  if (bytes <= 48 * 1024) return 0;
  return (int)cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
}

static int grid_for(long work, int per_block) {
  long g = (work + per_block - 1) / per_block;
  if (g < 1) g = 1;
  if (g > 65535) g = 65535;
  return (int)g;
}

extern "C" {

int mp_ep_launch_sanitize(const mp_ep_view *v, const int32_t *idx, int Treal, cudaStream_t s) {
  MP_LAUNCH(k_sanitize, grid_for(Treal, 256), 256, 0, s, *v, idx, Treal);
  return launched();
}

int mp_ep_launch_scan(const mp_ep_view *v, cudaStream_t s) {
  MP_LAUNCH(k_scan, mp_ep_scan_units(v), 512, 0, s, *v);
  return launched();
}

int mp_ep_launch_msg_a(const mp_ep_view *v, cudaStream_t s) {
  MP_LAUNCH(k_msg_a, 1, 256, 0, s, *v);
  return launched();
}

int mp_ep_launch_msg_b(const mp_ep_view *v, cudaStream_t s) {
  MP_LAUNCH(k_msg_b, 1, 256, 0, s, *v);
  return launched();
}

int mp_ep_launch_offsets(const mp_ep_view *v, cudaStream_t s) {
  MP_LAUNCH(k_offsets, 1, 256, 0, s, *v);
  return launched();
}

int mp_ep_launch_token_in_rank(const mp_ep_view *v, uint8_t *flags, cudaStream_t s) {
  MP_LAUNCH(k_token_in_rank, grid_for(v->T / v->expand, 256), 256, 0, s, *v, flags);
  return launched();
}

int mp_ep_launch_pack(const mp_ep_view *v, const uint16_t *x, const float *w, int blocks, cudaStream_t s) {
  const size_t smem = (MP_EP_PACK_BLOCK / 32) * sizeof(pack_slot);
  int e = smem_opt_in(k_pack, smem);
  if (e) return e;
  MP_LAUNCH(k_pack, blocks, MP_EP_PACK_BLOCK, smem, s, *v, x, w);
  return launched();
}

int mp_ep_launch_forward(const mp_ep_view *v, int blocks, cudaStream_t s) {
  MP_LAUNCH(k_forward, blocks, MP_EP_BLOCK, 0, s, *v);
  return launched();
}

int mp_ep_launch_unpack(const mp_ep_view *v, int blocks, cudaStream_t s) {
  const size_t smem = MP_EP_WARPS * sizeof(unpack_slot);
  int e = smem_opt_in(k_unpack, smem);
  if (e) return e;
  MP_LAUNCH(k_unpack, blocks, MP_EP_BLOCK, smem, s, *v);
  return launched();
}

int mp_ep_launch_dispatch_fused(const mp_ep_view *v, const uint16_t *x, const float *w, int pack_blocks,
                                int link_blocks, int blocks, int host_epoch, cudaStream_t s) {
  const size_t ps = (MP_EP_PACK_BLOCK / 32) * sizeof(pack_slot), us = (MP_EP_PACK_BLOCK / 32) * sizeof(unpack_slot);
  const size_t smem = ps > us ? ps : us;
  int e = smem_opt_in(k_dispatch_fused, smem);
  if (e) return e;
  if (!host_epoch) { /* a graph replays its kernels' arguments: the epoch must live on the GPU */
    MP_LAUNCH(k_epoch_bump, 1, 32, 0, s, v->epoch);
    if ((e = launched())) return e;
  }
  MP_LAUNCH(k_dispatch_fused, blocks, MP_EP_PACK_BLOCK, smem, s, *v, x, w, pack_blocks, link_blocks, host_epoch);
  return launched();
}

int mp_ep_launch_combine_fused(const mp_ep_view *v, const uint16_t *y, uint16_t *out, int expert_blocks, int blocks,
                               int host_depoch, int host_cepoch, cudaStream_t s) {
  if (!host_cepoch) { /* a graph replays its kernels' arguments: the epoch must live on the GPU */
    MP_LAUNCH(k_epoch_bump, 1, 32, 0, s, v->cepoch);
    int e = launched();
    if (e) return e;
  }
  MP_LAUNCH(k_combine_fused, blocks, MP_EP_CF_BLOCK, 0, s, *v, y, out, expert_blocks, host_depoch, host_cepoch);
  return launched();
}

int mp_ep_launch_combine_expert(const mp_ep_view *v, const uint16_t *y, int blocks, cudaStream_t s) {
  MP_LAUNCH(k_combine_expert, blocks, MP_EP_BLOCK, 0, s, *v, y);
  return launched();
}

int mp_ep_launch_combine_node(const mp_ep_view *v, int blocks, cudaStream_t s) {
  MP_LAUNCH(k_combine_node, blocks, MP_EP_BLOCK, 0, s, *v);
  return launched();
}

int mp_ep_launch_combine_out(const mp_ep_view *v, uint16_t *out, int blocks, cudaStream_t s) {
  MP_LAUNCH(k_combine_out, blocks, MP_EP_BLOCK, 0, s, *v, out);
  return launched();
}

int mp_ep_launch_dequant(const mp_ep_view *v, uint16_t *y, int blocks, cudaStream_t s) {
  MP_LAUNCH(k_dequant, blocks, MP_EP_BLOCK, 0, s, *v, y);
  return launched();
}

int mp_ep_launch_route(const float *logits, const float *bias, int T, int E, int K, int groups, int topk_groups,
                       float scaling, int normalize, int32_t *idx, float *w, cudaStream_t s) {
  const int wpb = 8;
  size_t per_warp = sizeof(float) * (size_t)(2 * E + groups + (E + groups + 3) / 4);
  size_t smem = per_warp * wpb;
  if (smem > 48 * 1024) {
    cudaError_t e = cudaFuncSetAttribute(k_route, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return (int)e;
  }
  MP_LAUNCH(k_route, grid_for(T, wpb), 32 * wpb, smem, s, logits, bias, T, E, K, groups, topk_groups, scaling, normalize, idx, w);
  return launched();
}

int mp_ep_launch_fp8_probe(const float *in, float inv, uint8_t *out, long n, cudaStream_t s) {
  MP_LAUNCH(k_fp8_probe, grid_for(n, 256), 256, 0, s, in, inv, out, n);
  return launched();
}

} /* extern "C" */
