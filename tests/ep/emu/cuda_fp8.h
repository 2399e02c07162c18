/* CPU emulator: the kernels use the software FP8 conversion (MP_EP_SOFT_FP8) here. */
#ifndef EMU_CUDA_FP8_H
#define EMU_CUDA_FP8_H
#endif
