#!/bin/bash
# On the device, from the repo root, carrying .whl and .devwork:
#   bash .devwork/run.sh
# 1. versions; transformers 4.57.1 + huggingface_hub 0.36.0 + tokenizers 0.22.1 wheels into /tmp/site
# 2. the harness's `batch` over bench/transformers-4.57/specs.jsonl under 5.17 (preinstalled) and
#    4.57 (PYTHONPATH=/tmp/site), the two batches side by side, 2 jobs each, 34 GiB of hints each
# 3. the 2 specs that differ most, again under both, with --snapshot (torch memory history)
# 4. gzip, summarise each snapshot's peak (.devwork/snappeak.py) and diff the versions
set -u
shopt -s nullglob
export PYTHONUNBUFFERED=1
R=$PWD
D=bench/transformers-4.57
W=/tmp/w
mkdir -p $W/snap $W/x
exec > >(tee -a $OUT/log.txt) 2>&1
echo "== start $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
VERS='import importlib
for n in ["torch","transformers","peft","accelerate","huggingface_hub","tokenizers","safetensors","bitsandbytes"]:
    try:
        m = importlib.import_module(n); print(f"  {n} {m.__version__} {m.__file__}")
    except Exception as e:
        print(f"  {n} IMPORT FAILED: {type(e).__name__}: {e}")'
echo "== versions, preinstalled"; python3 -c "$VERS"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || echo "!! pip install of .whl failed"
echo "== versions, PYTHONPATH=/tmp/site"; PYTHONPATH=/tmp/site python3 -c "$VERS"
CHECK='import transformers, accelerate, peft
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
print("  peft", peft.__version__, "accelerate", accelerate.__version__, "import ok under transformers", transformers.__version__)'
if ! PYTHONPATH=/tmp/site python3 -c "$CHECK"; then
  echo "!! peft/accelerate do not import under 4.57: installing fallback peft 0.17.1 / accelerate 1.10.1"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .devwork/fallback/*.whl
  PYTHONPATH=/tmp/site python3 -c "$VERS"; PYTHONPATH=/tmp/site python3 -c "$CHECK"
fi

echo "== measure, both versions side by side ($SECONDS s)"
(PYTHONPATH=$R/python python3 -m headroom_measure batch $D/specs.jsonl --out $OUT/rows-5.17.jsonl \
   --jobs 2 --budget-gib 34 2>&1 | sed -u 's/^/[5.17] /') &
P1=$!
(PYTHONPATH=$R/python:/tmp/site python3 -m headroom_measure batch $D/specs.jsonl --out $OUT/rows-4.57.jsonl \
   --jobs 2 --budget-gib 34 2>&1 | sed -u 's/^/[4.57] /') &
P2=$!
wait $P1 $P2  # (a bare wait would also wait for the tee of the log)
mv $OUT/*.errors $W/x/ 2>/dev/null
echo "== measured ($SECONDS s)"
python3 .devwork/pick.py $OUT/rows-5.17.jsonl $OUT/rows-4.57.jsonl $D/specs.jsonl $W

if [ $SECONDS -lt 420 ]; then
  echo "== snapshots ($SECONDS s)"
  (PYTHONPATH=$R/python python3 -m headroom_measure batch $W/snap-5.17.jsonl --out $W/x/snaprows-5.17.jsonl \
     --snapshot-dir $W/snap --jobs 2 --budget-gib 34 2>&1 | sed -u 's/^/[snap 5.17] /') &
  P1=$!
  (PYTHONPATH=$R/python:/tmp/site python3 -m headroom_measure batch $W/snap-4.57.jsonl --out $W/x/snaprows-4.57.jsonl \
     --snapshot-dir $W/snap --jobs 2 --budget-gib 34 2>&1 | sed -u 's/^/[snap 4.57] /') &
  P2=$!
  wait $P1 $P2
  echo "== snapshots taken ($SECONDS s)"
  ls -la $W/snap
  gzip -9 $W/snap/*.pickle
  for f in $W/snap/*.pickle.gz; do
    b=$(basename $f .pickle.gz)
    python3 .devwork/snappeak.py $f > $W/x/$b.summary.json || echo "!! summary of $b failed"
  done
  for s in $(python3 -c "import json; [print(json.loads(l)['name']) for l in open('$W/snap-5.17.jsonl')]"); do
    echo "== diff $s: A = 5.17, B = 4.57"
    python3 .devwork/snappeak.py --diff $W/x/$s-tf5.17.summary.json $W/x/$s-tf4.57.summary.json | tee $W/x/$s.diff.txt
  done
  ls -la $W/snap/
  n=0
  for f in $W/snap/*.pickle.gz; do
    if [ $(stat -c %s $f) -lt 16000000 ] && [ $n -lt 4 ]; then cp $f $OUT/; n=$((n + 1)); fi
  done
else
  echo "!! skipped snapshots: $SECONDS s gone"
fi
cp $W/snap-*.jsonl $W/x/ 2>/dev/null
tar -C $W -czf $OUT/extras.tar.gz x snap-5.17.jsonl snap-4.57.jsonl 2>/dev/null || tar -C $W -czf $OUT/extras.tar.gz x
echo "== end $(date -u +%FT%TZ) ($SECONDS s)"
ls -la $OUT
