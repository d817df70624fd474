# The device call: install each older transformers into its own --target, then measure its
# spec lines with the harness's batch (one fresh process per row, allocator history recorded).
set -u
export PYTHONUNBUFFERED=1
exec > >(tee -a $OUT/log.txt) 2>&1
D=.device/versions
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
mkdir -p $OUT/snap
for v in 4.46.3:0.20.3 4.51.3:0.21.4 4.55.4:0.21.4; do
  IFS=: read tv kv <<< "$v"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-$tv \
    .device/versions/whl/transformers-$tv-*.whl .device/versions/whl/tokenizers-$kv-*.whl .device/versions/whl/huggingface_hub-0.36.0-*.whl
  PYTHONPATH=$D/python:/tmp/site-$tv python3 -c "import torch, transformers, tokenizers, huggingface_hub, peft, accelerate; print('versions', torch.__version__, transformers.__version__, tokenizers.__version__, huggingface_hub.__version__, peft.__version__, accelerate.__version__)"
done
run() {
  PYTHONPATH=$D/python:/tmp/site-$1 timeout 500 python3 -m headroom_measure batch $D/specs-$1.jsonl \
    --out $OUT/rows-$1.jsonl --jobs $2 --budget-gib $3 --snapshot-dir $OUT/snap --catalog crates/headroom/data/models.json
}
# Wait on the batches by id: a bare `wait` also waits for the log's tee above, which never ends
# (this is where call 1 hung: the 4.55.4 batch below never started).
run 4.46.3 2 66 & a=$!; run 4.51.3 2 66 & b=$!; wait $a $b
run 4.55.4 2 130
gzip -9 $OUT/snap/*.pickle 2>/dev/null
ls -la $OUT $OUT/snap
