#!/usr/bin/env bash
# On the device, from the repository root: every line of bench/fsdp2-mp/specs.jsonl (or SPECS), JOBS at a time, a
# fresh process each: `fake: true` lines as rank 0 of a world of world_size under torch's fake process group
# (HEADROOM_FAKE_WORLD, one process; a line's `rank`, default 0, is the rank it plays), the others under `torchrun --nproc-per-node 1` (NCCL). Rows to
# $OUT/rows.jsonl, logs to $OUT/log.txt, snapshots (lines that name one) to $OUT/snap/. Lines that would start after
# DEADLINE seconds are skipped. ZeRO lines need DeepSpeed: wheels in .whl-ds/ (bench/distributed/README.md says
# which) are installed into /tmp/site-ds and put on PYTHONPATH.
#   bash bench/fsdp2-mp/tools/run.sh
#   SPECS=bench/scale/specs.jsonl bash bench/fsdp2-mp/tools/run.sh
#   HARNESS=DIR: the measuring harness from DIR instead of python/ (one carried to the device)
set -u
specs=${SPECS:-bench/fsdp2-mp/specs.jsonl}
jobs=${JOBS:-3}
deadline=${DEADLINE:-420}
mkdir -p "$OUT/snap" /tmp/mp
export PYTHONUNBUFFERED=1 PYTHONPATH="${HARNESS:-$PWD/python}" OMP_NUM_THREADS=4
if ls .whl-ds/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-ds .whl-ds/*.whl
  export PYTHONPATH="$PYTHONPATH:/tmp/site-ds"
fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
exec > >(tee -a "$OUT/log.txt") 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
n=0
pids=()
while IFS= read -r line; do
  [ -z "$line" ] && continue
  if [ $SECONDS -gt "$deadline" ]; then echo "!! deadline: skipped $(echo "$line" | python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])')"; continue; fi
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do sleep 1; done
  n=$((n + 1)); port=$((29500 + n))
  (
    id=$(echo "$line" | python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])')
    spec=$(echo "$line" | python3 -c 'import json,sys; print(json.dumps(json.load(sys.stdin)["spec"]))')
    fake=$(echo "$line" | python3 -c 'import json,sys; print(int(json.load(sys.stdin)["fake"]))')
    world=$(echo "$line" | python3 -c 'import json,sys; print(json.load(sys.stdin)["spec"]["parallel"]["world_size"])')
    snap=$(echo "$line" | python3 -c 'import json,sys; print(json.load(sys.stdin).get("snapshot", ""))')
    rank=$(echo "$line" | python3 -c 'import json,sys; print(json.load(sys.stdin).get("rank", 0))')
    args=(-m headroom_measure dist --spec-json "$spec" --out /tmp/mp/rows-$n.jsonl --id "$id")
    [ -n "$snap" ] && args+=(--snapshot /tmp/mp/$snap)
    start=$SECONDS
    if [ "$fake" = 1 ]; then
      HEADROOM_FAKE_WORLD=$world HEADROOM_FAKE_RANK=$rank WORLD_SIZE=$world RANK=0 LOCAL_RANK=0 timeout 200 python3 "${args[@]}" > /tmp/mp/log-$n.txt 2>&1
    else
      timeout 200 torchrun --nproc-per-node 1 --master-port $port "${args[@]}" > /tmp/mp/log-$n.txt 2>&1
    fi
    rc=$?
    echo "[$((SECONDS - start))s rc=$rc] $id"
    [ $rc -ne 0 ] && tail -5 /tmp/mp/log-$n.txt
  ) &
  pids+=($!)
done < "$specs"
# Only the runs: a bare `wait` would also wait for the log's tee.
wait "${pids[@]}"
cat /tmp/mp/rows-*.jsonl > "$OUT/rows.jsonl" 2>/dev/null
for f in /tmp/mp/*.pickle; do [ -f "$f" ] && gzip -9 "$f" && cp "$f.gz" "$OUT/snap/"; done
echo "== done in $SECONDS s: $(wc -l < "$OUT/rows.jsonl") rows"
