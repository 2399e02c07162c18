/* CPU emulator of the CUDA device side for ep_kernels.cu (tests/ep/emu): each CUDA thread is an OS
 * thread, __syncthreads and the warp exchanges are barriers, __shared__ variables are statics
 * of the rank thread (one kernel runs at a time on it), and the _rn float intrinsics are the IEEE host ops
 * (the file is built with -ffp-contract=off). */
#ifndef EMU_DEVICE_H
#define EMU_DEVICE_H

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>

struct emu_dim3 {
  unsigned x, y, z;
};
extern thread_local emu_dim3 threadIdx, blockIdx;
extern thread_local emu_dim3 blockDim, gridDim;

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static thread_local

struct uint4 {
  unsigned x, y, z, w;
};
struct uint2 {
  unsigned x, y;
};
static inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return uint4{a, b, c, d}; }
static inline uint2 make_uint2(unsigned a, unsigned b) { return uint2{a, b}; }

void __syncthreads();
void __syncwarp(unsigned mask = 0xffffffffu);
inline void __threadfence_system() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
unsigned __ballot_sync(unsigned mask, int pred);
float __shfl_xor_sync(unsigned mask, float v, int lane_mask, int width = 32);
int __shfl_xor_sync(unsigned mask, int v, int lane_mask, int width = 32);
static inline int __popc(unsigned x) { return __builtin_popcount(x); }
static inline int __clz(unsigned x) { return x ? __builtin_clz(x) : 32; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
template <typename F> static inline cudaError_t cudaFuncSetAttribute(F, cudaFuncAttribute, int) { return cudaSuccess; }

void emu_launch(int grid, int block, size_t smem, std::function<void()> fn);
void *emu_dynamic_smem();
/* wait until *flag == want (acquire), letting other ranks' kernels run; 0 after timeout_ns */
int emu_wait_flag(const int *flag, int want, long long timeout_ns);
[[noreturn]] void emu_trap();

#endif
