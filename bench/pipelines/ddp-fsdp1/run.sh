#!/usr/bin/env bash
# On the device (one H200), from the repository root: every pipeline here at once, each its own
# process (their caching allocators are independent: the peaks are unaffected), rank 0 of its
# world under torch's fake process group where it has `parallel`. Records to $OUT/rows.jsonl, logs
# and two memory snapshots (gzipped) to $OUT.
#   bash bench/pipelines/ddp-fsdp1/run.sh [PYTHON_DIR] [SITE_DIR]
# PYTHON_DIR holds headroom_measure (default python/), SITE_DIR bitsandbytes 0.50.2 (its wheel unpacked).
set -u
here=bench/pipelines/ddp-fsdp1
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 PYTHONPATH="${1:-$PWD/python}:${2:-}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c 'import torch, transformers, peft, bitsandbytes; print(torch.__version__, transformers.__version__, peft.__version__, bitsandbytes.__version__)'
one() {  # ID WORLD [extra args]
  local id=$1 world=$2; shift 2
  local start=$SECONDS env=()
  [[ $world -gt 0 ]] && env=(HEADROOM_FAKE_WORLD=$world WORLD_SIZE=$world RANK=0 LOCAL_RANK=0)
  env "${env[@]}" timeout 180 python3 -m headroom_measure pipeline "$here/$id.yaml" --id "$id" \
    --out "$OUT/$id.jsonl" "$@" > "$OUT/$id.log" 2>&1
  echo "[$((SECONDS - start))s rc=$?] $id"
}
one verl-fsdp1-q7b-w8 8 --snapshot "$OUT/verl-fsdp1-q7b-w8.pickle" --stacks none &
one dpo-ddp-q1.5b-w4 4 --snapshot "$OUT/dpo-ddp-q1.5b-w4.pickle" &
one dpo-ddp-8bit-q1.5b-w2 2 &
one dpo-qlora-q3b 0 &
wait
cat "$OUT"/*.jsonl > "$OUT/rows.jsonl.tmp"; rm -f "$OUT"/*.jsonl; mv "$OUT/rows.jsonl.tmp" "$OUT/rows.jsonl"
gzip -f "$OUT"/*.pickle
cat "$OUT"/*.log > "$OUT/all.log"; rm -f "$OUT"/*-*.log
ls -la "$OUT"
