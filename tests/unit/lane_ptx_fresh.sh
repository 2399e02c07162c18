#!/bin/sh
# common/cuda_lane_ptx.c must be generated from the current common/cuda_lane_kernel.cu
# (scripts/gen-lane-ptx.sh writes the source's sha256 on its first line).
src="$1/common/cuda_lane_kernel.cu" ptx="$1/common/cuda_lane_ptx.c"
want=$(sha256sum "$src" | cut -d' ' -f1)
have=$(head -1 "$ptx" | sed -n 's/.*sha256 \([0-9a-f]*\).*/\1/p')
[ "$want" = "$have" ] && grep -q '\.entry mplane_lane_run(' "$ptx" && exit 0
echo "common/cuda_lane_ptx.c is stale (made from sha256 '$have', the source is $want): run scripts/gen-lane-ptx.sh"
exit 1
