// mplane: the lane kernel (protocol in cuda_lane_ring.h). One block; thread 0 polls the ring and
// publishes completions, every thread copies. Compiled to PTX by scripts/gen-lane-ptx.sh; the PTX is
// kept in the tree (cuda_lane_kernel.ptx) so that building the plugin needs no CUDA compiler, and the
// driver compiles it for the GPU at first use.
#include "cuda_lane_ring.h"

__device__ static __forceinline__ mplane_u64 now_ns() {
  mplane_u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ static void copy_bytes(mplane_u64 dst, mplane_u64 src, mplane_u64 n) {
  if (((dst | src | n) & 15) == 0) {
    uint4 *d = (uint4 *)dst;
    const volatile uint4 *s = (const volatile uint4 *)src;
    for (mplane_u64 i = threadIdx.x; i < n / 16; i += blockDim.x) {
      uint4 v;
      v.x = s[i].x, v.y = s[i].y, v.z = s[i].z, v.w = s[i].w;
      d[i] = v;
    }
  } else if (((dst | src | n) & 7) == 0) {
    mplane_u64 *d = (mplane_u64 *)dst;
    const volatile mplane_u64 *s = (const volatile mplane_u64 *)src;
    for (mplane_u64 i = threadIdx.x; i < n / 8; i += blockDim.x) d[i] = s[i];
  } else {
    unsigned char *d = (unsigned char *)dst;
    const volatile unsigned char *s = (const volatile unsigned char *)src;
    for (mplane_u64 i = threadIdx.x; i < n; i += blockDim.x) d[i] = s[i];
  }
}

extern "C" __global__ void __launch_bounds__(MPLANE_LANE_THREADS) mplane_lane_run(struct mplane_lane_ctl *ctl,
                                                                                   mplane_u64 epoch) {
  volatile struct mplane_lane_ctl *v = ctl;
  __shared__ mplane_u64 next;
  __shared__ int go;
  __shared__ struct mplane_lane_cmd cmd;
  if (threadIdx.x == 0) {
    v->started = epoch;
    __threadfence_system();
    next = v->done + 1;
  }
  __syncthreads();
  for (;;) {
    if (threadIdx.x == 0) { // wait for op `next`, or give up after idle_ns; claim it (cuda_lane_ring.h)
      volatile struct mplane_lane_cmd *c = &v->ring[next % MPLANE_LANE_SLOTS];
      mplane_u64 t0 = now_ns(), idle = v->idle_ns;
      go = 0;
      for (;;) {
        if (c->seq == next) {
          __threadfence_system(); // the fields were written before seq
          cmd.op = c->op, cmd.dst = c->dst, cmd.src = c->src, cmd.bytes = c->bytes, cmd.value = c->value;
          v->claimed = next;
          __threadfence_system(); // the claim before the read of stop: the host's fallback relies on it
          go = !v->stop;
          break;
        }
        if (v->stop || now_ns() - t0 > idle) break;
      }
    }
    __syncthreads();
    if (!go) break;
    if (cmd.op == MPLANE_LANE_COPY) {
      copy_bytes(cmd.dst, cmd.src, cmd.bytes);
      __threadfence_system(); // each thread's own stores visible system-wide before the barrier
    }
    __syncthreads(); // then thread 0 publishes
    if (threadIdx.x == 0) {
      if (cmd.op == MPLANE_LANE_WAIT)
        while (*(volatile mplane_u64 *)cmd.src < cmd.value && !v->stop) {
        }
      __threadfence_system();
      if (cmd.op == MPLANE_LANE_WRITE64) *(volatile mplane_u64 *)cmd.dst = cmd.value;
      __threadfence_system();
      if (v->stop) go = 0; // taken back: the host runs this op (again) and publishes it
      else v->done = next;
      next++;
    }
    __syncthreads();
    if (!go) break;
  }
  if (threadIdx.x == 0) {
    __threadfence_system();
    v->exited = epoch;
  }
}
