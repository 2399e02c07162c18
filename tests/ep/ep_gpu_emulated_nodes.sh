#!/usr/bin/env bash
# Suite 'gpu': two emulated nodes on ONE GPU (mplane-ep-bench --share-gpus, under a private MPS
# daemon when nvidia-cuda-mps-control is there): each rank has its own NCCL_HOSTID, so NCCL carries
# the network phase through the net plugin (mplane's socket transport over lo). Passes when every
# check against the CPU model passes on both ranks, the plugin's byte counters MATCH the model's
# bytes, and NCCL's logs say it used the plugin. Exit 77 (skipped), with a message, without a GPU.
#
#   ep_gpu_emulated_nodes.sh MPLANE_EP_BENCH LIBNCCL_NET_MPLANE_SO
set -uo pipefail
bench=$1
plugin=$2
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "ep_gpu_emulated_nodes: SKIP: no GPU (nvidia-smi -L failed or is not installed)"
  exit 77
fi
tmp=$(mktemp -d /tmp/ep-gpu-emu-XXXXXX)
mps_started=0
cleanup() {
  [ $mps_started = 1 ] && echo quit | nvidia-cuda-mps-control >/dev/null 2>&1
  rm -rf "$tmp"
}
trap cleanup EXIT
# one GPU, whatever the machine has: this test is about the shared-GPU mode
first=$(nvidia-smi --query-gpu=index --format=csv,noheader | head -1)
export CUDA_VISIBLE_DEVICES=${first:-0}
if command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
  export CUDA_MPS_PIPE_DIRECTORY=$tmp/mps CUDA_MPS_LOG_DIRECTORY=$tmp/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if nvidia-cuda-mps-control -d; then mps_started=1
  else echo "ep_gpu_emulated_nodes: nvidia-cuda-mps-control -d failed: running without MPS (the ranks time-slice the GPU)"; fi
else
  echo "ep_gpu_emulated_nodes: no nvidia-cuda-mps-control: running without MPS (the ranks time-slice the GPU)"
fi
log=$tmp/bench.log
env NCCL_NET_PLUGIN="$plugin" MPLANE_SOCKET_IFNAME=lo NCCL_SOCKET_IFNAME=lo NCCL_NVLS_ENABLE=0 \
  NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET NCCL_DEBUG_FILE="$tmp/nccl.%h.%p.log" \
  "$bench" --gpus 2 --nodes 2 --share-gpus --mode check,bytes --stats-file "$tmp/stats-%p.json" --timeout 480 \
  >"$log" 2>&1
rc=$?
cat "$log"
fail=0
bad() { echo "ep_gpu_emulated_nodes: FAIL: $*"; fail=1; }
[ $rc -eq 0 ] || bad "mplane-ep-bench exited with $rc"
grep -q "emulated node(s) of 1, on 1 GPU(s) shared" "$log" || bad "the launcher did not put the two ranks on one GPU"
grep -qE "^check summary .*: PASS" "$log" || bad "no 'check summary ...: PASS' line (the GPU results differ from the CPU model)"
grep -q "plugin counters, node-limited: .* MATCH" "$log" || bad "the plugin's byte counters did not MATCH the model (node-limited)"
grep -q "plugin counters, flat baseline: .* MATCH" "$log" || bad "the plugin's byte counters did not MATCH the model (flat baseline)"
nets=$(grep -hoE "Using network [A-Za-z0-9_]+" "$tmp"/nccl.*.log 2>/dev/null | sort | uniq -c | tr '\n' ';')
echo "ep_gpu_emulated_nodes: NCCL logs: ${nets:-no 'Using network' line}"
grep -qh "Using network mplane" "$tmp"/nccl.*.log 2>/dev/null || bad "NCCL did not use the mplane net plugin"
if grep -hoE "Using network [A-Za-z0-9_]+" "$tmp"/nccl.*.log 2>/dev/null | grep -qv "Using network mplane"; then
  bad "some communicator fell back to another network"
fi
[ $fail = 0 ] && echo "ep_gpu_emulated_nodes: PASS (two emulated nodes on one GPU, network phase through mplane, bytes match the model)"
exit $fail
