#!/usr/bin/env bash
# On a 4-GPU device machine, from the repository root: every spec line of specs.jsonl and both
# pipelines twice, as a real world under torchrun (NCCL, every rank measured) and as rank 0 of
# the same world under torch's fake process group (one process). The 2-rank real runs use GPUs
# 0-1 while the 2-rank fakes use GPU 2 and the 4-rank fakes GPU 3 (SNAPSHOT=1: GPU 3 also records
# one single-GPU snapshot for the trace corpus); the 4-rank real runs and pipelines use all four;
# the pipelines' fakes then take one GPU each. Rows: $OUT/nccl.jsonl and $OUT/fake.jsonl; logs
# $OUT/log.txt.
#   bash bench/nccl-x4/run.sh     (PHASES=B: the 4-rank real runs alone; SPECS=FILE other spec lines;
#                                  PIPELINES="" none of the pipelines)
set -u
here=bench/nccl-x4
mkdir -p /tmp/x4
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/python" OMP_NUM_THREADS=4
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
exec > >(tee -a "$OUT/log.txt") 2>&1
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
nvidia-smi topo -m
python3 -c 'import torch, transformers; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version(), "transformers", transformers.__version__)'
field() { python3 -c 'import json,sys; d=json.loads(sys.argv[1]); print(json.dumps(d[sys.argv[2]]) if sys.argv[2]=="spec" else d[sys.argv[2]])' "$1" "$2"; }
port=29600
real() {  # real GPUS ID SPEC_JSON | real GPUS ID --pipeline FILE
  local gpus=$1 id=$2; shift 2; port=$((port + 1)); local start=$SECONDS
  local n; n=$(echo "$gpus" | tr ',' '\n' | wc -l)
  if [ "$1" = --pipeline ]; then
    CUDA_VISIBLE_DEVICES=$gpus timeout -k 10 200 torchrun --nproc-per-node "$n" --master-port $port -m headroom_measure pipeline "$2" --id "$id" --out "$OUT/nccl.jsonl" > "/tmp/x4/real-${id//\//_}.log" 2>&1
  else
    CUDA_VISIBLE_DEVICES=$gpus timeout -k 10 200 torchrun --nproc-per-node "$n" --master-port $port -m headroom_measure dist --spec-json "$1" --id "$id" --out "$OUT/nccl.jsonl" > "/tmp/x4/real-${id//\//_}.log" 2>&1
  fi
  local rc=$?; echo "[real $((SECONDS - start))s rc=$rc gpus=$gpus] $id"; [ $rc -ne 0 ] && tail -4 "/tmp/x4/real-${id//\//_}.log"
}
fake() {  # fake GPU WORLD ID SPEC_JSON | fake GPU WORLD ID --pipeline FILE
  local gpu=$1 world=$2 id=$3; shift 3; local start=$SECONDS
  if [ "$1" = --pipeline ]; then
    CUDA_VISIBLE_DEVICES=$gpu HEADROOM_FAKE_WORLD=$world WORLD_SIZE=$world RANK=0 LOCAL_RANK=0 timeout -k 10 200 python3 -m headroom_measure pipeline "$2" --id "$id" --out "$OUT/fake.jsonl" > "/tmp/x4/fake-${id//\//_}.log" 2>&1
  else
    CUDA_VISIBLE_DEVICES=$gpu HEADROOM_FAKE_WORLD=$world WORLD_SIZE=$world RANK=0 LOCAL_RANK=0 timeout -k 10 200 python3 -m headroom_measure dist --spec-json "$1" --id "$id" --out "$OUT/fake.jsonl" > "/tmp/x4/fake-${id//\//_}.log" 2>&1
  fi
  local rc=$?; echo "[fake $((SECONDS - start))s rc=$rc gpu=$gpu] $id"; [ $rc -ne 0 ] && tail -4 "/tmp/x4/fake-${id//\//_}.log"
}
mapfile -t lines < "${SPECS:-$here/specs.jsonl}"
w2=(); w4=()
for l in "${lines[@]}"; do
  if [ "$(field "$l" spec | python3 -c 'import json,sys; print(json.load(sys.stdin)["parallel"]["world_size"])')" = 2 ]; then w2+=("$l"); else w4+=("$l"); fi
done
# Only the runs are waited for: a bare `wait` would also wait for the log's tee.
phases=${PHASES:-ABC}
pids=()
# A: the 2-rank real runs on GPUs 0-1, beside the 2-rank fakes on GPU 2 and the 4-rank fakes on GPU 3.
if [[ $phases == *A* ]]; then
( for l in "${w2[@]}"; do real 0,1 "$(field "$l" id)" "$(field "$l" spec)"; done ) &
pids+=($!)
( for l in "${w2[@]}"; do fake 2 2 "$(field "$l" id)" "$(field "$l" spec)"; done ) &
pids+=($!)
( for l in "${w4[@]}"; do fake 3 4 "$(field "$l" id)" "$(field "$l" spec)"; done
  if [ -n "${SNAPSHOT-}" ]; then
    # A snapshot for the trace corpus (bench/trace): the one row whose traced reserved memory is off.
    l=$(cat "$here/snapshot-pythia-eager.jsonl")
    CUDA_VISIBLE_DEVICES=3 timeout -k 10 120 python3 -m headroom_measure run --spec-json "$(field "$l" spec)" \
      --id "$(field "$l" id)" --snapshot /tmp/x4/pythia-eager-fwd.pickle > /tmp/x4/pythia.log 2>&1
    echo "[snapshot rc=$?] $(field "$l" id)"; gzip -9 /tmp/x4/pythia-eager-fwd.pickle && cp /tmp/x4/pythia-eager-fwd.pickle.gz "$OUT/"
  fi ) &
pids+=($!)
wait "${pids[@]}"
fi
# B: the 4-rank real runs, then the pipelines.
if [[ $phases == *B* ]]; then
for l in "${w4[@]}"; do real 0,1,2,3 "$(field "$l" id)" "$(field "$l" spec)"; done
for p in ${PIPELINES-verl slime}; do real 0,1,2,3 "$p-fsdp2-q7b-w4" --pipeline "$here/pipelines/$p-fsdp2-q7b-w4.yaml"; done
fi
# C: the pipelines' fakes, one GPU each.
if [[ $phases == *C* ]]; then
pids=()
gpu=0
for p in ${PIPELINES-verl slime}; do
  fake $gpu 4 "$p-fsdp2-q7b-w4" --pipeline "$here/pipelines/$p-fsdp2-q7b-w4.yaml" &
  pids+=($!); gpu=$((gpu + 1))
done
wait "${pids[@]}"
fi
echo "== done in $SECONDS s: $(cat "$OUT/nccl.jsonl" 2>/dev/null | wc -l) real rows, $(cat "$OUT/fake.jsonl" 2>/dev/null | wc -l) fake rows"
