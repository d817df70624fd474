#!/usr/bin/env bash
# The 4-GPU runs of specs-x4.jsonl (HSDP 2 x 2, FSDP2 and DDP over 4 ranks) on nvidia-h200-x4:
#   bash bench/distributed/h200x4/run-x4.sh OUT_DIR     (from the repository root)
# Writes OUT_DIR/results-x4.jsonl (rank 0's record, every rank's in "ranks") and OUT_DIR/log-x4.txt.
set -u -o pipefail
out=${1:?give OUT_DIR}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=8
log="$out/log-x4.txt"
nvidia-smi --query-gpu=index,name,memory.total --format=csv 2>&1 | tee -a "$log"
i=0
while read -r line; do
  i=$((i + 1))
  id=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["id"])' "$line")
  spec=$(python3 -c 'import json,sys; print(json.dumps(json.loads(sys.argv[1])["spec"]))' "$line")
  echo "=== $id" | tee -a "$log"
  timeout -k 10 150 torchrun --nproc-per-node 4 --master-port $((29700 + i)) \
    -m headroom_measure dist --spec-json "$spec" --id "$id" --out "$out/results-x4.jsonl" 2>&1 \
    | grep -v '^{"id"' | tee -a "$log"
done < bench/distributed/h200x4/specs-x4.jsonl
