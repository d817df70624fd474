#!/usr/bin/env bash
# Runs spec lines of a measurement run of bench/distributed, each in a fresh
# `torchrun --nproc-per-node $NPROC`, one after another: by default every line of
# h200x2/specs.jsonl on a host with 2 GPUs (h200x2/README.md); the one-GPU runs (h200x1*/) use it
# with NPROC=1 and their own SPECS (each run's README.md has its command).
#
#   bash bench/distributed/run.sh [OUT_DIR]        (from the repository root; OUT_DIR defaults to $OUT)
#
# Writes OUT_DIR/results.jsonl (rank 0's record per spec), OUT_DIR/log.txt (everything printed),
# OUT_DIR/snap/NAME.pickle.gz (rank 0's memory snapshot where a spec line names one; with
# "snapshot_ranks": "all" every rank's, as NAME-rank0.pickle.gz, NAME-rank1.pickle.gz).
# "stacks" (python, all or none) picks the frames a snapshot keeps (default python).
# SPECS (default bench/distributed/h200x2/specs.jsonl) names the spec lines to run, e.g.
# SPECS=bench/distributed/h200x2/specs-zero.jsonl for the ZeRO snapshot runs.
# ZeRO lines need DeepSpeed: if .whl-ds/ holds its wheels (h200x2/README.md says which), they are
# installed into /tmp/site-ds and put on PYTHONPATH for those lines only.
# DEADLINE (seconds, default 560) skips the lines that would start after it.
# NPROC (default 2) is the number of processes (GPUs); it must equal each line's world_size.
set -u -o pipefail
out=${1:-${OUT:?give OUT_DIR or set OUT}}
deadline=${DEADLINE:-560}
specs=${SPECS:-bench/distributed/h200x2/specs.jsonl}
mkdir -p "$out/snap"
log="$out/log.txt"
# NVLink multicast stays off (the lender's rule for these hosts; see the device notes).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
{
  date -u; nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  nvidia-smi topo -m
  python3 -c 'import torch, transformers; print("devices", torch.cuda.device_count(), "torch", torch.__version__, "nccl", torch.cuda.nccl.version(), "transformers", transformers.__version__)'
} 2>&1 | tee -a "$log"

ds_path=""
if ls .whl-ds/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-ds .whl-ds/*.whl 2>&1 | tee -a "$log"
  ds_path=/tmp/site-ds
fi

n=$(wc -l < "$specs")
for i in $(seq 1 "$n"); do
  line=$(sed -n "${i}p" "$specs")
  id=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["id"])' "$line")
  spec=$(python3 -c 'import json,sys; print(json.dumps(json.loads(sys.argv[1])["spec"]))' "$line")
  snap=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1]).get("snapshot", ""))' "$line")
  ranks=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1]).get("snapshot_ranks", "0"))' "$line")
  stacks=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1]).get("stacks", "python"))' "$line")
  strategy=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["spec"]["parallel"]["strategy"])' "$line")
  limit=150
  case "$id" in *offload*) limit=300 ;; esac
  if (( SECONDS + 30 > deadline )); then
    echo "=== SKIPPED (deadline) $id" | tee -a "$log"; continue
  fi
  (( SECONDS + limit > deadline )) && limit=$(( deadline - SECONDS ))
  extra=()
  [ -n "$snap" ] && extra=(--snapshot "$out/snap/$snap.pickle")
  [ -n "$snap" ] && [ "$ranks" = all ] && extra=(--snapshot "$out/snap/$snap-rank{rank}.pickle")
  [ -n "$snap" ] && extra+=(--stacks "$stacks")
  pp="$PYTHONPATH"
  if [[ $strategy == zero* ]]; then
    [ -z "$ds_path" ] && { echo "=== SKIPPED (no DeepSpeed wheels) $id" | tee -a "$log"; continue; }
    pp="$ds_path:$PYTHONPATH"
  fi
  echo "=== $id (limit ${limit}s, t=${SECONDS}s)" | tee -a "$log"
  t0=$SECONDS
  PYTHONPATH="$pp" timeout -k 10 "$limit" torchrun --nproc-per-node "${NPROC:-2}" --master-port $((29600 + i)) \
    -m headroom_measure dist --spec-json "$spec" --id "$id" --out "$out/results.jsonl" "${extra[@]}" \
    2>&1 | grep -v '^{"id"' | tee -a "$log"
  echo "=== rc=${PIPESTATUS[0]} $id ($((SECONDS - t0))s)" | tee -a "$log"
  for f in "$out/snap/$snap.pickle" "$out/snap/$snap"-rank*.pickle; do
    [ -n "$snap" ] && [ -f "$f" ] && gzip -9 -f "$f"
  done
done
nvidia-smi 2>&1 | tail -n 8 | tee -a "$log"
