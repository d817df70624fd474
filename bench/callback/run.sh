#!/usr/bin/env bash
# One device call: install the wheel without its dependencies, then three Trainer runs with the
# callback, and `headroom measure` from the installed command. Every run is its own process.
set -u
cd "$(dirname "$0")"
rm -rf /tmp/hr
python3 -m pip install --no-deps --no-index --target /tmp/hr ./*.whl > "$OUT/env.txt" 2>&1 || { cat "$OUT/env.txt"; exit 1; }
export PYTHONPATH=/tmp/hr
# One GPU per process, as headroom models it (with several visible, the Trainer runs DataParallel).
export CUDA_VISIBLE_DEVICES=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$OUT/env.txt"
python3 -c "import torch, transformers, peft, accelerate, sys; print(sys.version); print(torch.__version__, transformers.__version__, peft.__version__, accelerate.__version__)" >> "$OUT/env.txt" 2>&1
start=$SECONDS
for run in full oom lora; do
  ( time timeout 60 python3 run_callback.py "$run" --out "$OUT" ) > "$OUT/$run.log" 2>&1
  echo "$run: exit $? after $((SECONDS - start)) s"
done
printf 'model: qwen2.5-0.5b\nprecision: bf16\noptimizer: adamw\nbatch_size: 2\nseq_len: 512\n' > /tmp/measure.yaml
( time timeout 45 /tmp/hr/bin/headroom measure /tmp/measure.yaml ) > "$OUT/measure.log" 2>&1
echo "measure: exit $? after $((SECONDS - start)) s"
for f in "$OUT"/headroom-oom-*.pickle; do [ -f "$f" ] && python3 -c "import headroom,json,sys; print(json.dumps(headroom.snapshot(sys.argv[1])))" "$f" > "$OUT/oom-snapshot-summary.json" 2>&1 && gzip "$f"; done
tail -n 30 "$OUT"/full.log; tail -n 25 "$OUT"/oom.log; tail -n 12 "$OUT"/lora.log; cat "$OUT/measure.log"
