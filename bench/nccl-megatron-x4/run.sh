#!/usr/bin/env bash
# On a 4-GPU device machine: every layout of specs.jsonl twice, under torch's fake process group (each line's
# `fake_ranks`, one process each, all at once, spread over the four GPUs) and then as a real world of 4 under
# `torchrun --nproc-per-node 4` (NCCL, every rank measured), one layout at a time. Lines with `snapshot` record rank
# 0's allocator history in both modes. ROOT holds python/, crates/headroom/data/models.json and this folder
# (default: the repository root); the megatron-core wheel is read from WHEELS (default ROOT/.whl). Rows:
# $OUT/nccl.jsonl and $OUT/fake.jsonl (appended as each run ends); $OUT/log.txt; every run's log in $OUT/logs.tar.gz;
# snapshots in $OUT/snap-nccl.tar and $OUT/snap-fake.tar. Real runs that would start after DEADLINE seconds (default
# 240) are skipped. SPECS: another spec file; MODES: `fake`, `nccl` or both (the default); TOGETHER=1: the real
# worlds all at once, sharing the four GPUs (each process's allocator counters are its own; the GPUs' timing is not).
#   OUT=/tmp/out bash bench/nccl-megatron-x4/run.sh
#   SPECS=bench/nccl-megatron-x4/specs-call2.jsonl MODES=nccl TOGETHER=1 OUT=/tmp/out bash bench/nccl-megatron-x4/run.sh
set -u
root=${ROOT:-$PWD}
here=$root/bench/nccl-megatron-x4
tmp=/tmp/nm
mkdir -p $tmp/logs $tmp/snap-nccl $tmp/snap-fake
exec > >(tee -a "$OUT/log.txt") 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "${WHEELS:-$root/.whl}"/megatron_core-*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH="$root/python:/tmp/site" OMP_NUM_THREADS=4
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
nvidia-smi topo -m
python3 -c 'import torch, transformers, megatron.core as m; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version(), "transformers", transformers.__version__, "megatron-core", m.__version__)'
# One tab-separated line per run: mode, id, spec, rank (fake) and snapshot file (or -).
python3 - "${SPECS:-$here/specs.jsonl}" "${MODES:-fake nccl}" > $tmp/runs.tsv <<'PY'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
for mode in sys.argv[2].split():
    for l in lines:
        name = l["id"].replace("/", "-")
        for rank in (l["fake_ranks"] if mode == "fake" else [0]):
            pp = l["spec"]["parallel"].get("pp", 1) > 1
            rid = l["id"] + (f"/rank{rank}" if pp else "") + "/fake" if mode == "fake" else l["id"]
            snap = f"{name}-{mode}.pickle" if l["snapshot"] and rank == 0 else "-"
            print("\t".join([mode, rid, json.dumps(l["spec"]), str(rank), snap]))
PY
n=0
pids=()
together=()
while IFS=$'\t' read -r mode id spec rank snap; do
  n=$((n + 1))
  args=(-m headroom_measure dist --spec-json "$spec" --id "$id" --out "$OUT/$mode.jsonl")
  [ "$snap" != - ] && args+=(--snapshot $tmp/snap-$mode/$snap)
  if [ "$mode" = fake ]; then
    ( start=$SECONDS
      CUDA_VISIBLE_DEVICES=$((n % 4)) HEADROOM_FAKE_WORLD=4 HEADROOM_FAKE_RANK=$rank WORLD_SIZE=4 RANK=0 LOCAL_RANK=0 \
        timeout -k 10 100 python3 "${args[@]}" < /dev/null > $tmp/logs/fake-$n.log 2>&1
      rc=$?; echo "[fake $((SECONDS - start))s rc=$rc gpu=$((n % 4))] $id"; [ $rc -ne 0 ] && tail -5 $tmp/logs/fake-$n.log ) &
    pids+=($!)
    continue
  fi
  # The real runs start once every fake run has ended: a real world takes all four GPUs.
  if [ ${#pids[@]} -gt 0 ]; then wait "${pids[@]}"; pids=(); fi
  if [ $SECONDS -gt "${DEADLINE:-240}" ]; then echo "!! deadline: skipped $id"; continue; fi
  ( start=$SECONDS
    timeout -k 10 80 torchrun --nproc-per-node 4 --master-port $((29500 + n)) "${args[@]}" < /dev/null > $tmp/logs/nccl-$n.log 2>&1
    rc=$?; echo "[nccl $((SECONDS - start))s rc=$rc] $id"; [ $rc -ne 0 ] && tail -8 $tmp/logs/nccl-$n.log ) &
  if [ -n "${TOGETHER-}" ]; then together+=($!); else wait $!; fi
done < $tmp/runs.tsv
if [ ${#together[@]} -gt 0 ]; then wait "${together[@]}"; fi
if [ ${#pids[@]} -gt 0 ]; then wait "${pids[@]}"; fi
tar -czf "$OUT/logs.tar.gz" -C $tmp logs runs.tsv
for mode in nccl fake; do
  gzip -9 $tmp/snap-$mode/*.pickle 2>/dev/null; tar -cf "$OUT/snap-$mode.tar" -C $tmp snap-$mode
done
echo "== done in $SECONDS s: $(cat "$OUT/nccl.jsonl" 2>/dev/null | wc -l) real rows, $(cat "$OUT/fake.jsonl" 2>/dev/null | wc -l) fake rows"
