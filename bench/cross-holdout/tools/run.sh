#!/bin/bash
# The device call of bench/cross-holdout, from the repository root, carrying .whl-trl and .whl-cross:
#   DEADLINE=360 HARD=520 bash bench/cross-holdout/tools/run.sh
#   SPECDIR=bench/cross-holdout/tools/call2 DEADLINE=360 HARD=520 bash bench/cross-holdout/tools/run.sh   (call 2)
# It runs the existing harnesses only, in three lanes side by side on the one GPU (each process has its own
# caching allocator, so no allocated or reserved byte changes; timings mean nothing):
#   lane 1: specs-trainers.jsonl shard 0/2 (python -m headroom_measure.trainers, TRL 1.16 from .whl-trl), then
#           specs-older-4.55.4 and -4.56.2 (python -m headroom_measure batch under those releases)
#   lane 2: specs-trainers.jsonl shard 1/2, then specs-trainers-4.57.1.jsonl shard 0/2 (transformers 4.57.1)
#   lane 3: specs-fsdp2-mp.jsonl (bench/fsdp2-mp/tools/run.sh: rank 0 of a fake process group), then
#           specs-older-4.57.1, then specs-trainers-4.57.1.jsonl shard 1/2
# .whl-cross/sites.tar.xz holds `pip install --target site-<release>` trees: transformers 4.55.4 (tokenizers 0.21.4),
# 4.56.2 and 4.57.1 (tokenizers 0.22.1), all with huggingface_hub 0.36.0; site-4.57.1 also has TRL 1.16.0,
# datasets 4.8.4 (5.2 needs huggingface_hub >= 1.31, which 4.57 refuses), dill 0.4.1, multiprocess 0.70.19.
# No spec starts after DEADLINE s; every harness call is killed at HARD s; then everything is packed under $OUT.
set -u
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 HEADROOM_SHARED_GPU=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
D=${SPECDIR:-bench/cross-holdout}  # the spec files' folder; a file missing there is skipped
DEADLINE=${DEADLINE:-330}
HARD=${HARD:-520}
R=$PWD
W=/tmp/x
mkdir -p $W/snap $W/logs
exec > >(tee -a $W/logs/driver.log) 2>&1
echo "== start $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-trl/*.whl \
  || { echo "!! pip install failed"; exit 1; }
mkdir -p /tmp/sites && tar -xJf .whl-cross/sites.tar.xz -C /tmp/sites || { echo "!! untar failed"; exit 1; }
for p in /tmp/site /tmp/sites/site-4.55.4 /tmp/sites/site-4.56.2 /tmp/sites/site-4.57.1; do
  PYTHONPATH=$R/python:$p python3 -c 'import importlib, sys
out = []
for n in ["torch", "transformers", "trl", "peft", "accelerate", "datasets", "tokenizers", "huggingface_hub", "pyarrow"]:
    try:
        out.append(f"{n} {importlib.import_module(n).__version__}")
    except Exception as e:
        out.append(f"{n} -")
print("versions", sys.argv[1], ", ".join(out))' $p
done
left() { local l=$((HARD - SECONDS)); [ $l -lt 1 ] && l=1; echo $l; }
trainers() {  # SITE SPECS ROWS SHARD
  [ -s $2 ] || return
  local d=$((DEADLINE - SECONDS))
  [ $d -le 0 ] && { echo "!! deadline: $2 shard $4 not started"; return; }
  PYTHONPATH=$R/python:$1 timeout $(left) python3 -m headroom_measure.trainers batch $2 --out $W/$3 \
    --snapshot-dir $W/snap --shard $4 --deadline $d --timeout 200 2>&1 | sed -u "s|^|[$3 $4] |"
}
older() {  # RELEASE
  [ -s $D/specs-older-$1.jsonl ] || return
  [ $SECONDS -ge $DEADLINE ] && { echo "!! deadline: older $1 not started"; return; }
  PYTHONPATH=$R/python:/tmp/sites/site-$1 timeout $(left) python3 -m headroom_measure batch $D/specs-older-$1.jsonl \
    --out $W/rows-older-$1.jsonl --snapshot-dir $W/snap --catalog crates/headroom/data/models.json 2>&1 \
    | sed -u "s|^|[older $1] |"
}
( trainers /tmp/site $D/specs-trainers.jsonl rows-trainers.jsonl 0/2
  older 4.55.4
  older 4.56.2 ) & a=$!
( trainers /tmp/site $D/specs-trainers.jsonl rows-trainers.jsonl 1/2
  trainers /tmp/sites/site-4.57.1 $D/specs-trainers-4.57.1.jsonl rows-trainers-4.57.1.jsonl 0/2 ) & b=$!
( [ -s $D/specs-fsdp2-mp.jsonl ] && OUT=$W/fsdp SPECS=$D/specs-fsdp2-mp.jsonl JOBS=1 DEADLINE=$DEADLINE timeout $(left) bash bench/fsdp2-mp/tools/run.sh \
    2>&1 | sed -u "s|^|[fsdp] |"
  older 4.57.1
  trainers /tmp/sites/site-4.57.1 $D/specs-trainers-4.57.1.jsonl rows-trainers-4.57.1.jsonl 1/2 ) & c=$!
# Wait on the lanes by id: a bare `wait` also waits for the log's tee, which never ends.
wait $a $b $c
echo "== measured ($SECONDS s)"
cp $W/fsdp/rows.jsonl $W/rows-fsdp2-mp.jsonl 2>/dev/null
cp $W/fsdp/log.txt $W/logs/fsdp2-mp.log 2>/dev/null
for f in $W/fsdp/snap/*.gz; do [ -f "$f" ] && cp $f $W/snap/; done
for f in $W/snap/*.pickle; do [ -f "$f" ] && gzip -9 $f; done
ls -la $W $W/snap
for f in $W/rows-*.jsonl; do echo "$f: $(wc -l < $f) rows"; done
cat $W/*.errors 2>/dev/null | cut -c1-3000
echo "== end $(date -u +%FT%TZ) ($SECONDS s)"
tar -cf $OUT/results.tar -C $W $(cd $W && ls -d rows-*.jsonl *.errors logs 2>/dev/null)
n=0
for f in $W/snap/*.pickle.gz; do
  if [ -f "$f" ] && [ $(stat -c %s $f) -lt 16000000 ] && [ $n -lt 7 ]; then cp $f $OUT/; n=$((n + 1)); fi
done
ls -la $OUT
