set -u
export PYTHONUNBUFFERED=1
exec > >(tee -a $OUT/log.txt) 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/transformers-4.57.1*.whl .whl/huggingface_hub-0.36.0*.whl .whl/tokenizers-0.22.1*.whl
PYTHONPATH=$PWD/python:/tmp/site python3 -c "import transformers, torch; print(transformers.__version__, torch.__version__)"
mkdir -p $OUT/snap
PYTHONPATH=$PWD/python:/tmp/site timeout 520 python3 -m headroom_measure batch .device/tf457b/specs.jsonl --out $OUT/rows.jsonl --jobs 2 --budget-gib 76 --snapshot-dir $OUT/snap
gzip -9 $OUT/snap/*.pickle 2>/dev/null
ls -la $OUT $OUT/snap
