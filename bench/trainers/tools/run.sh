#!/bin/bash
# On the device, from the repo root, carrying .whl-trl:
#   bash bench/trainers/tools/run.sh [DEADLINE_S] [SHARDS] [ONLY]
# 1. TRL 1.16.0 + datasets 5.2.0 + dill 0.4.1 + multiprocess 0.70.19 wheels into /tmp/site; versions
# 2. bench/trainers/specs.jsonl (or the ids matching ONLY) in SHARDS batches side by side, a fresh process
#    per spec (python -m headroom_measure.trainers batch); rows, logs and snapshots under $OUT
set -u
export PYTHONUNBUFFERED=1
DEADLINE=${1:-420}
SHARDS=${2:-3}
ONLY=${3:-}
SPECS=${SPECS:-bench/trainers/specs.jsonl}
R=$PWD
mkdir -p $OUT/snap /tmp/w
exec > >(tee -a $OUT/log.txt) 2>&1
echo "== start $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-trl/*.whl \
  || { echo "!! pip install failed"; exit 1; }
export PYTHONPATH=$R/python:/tmp/site
python3 -c 'import importlib
for n in ["torch","transformers","trl","peft","accelerate","datasets","tokenizers","huggingface_hub","pyarrow","dill","multiprocess"]:
    try:
        m = importlib.import_module(n); print(f"  {n} {m.__version__} {m.__file__}")
    except Exception as e:
        print(f"  {n} IMPORT FAILED: {type(e).__name__}: {e}")'
GPU=$(python3 -c 'import torch; print(torch.cuda.get_device_name(0).split()[1].lower())')
ROWS=$OUT/rows-$GPU.jsonl
pids=()
for k in $(seq 0 $((SHARDS - 1))); do
  python3 -m headroom_measure.trainers batch $SPECS --out $ROWS --snapshot-dir /tmp/w \
    --shard $k/$SHARDS --deadline $DEADLINE --timeout 150 ${ONLY:+--only $ONLY} 2>&1 | sed -u "s/^/[shard $k] /" &
  pids+=($!)
done
if [ -n "${LOOP:-}" ]; then  # the harness's own loop on the same shapes, for Trainer vs loop
  python3 -m headroom_measure batch $LOOP --out $OUT/loop-rows-$GPU.jsonl 2>&1 | sed -u "s/^/[loop] /" &
  pids+=($!)
fi
wait "${pids[@]}"
echo "== measured ($SECONDS s)"
for f in /tmp/w/*.pickle; do gzip -9 $f; done
ls -la /tmp/w
n=0
for f in /tmp/w/*.pickle.gz; do
  if [ $(stat -c %s $f) -lt 6000000 ] && [ $n -lt 4 ]; then cp $f $OUT/snap/; n=$((n + 1)); fi
done
[ -f $ROWS.errors ] && cp $ROWS.errors $OUT/errors.jsonl
echo "== end $(date -u +%FT%TZ) ($SECONDS s)"
ls -la $OUT $OUT/snap
