#!/usr/bin/env bash
# On the device, from the repository root: each framework pipeline here as rank 0 of a world of 8
# under torch's fake process group, one process each, one after another. Records to $OUT/rows.jsonl.
#   bash bench/pipelines/frameworks/run.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/python" OMP_NUM_THREADS=8
export HEADROOM_FAKE_WORLD=8 WORLD_SIZE=8 RANK=0 LOCAL_RANK=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
for f in bench/pipelines/frameworks/*.yaml; do
  id=$(basename "$f" .yaml)
  start=$SECONDS
  timeout 250 python3 -m headroom_measure pipeline "$f" --id "$id" --out "$OUT/rows.jsonl" > "$OUT/$id.log" 2>&1
  echo "[$((SECONDS - start))s rc=$?] $id"
  tail -3 "$OUT/$id.log"
done
