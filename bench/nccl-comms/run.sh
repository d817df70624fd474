#!/usr/bin/env bash
# On a device machine (one GPU or more): NCCL's communicator costs outside the allocator (tools/comms.py, a world of
# every GPU), Megatron-core's real worlds of one rank (specs.jsonl lines with `world1`, NCCL, with each group's
# collectives counted by tools/census.py), and the same census of every `census/` line under the fake process group
# (a world of 4, one process per rank in `fake_ranks`, JOBS at once). NCCL logs its allocations
# (NCCL_DEBUG_SUBSYS=INIT,ALLOC). The megatron-core wheel is read from WHEELS (default .whl). Out: $OUT/comms.jsonl,
# $OUT/nccl.jsonl (the real rows), $OUT/census.tar.gz, $OUT/logs.tar.gz, $OUT/log.txt. SPECS: another spec file;
# COMMS=0: no probe.
#   OUT=/tmp/out bash bench/nccl-comms/run.sh
set -u
root=$PWD
here=$root/bench/nccl-comms
tmp=/tmp/nc
mkdir -p $tmp/logs $tmp/census
exec > >(tee -a "$OUT/log.txt") 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "${WHEELS:-$root/.whl}"/megatron_core-*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH="$root/python:/tmp/site" OMP_NUM_THREADS=4
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
gpus=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
python3 -c 'import torch; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version())'
if [ "${COMMS:-1}" = 1 ]; then
  NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,ALLOC timeout -k 10 120 torchrun --nproc-per-node $gpus --master-port 29400 \
    $here/tools/comms.py --out "$OUT/comms.jsonl" > $tmp/logs/comms.log 2>&1
  rc=$?; echo "[comms rc=$rc] world $gpus"; [ $rc -ne 0 ] && grep -v NCCL $tmp/logs/comms.log | tail -8
fi
python3 - "${SPECS:-$here/specs.jsonl}" > $tmp/runs.tsv <<'PY'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
# The real worlds first, each alone on the device (their device readings are their own).
for l in sorted(lines, key=lambda l: not l.get("world1")):
    for rank in ([0] if l.get("world1") else l["fake_ranks"]):
        print("\t".join(["nccl" if l.get("world1") else "fake", l["id"], json.dumps(l["spec"]), str(rank)]))
PY
n=0
pids=()
while IFS=$'\t' read -r mode id spec rank; do
  n=$((n + 1))
  name=$(echo "$id" | tr / -)-r$rank
  args=(dist --spec-json "$spec" --id "$id" --out "$OUT/$mode.jsonl")
  if [ "$mode" = nccl ]; then
    ( start=$SECONDS
      CENSUS_OUT=$tmp/census/$name.json NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,ALLOC timeout -k 10 150 \
        torchrun --nproc-per-node 1 --master-port $((29500 + n)) $here/tools/census.py "${args[@]}" < /dev/null > $tmp/logs/$name.log 2>&1
      echo "[nccl $((SECONDS - start))s rc=$?] $id" )
    continue
  fi
  while [ "$(jobs -rp | wc -l)" -ge "${JOBS:-4}" ]; do sleep 1; done
  ( start=$SECONDS
    CENSUS_OUT=$tmp/census/$name.json HEADROOM_FAKE_WORLD=4 HEADROOM_FAKE_RANK=$rank WORLD_SIZE=4 RANK=0 LOCAL_RANK=0 \
      timeout -k 10 150 python3 $here/tools/census.py "${args[@]}" < /dev/null > $tmp/logs/$name.log 2>&1
    rc=$?; echo "[fake $((SECONDS - start))s rc=$rc] $id rank $rank"; [ $rc -ne 0 ] && tail -5 $tmp/logs/$name.log ) &
  pids+=($!)
done < $tmp/runs.tsv
# By pid: a bare `wait` would also wait for the tee above.
if [ ${#pids[@]} -gt 0 ]; then wait "${pids[@]}"; fi
tar -czf "$OUT/census.tar.gz" -C $tmp census
tar -czf "$OUT/logs.tar.gz" -C $tmp logs runs.tsv
echo "== done in $SECONDS s"
