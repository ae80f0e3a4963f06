#!/usr/bin/env bash
# Every GPU check of the project on one CUDA GPU, from the repository root; results and logs go to OUT_DIR:
#
#     benchmarks/gpu.sh OUT_DIR
#
# 1. tokens/s and MFU of a GPT-2-small-sized GPT: plain Lightning, VarunaStrategy at one stage, two stages sharing
#    the GPU (benchmarks/gpu_throughput.py);
# 2. SpillingStrategy against the model in GPU memory and FSDP2's CPU offload (benchmarks/gpu_spilling.py);
# 3. the GPU tests (skipped where there is no GPU): pipelines of 2 to 4 processes sharing the GPU over gloo, each
#    schedule (tests/test_pipelines_cuda.py), one stage with NCCL, spilling and the multi-model sweep;
# 4. with STUDY=1, the model-selection study on the GPU (benchmarks/model_selection.py --accelerator gpu --devices 1).
# Each part has a time limit, so that one that hangs leaves the others their time: 1-3 took 6.7 minutes on an H200.
set -u
out=${1:?usage: benchmarks/gpu.sh OUT_DIR}
mkdir -p "$out"
python=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$out/gpu.txt" 2>&1
"$python" -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__)" \
    >>"$out/gpu.txt" 2>&1

timeout "${THROUGHPUT_TIMEOUT:-130}" "$python" benchmarks/gpu_throughput.py --out "$out/gpu_throughput.json" \
    >"$out/throughput.log" 2>&1
echo "throughput: exit $?" >>"$out/gpu.txt"

timeout "${SPILLING_TIMEOUT:-170}" "$python" benchmarks/gpu_spilling.py --out "$out/gpu_spilling.json" \
    >"$out/spilling.log" 2>&1
echo "spilling: exit $?" >>"$out/gpu.txt"

timeout "${TESTS_TIMEOUT:-180}" "$python" -m pytest -q -n 4 -p no:cacheprovider --durations=15 \
    tests/test_pipelines_cuda.py tests/test_varuna_cuda.py tests/test_spilling_cuda.py tests/test_multi_model_cuda.py \
    >"$out/tests.log" 2>&1
echo "tests: exit $?" >>"$out/gpu.txt"

[ "${STUDY:-0}" = 1 ] || { cat "$out/gpu.txt"; exit; }
timeout "${STUDY_TIMEOUT:-180}" "$python" benchmarks/model_selection.py --accelerator gpu --devices 1 \
    --ways optuna-workers task-queue sweep >"$out/model_selection.log" 2>&1
echo "model selection: exit $?" >>"$out/gpu.txt"
cp benchmarks/results/model_selection_gpu.json "$out/" 2>/dev/null
cat "$out/gpu.txt"
