# Device call 2: unpack each older transformers (sites.tar.xz: `pip install --target site-<release>`
# of its wheel, its tokenizers and huggingface_hub 0.36.0, packed with xz to fit the 64 MiB the
# call carries), then measure its spec lines with the harness's batch (one fresh process per row,
# allocator history recorded), two releases at a time.
set -u
export PYTHONUNBUFFERED=1
exec > >(tee -a $OUT/log.txt) 2>&1
D=.device/versions2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
mkdir -p /tmp/sites /tmp/snap
tar -xJf $D/sites.tar.xz -C /tmp/sites
for tv in 4.48.3 4.53.3 4.55.4 4.56.2; do
  PYTHONPATH=$D/python:/tmp/sites/site-$tv python3 -c "import torch, transformers, tokenizers, huggingface_hub, peft, accelerate; print('versions', torch.__version__, transformers.__version__, tokenizers.__version__, huggingface_hub.__version__, peft.__version__, accelerate.__version__)"
done
run() {
  PYTHONPATH=$D/python:/tmp/sites/site-$1 timeout 200 python3 -m headroom_measure batch $D/specs-$1.jsonl \
    --out $OUT/rows-$1.jsonl --jobs 2 --budget-gib 66 --snapshot-dir /tmp/snap --catalog crates/headroom/data/models.json
}
# Wait on the batches by id: a bare `wait` also waits for the log's tee, which never ends (call 1
# hung there, so its third batch never started).
run 4.48.3 & a=$!; run 4.53.3 & b=$!; wait $a $b
run 4.55.4 & a=$!; run 4.56.2 & b=$!; wait $a $b
cat $OUT/rows-*.jsonl.errors 2>/dev/null | cut -c1-2000
gzip -9 /tmp/snap/*.pickle
tar -cf $OUT/snapshots.tar -C /tmp/snap .
ls -la $OUT /tmp/snap
