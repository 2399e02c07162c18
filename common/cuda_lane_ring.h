/* mplane: the lane kernel's work ring, shared by the host side (cuda_lane.c), the kernel
 * (cuda_lane_kernel.cu, compiled to PTX) and the CPU stand-in of the CUDA driver (tests/fakecuda).
 *
 * Why a kernel: while any kernel runs on the GPU (NCCL's GIN kernels run for the whole
 * collective), every op given to a CUDA stream - a copy, a value write, the host word written behind
 * it - took 100-240 us to complete on an H200 under MPS, against 4-7 us on an idle GPU. A GIN put
 * from GPU memory needs two such ops on its critical path. The lane kernel stays resident while ops
 * flow, reads each op from this ring in pinned host memory, does it with its own loads and stores,
 * and writes the op's sequence number back: no stream op per GIN op.
 *
 * Protocol. One ring per GPU in one pinned, device-mapped allocation. The host fills a slot's fields,
 * then (release) its seq; slot i holds op seq s where i = s % MPLANE_LANE_SLOTS, s counting from 1.
 * The kernel runs ops in seq order and, after each one's stores are visible system-wide, sets done =
 * seq. It exits after idle_ns with nothing to run, or when stop is set, and then sets exited = the
 * epoch it was launched with. The host launches a kernel (epoch + 1) whenever ops wait and no kernel
 * is live (exited == epoch): one kernel at a time, so ops never run out of order.
 *
 * Taking ops back (the host's fallback, cuda_lane.c: a kernel that cannot start or stopped making
 * progress). Before it runs op s the kernel sets claimed = s, fences (system scope, sequentially
 * consistent), then reads stop, and runs nothing once stop is set; it publishes done only while stop
 * is clear. The host sets stop, fences, and reads claimed then done: the kernel never starts an op
 * after claimed (its read of stop comes after its claim, so it sees the host's stop), every op up to
 * done is complete, and the one op between (claimed = done + 1, if any) was begun and may be half
 * done. The host runs every op after done on a stream in order, that one included; their bytes and
 * values are the ones the ring holds, so running one twice writes the same thing. */
#ifndef MPLANE_COMMON_CUDA_LANE_RING_H
#define MPLANE_COMMON_CUDA_LANE_RING_H

#ifdef __CUDACC__
typedef unsigned long long mplane_u64;
typedef unsigned int mplane_u32;
#else
#include <stdint.h>
typedef uint64_t mplane_u64;
typedef uint32_t mplane_u32;
#endif

#define MPLANE_LANE_SLOTS 1024u
#define MPLANE_LANE_KERNEL "mplane_lane_run"
#define MPLANE_LANE_THREADS 256

enum mplane_lane_op {
  MPLANE_LANE_COPY = 1,    /* bytes from src to dst (either may be GPU or mapped host memory) */
  MPLANE_LANE_WRITE64 = 2, /* the 64-bit word at dst = value */
  MPLANE_LANE_WAIT = 3,    /* wait until the 64-bit word at src (mapped host memory) >= value */
};

struct mplane_lane_cmd { /* 64 bytes: one slot never shares a cache line with another */
  mplane_u64 seq;        /* written last */
  mplane_u32 op, to_gpu; /* to_gpu (COPY): dst is GPU memory, src host memory; for the host's fallback */
  mplane_u64 dst, src, bytes, value;
  mplane_u64 pad2[2];
};

struct mplane_lane_ctl {
  mplane_u64 done;    /* kernel: the last seq whose op is complete */
  mplane_u64 claimed; /* kernel: the last seq it began (set before it reads stop) */
  mplane_u64 pad0[6];
  mplane_u64 started; /* kernel: its epoch, on entry */
  mplane_u64 exited;  /* kernel: its epoch, once it runs nothing more */
  mplane_u64 pad1[6];
  mplane_u64 stop;    /* host: exit now */
  mplane_u64 idle_ns; /* host: exit after this long with nothing to run */
  mplane_u64 ce_done; /* the copy engine's stream: the last big copy complete (waited for by WAIT) */
  mplane_u64 pad2[5];
  struct mplane_lane_cmd ring[MPLANE_LANE_SLOTS];
};

#endif
