#!/bin/bash
# Second device call: the 4 specs again under 5.17 and 4.57 with the .devwork harness copy and
# HEADROOM_ATTN_MASK=ones (an all-ones 2D attention_mask passed to the model).
set -u
export PYTHONUNBUFFERED=1 HEADROOM_ATTN_MASK=ones
R=$PWD
exec > >(tee -a $OUT/log2.txt) 2>&1
echo "== start $(date -u +%FT%TZ)"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || echo "!! pip failed"
PYTHONPATH=/tmp/site python3 -c "import transformers, peft; print('4.57 env:', transformers.__version__, peft.__version__)"
H=$R/.devwork/harness
(PYTHONPATH=$H python3 -m headroom_measure batch .devwork/specs-mask.jsonl --catalog $R/crates/headroom/data/models.json \
   --out $OUT/rows-5.17-mask.jsonl --jobs 2 --budget-gib 34 2>&1 | sed -u 's/^/[5.17] /') &
P1=$!
(PYTHONPATH=$H:/tmp/site python3 -m headroom_measure batch .devwork/specs-mask.jsonl --catalog $R/crates/headroom/data/models.json \
   --out $OUT/rows-4.57-mask.jsonl --jobs 2 --budget-gib 34 2>&1 | sed -u 's/^/[4.57] /') &
P2=$!
wait $P1 $P2
cat $OUT/*.errors 2>/dev/null | cut -c1-3000
python3 .devwork/pick.py $OUT/rows-5.17-mask.jsonl $OUT/rows-4.57-mask.jsonl .devwork/specs-mask.jsonl /tmp
echo "== end $(date -u +%FT%TZ) ($SECONDS s)"
