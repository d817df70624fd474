#!/usr/bin/env bash
# On a 2-GPU device machine, from the repository root: every line of specs.jsonl twice, as a real
# world of 2 under torchrun (NCCL, both ranks measured, GPUs 0-1) and as rank 0 of the same world
# under torch's fake process group (one process, one GPU; two fakes at a time once the real runs
# are done). Rows: $OUT/nccl.jsonl and $OUT/fake.jsonl; log $OUT/log.txt.
#   bash bench/nccl-x2/run.sh
set -u
here=bench/nccl-x2
mkdir -p /tmp/x2
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/python" OMP_NUM_THREADS=4
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
exec > >(tee -a "$OUT/log.txt") 2>&1
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
nvidia-smi topo -m
python3 -c 'import torch, transformers; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version(), "transformers", transformers.__version__)'
field() { python3 -c 'import json,sys; d=json.loads(sys.argv[1]); print(json.dumps(d[sys.argv[2]]) if sys.argv[2]=="spec" else d[sys.argv[2]])' "$1" "$2"; }
mapfile -t lines < "${SPECS:-$here/specs.jsonl}"
port=29600
for l in "${lines[@]}"; do
  id=$(field "$l" id); port=$((port + 1)); start=$SECONDS
  CUDA_VISIBLE_DEVICES=0,1 timeout -k 10 200 torchrun --nproc-per-node 2 --master-port $port -m headroom_measure dist \
    --spec-json "$(field "$l" spec)" --id "$id" --out "$OUT/nccl.jsonl" > "/tmp/x2/real-${id//\//_}.log" 2>&1
  rc=$?; echo "[real $((SECONDS - start))s rc=$rc] $id"; [ $rc -ne 0 ] && tail -5 "/tmp/x2/real-${id//\//_}.log"
done
fake() {  # fake GPU LINE
  local gpu=$1 l=$2; local id; id=$(field "$l" id); local start=$SECONDS
  CUDA_VISIBLE_DEVICES=$gpu HEADROOM_FAKE_WORLD=2 WORLD_SIZE=2 RANK=0 LOCAL_RANK=0 timeout -k 10 200 python3 -m headroom_measure dist \
    --spec-json "$(field "$l" spec)" --id "$id/fake" --out "$OUT/fake-$gpu.jsonl" > "/tmp/x2/fake-${id//\//_}.log" 2>&1
  local rc=$?; echo "[fake $((SECONDS - start))s rc=$rc gpu=$gpu] $id"; [ $rc -ne 0 ] && tail -5 "/tmp/x2/fake-${id//\//_}.log"
}
pids=()
( for k in "${!lines[@]}"; do [ $((k % 2)) = 0 ] && fake 0 "${lines[$k]}"; done ) & pids+=($!)
( for k in "${!lines[@]}"; do [ $((k % 2)) = 1 ] && fake 1 "${lines[$k]}"; done ) & pids+=($!)
# Only the runs: a bare `wait` would also wait for the log's tee.
wait "${pids[@]}"
cat "$OUT"/fake-*.jsonl > "$OUT/fake.jsonl" 2>/dev/null; rm -f "$OUT"/fake-[01].jsonl
echo "== done in $SECONDS s"
