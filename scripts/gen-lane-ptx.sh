#!/usr/bin/env bash
# Regenerate common/cuda_lane_ptx.c (the lane kernel's PTX as a C string) from
# common/cuda_lane_kernel.cu; needs nvcc (CUDA 13). The PTX is kept in the tree so the plugin builds
# without a CUDA compiler; the file's first line records the source's sha256, and the unit test
# lane-ptx-fresh fails when the source changed and this was not run.
#
#   scripts/gen-lane-ptx.sh [NVCC]       (default: nvcc on PATH, else /usr/local/cuda/bin/nvcc)
set -euo pipefail
cd "$(dirname "$0")/../common"
nvcc="${1:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"
[ -x "$nvcc" ] || { echo "gen-lane-ptx: no nvcc (give its path)" >&2; exit 2; }
# compute_75: the oldest architecture CUDA 13 compiles for; the driver JIT-compiles it for newer GPUs.
"$nvcc" -ptx -arch=compute_75 -O3 -o /tmp/mplane-lane.$$.ptx cuda_lane_kernel.cu
sum=$(sha256sum cuda_lane_kernel.cu | cut -d' ' -f1)
{ echo "/* from cuda_lane_kernel.cu sha256 $sum by scripts/gen-lane-ptx.sh: do not edit */"
  echo "/* The lane kernel in PTX, loaded with cuModuleLoadData (the driver compiles it for the GPU). */"
  echo "const char mplane_lane_ptx[] ="
  sed -e 's/\\/\\\\/g' -e 's/"/\\"/g' -e 's/^/  "/' -e 's/$/\\n"/' /tmp/mplane-lane.$$.ptx
  echo "  ;"; } > cuda_lane_ptx.c
rm -f /tmp/mplane-lane.$$.ptx
echo "wrote common/cuda_lane_ptx.c ($(wc -l < cuda_lane_ptx.c) lines)"
