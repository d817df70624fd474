#!/usr/bin/env bash
# Reproduce the general-form pipeline rows of bench/pipelines/h200-torch2.11.jsonl (seed000-reuse,
# seed000-reload, seed002-grpo-agent-user, seed002-4l) on a host with 2 GPUs (the device call of
# README.md, kind nvidia-h200-x2).
#
#   bash bench/pipelines/run.sh [OUT_DIR]        (from the repository root; OUT_DIR defaults to $OUT)
#
# Seed 002 is one process on one GPU: the full pipeline on GPU 0 and its 4-layer variant (with a
# memory snapshot, stacks="python") on GPU 1 run at the same time, each alone on its GPU. Then
# the two seed 000 pipelines (FSDP2 over 2 ranks) run one after the other under torchrun.
# Writes OUT_DIR/results.jsonl (the rows in the order above), OUT_DIR/log.txt (everything printed),
# OUT_DIR/seed002-4l.pickle.gz (the snapshot).
set -u -o pipefail
out=${1:-${OUT:?give OUT_DIR or set OUT}}
mkdir -p "$out"
log="$out/log.txt"
# NVLink multicast stays off (the lender's rule for these hosts; see the device notes).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
{
  date -u; nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  python3 -c 'import torch, transformers; print("devices", torch.cuda.device_count(), "torch", torch.__version__, "transformers", transformers.__version__)'
} 2>&1 | tee -a "$log"

one() {  # ID GPU SPEC [--snapshot FILE]
  local id=$1 gpu=$2 spec=$3; shift 3
  CUDA_VISIBLE_DEVICES=$gpu timeout -k 10 300 python3 -m headroom_measure pipeline "$spec" --id "$id" \
    --out "$out/$id.jsonl" "$@" > "$out/$id.log" 2>&1
  echo "=== rc=$? $id (GPU $gpu)" >> "$out/$id.log"
}
t0=$SECONDS
echo "=== seed002-grpo-agent-user (GPU 0) and seed002-4l (GPU 1), at once" | tee -a "$log"
one seed002-grpo-agent-user 0 examples/seed002-grpo-agent-user.yaml &
one seed002-4l 1 bench/pipelines/seed002-4l.yaml --snapshot "$out/seed002-4l.pickle" &
wait
for id in seed002-grpo-agent-user seed002-4l; do grep -v '^{"id"' "$out/$id.log" | tee -a "$log"; done
echo "=== seed002 done ($((SECONDS - t0))s)" | tee -a "$log"

port=29650
for id in seed000-reuse seed000-reload; do
  port=$((port + 1))
  echo "=== $id (torchrun, 2 ranks, t=${SECONDS}s)" | tee -a "$log"
  t1=$SECONDS
  timeout -k 10 240 torchrun --nproc-per-node 2 --master-port $port -m headroom_measure pipeline \
    "examples/$id.yaml" --id "$id" --out "$out/$id.jsonl" 2>&1 | grep -v '^{"id"' | tee -a "$log"
  echo "=== rc=${PIPESTATUS[0]} $id ($((SECONDS - t1))s)" | tee -a "$log"
done
for id in seed000-reuse seed000-reload seed002-grpo-agent-user seed002-4l; do
  [ -f "$out/$id.jsonl" ] && cat "$out/$id.jsonl" >> "$out/results.jsonl"
done
[ -f "$out/seed002-4l.pickle" ] && gzip -9 -f "$out/seed002-4l.pickle"
nvidia-smi 2>&1 | tail -n 8 | tee -a "$log"
