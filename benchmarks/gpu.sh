#!/usr/bin/env bash
# Every GPU check of the project on one CUDA GPU, from the repository root; results and logs go to OUT_DIR:
#
#     benchmarks/gpu.sh OUT_DIR
#
# 1. the GPU tests (skipped where there is no GPU): pipelines of 2 to 4 processes sharing the GPU over gloo, each
#    schedule (tests/test_pipelines_cuda.py), one stage with NCCL, spilling and the multi-model sweep;
# 2. the model-selection study on the GPU (benchmarks/model_selection.py --accelerator gpu --devices 1).
# Each part has a time limit, so that one that hangs leaves the others their time.
set -u
out=${1:?usage: benchmarks/gpu.sh OUT_DIR}
mkdir -p "$out"
python=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$out/gpu.txt" 2>&1
"$python" -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__)" \
    >>"$out/gpu.txt" 2>&1

timeout "${TESTS_TIMEOUT:-210}" "$python" -m pytest -q -n 4 -p no:cacheprovider --durations=15 \
    tests/test_pipelines_cuda.py tests/test_varuna_cuda.py tests/test_spilling_cuda.py tests/test_multi_model_cuda.py \
    >"$out/tests.log" 2>&1
echo "tests: exit $?" >>"$out/gpu.txt"

timeout "${STUDY_TIMEOUT:-180}" "$python" benchmarks/model_selection.py --accelerator gpu --devices 1 \
    --ways optuna-workers task-queue sweep >"$out/model_selection.log" 2>&1
echo "model selection: exit $?" >>"$out/gpu.txt"
cp benchmarks/results/model_selection_gpu.json "$out/" 2>/dev/null
cat "$out/gpu.txt"
