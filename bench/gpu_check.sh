#!/usr/bin/env bash
# The checks for a lent GPU machine, in one run of about 6 minutes (H200: tests 50 s, training 80 s,
# checkpoints about 220 s): the `gpu`-marked tests
# (tests/gpu: one GPU, world size 1) and bench_gpu.py on a Llama of ~1.1B parameters (seq 2048,
# batch 4: about 25 GiB on one H100). Needs torch and transformers (preinstalled there) and
# pytest for the tests (skipped with a note when missing); reaches no package registry.
# Everything it writes goes under $OUT (default ./gpu_check_out): versions, nvidia-smi, test log
# and JUnit XML, bench JSON and logs. Exit status: nonzero if any part failed.
#
# Usage, from anywhere: OUT=/path bash bench/gpu_check.sh
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$PWD/gpu_check_out}
PY=${PYTHON:-$(command -v python3 || command -v python)}
mkdir -p "$OUT"
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export BENCH_RESULTS_DIR="$OUT"
status=0

nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
'cuda', torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'NO GPU')" \
    2>&1 | tee "$OUT/versions.txt"

if $PY -c "import pytest" 2>/dev/null; then
    timeout 120 $PY -m pytest -q -m gpu tests/gpu -p no:cacheprovider -rA --junitxml="$OUT/gpu_tests.xml" \
        > "$OUT/gpu_tests.log" 2>&1 || status=1
    tail -n 25 "$OUT/gpu_tests.log"
else
    echo "pytest is not installed here: tests/gpu not run" | tee "$OUT/gpu_tests.log"
    status=1
fi

# training throughput first, checkpoints second: a timeout in the second keeps the first's JSON
SIZE=(--layers 16 --hidden 2048 --seq 2048 --batch 4)
timeout 160 $PY bench/bench_gpu.py "${SIZE[@]}" --steps 10 --repeats 3 --warmup 3 --adamw "${ADAMW:-fused}" \
    --variants plain-v1 ours-v1 plain-fsdp2 ours-v2 --out "$OUT/gpu_cuda_train.json" \
    > "$OUT/bench_gpu_train.log" 2>&1 || status=1
tail -n 8 "$OUT/bench_gpu_train.log"
# checkpoints of the same model at half the depth (~0.6B parameters, ~9 GB with AdamW state and
# fp32 masters): the full one's ~15 GB per save, four saves and a load per side, would not fit the
# 10 minutes; the time per byte is what compares
timeout 260 $PY bench/bench_gpu.py --layers 8 --hidden 2048 --seq 2048 --batch 4 --saves 2 --variants ckpt-dcp ckpt-ours \
    --ckpt-dir "${CKPT_DIR:-$(mktemp -d -p "$ROOT" .gpu-ckpt.XXXX)}" --out "$OUT/gpu_cuda_checkpoint.json" \
    > "$OUT/bench_gpu_checkpoint.log" 2>&1 || status=1
tail -n 5 "$OUT/bench_gpu_checkpoint.log"
echo "gpu_check: exit status $status; outputs in $OUT"
exit $status
