#!/usr/bin/env bash
# Measure the DeepSpeed pipelines of this folder on one GPU (kind nvidia-h200), each in a fresh
# `torchrun --nproc-per-node 1` (their instances say world_size 1), with DeepSpeed 0.18.2 from
# the git-ignored .whl-ds/ (bench/distributed/README.md says which wheels).
#
#   bash bench/pipelines/zero/run.sh [OUT_DIR]     (from the repository root; OUT_DIR defaults to $OUT)
#
# Writes OUT_DIR/results.jsonl (one row per pipeline, in file order), OUT_DIR/log.txt and
# OUT_DIR/dpo-zero3-4l.pickle.gz (events without stack traces: ZeRO-3's recomputation under
# checkpointing crashes when frames are recorded) and dpo-zero3-4l-nogc.pickle.gz (with frames).
set -u -o pipefail
out=${1:-${OUT:?give OUT_DIR or set OUT}}
mkdir -p "$out"
log="$out/log.txt"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-ds \
  .whl-ds/*.whl 2>&1 | tee -a "$log"
export PYTHONPATH="/tmp/site-ds:$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
port=29700
for spec in bench/pipelines/zero/*.yaml; do
  id=$(basename "$spec" .yaml)
  port=$((port + 1))
  extra=()
  [[ $id == *-4l ]] && extra=(--snapshot "$out/$id.pickle" --stacks none)
  [[ $id == *-4l-nogc ]] && extra=(--snapshot "$out/$id.pickle")
  echo "=== $id (t=${SECONDS}s)" | tee -a "$log"
  t0=$SECONDS
  timeout -k 10 200 torchrun --nproc-per-node 1 --master-port $port -m headroom_measure pipeline \
    "$spec" --id "$id" --out "$out/results.jsonl" "${extra[@]}" 2>&1 | grep -v '^{"id"' | tee -a "$log"
  echo "=== rc=${PIPESTATUS[0]} $id ($((SECONDS - t0))s)" | tee -a "$log"
  [ -f "$out/$id.pickle" ] && gzip -9 -f "$out/$id.pickle"
done
