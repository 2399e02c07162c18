/* The kernels of collectives/ep/ep_kernels.cu, built as C++ for the CPU emulator (see
 * cuda_runtime.h and emu_device.h beside this file). */
#define MP_EP_EMU 1
#define MP_EP_SOFT_FP8 1
#include "ep_kernels.cu"
