#!/usr/bin/env bash
# The GPU checks of issue 16 in one call, for a lent GPU machine (the `device` tool) or any CUDA box:
#   bash scripts/gpu_check.sh [LOG_DIR]
# 1. scripts/bench_gpu.py's capture part alone, first and with nothing else running: capture vs a plain forward
#    (every cell at batch >= 8 must reach 0.9; 9 interleaved rounds, each row printed as it is measured);
# 2. `pytest -m cuda` (every init x {on CUDA, spread CUDA + CPU} x {fp32, bf16}, every output architecture, capture
#    and route on CUDA vs CPU);
# 3. the build/gates/route tests with the GPU present (device "auto" picks it), 8 workers of 2 threads;
# 4. bench_gpu.py's upcycle_model timing and train/save/reload round trip.
# One after another (side by side, 8 workers of 16 threads each and the benchmark slowed each other past their
# limits on an H200's 16 cores). GPU_STEPS="cuda_tests gpu_present_tests" runs only those. Each step has its own
# time limit (220 + 120 + 200 + 120 s; about 430 s in all when it passes, so run it in two calls if the device tool
# allows 600 s a call) and writes its log to LOG_DIR (default: $OUT or ./gpu_logs); a failing step does not stop
# the next. Wheels in .whl/ (git-ignored;
# for a machine without a registry) are installed to /tmp/site and put first on the path. For the lent H100/H200
# image (Python 3.12, no pydantic or ruamel.yaml, another transformers):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl transformers==5.24.0 \
#     pydantic==2.13.4 pydantic-core==2.46.4 annotated-types typing-inspection ruamel.yaml
set -u -o pipefail
cd "$(dirname "$0")/.."
LOG=${1:-${OUT:-gpu_logs}}
mkdir -p "$LOG"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
SUM=$(mktemp -d)  # each step's summary (LOG holds only the logs: the device tool returns 8 files at most)
step() {  # name, seconds, command...: runs it, then writes what it found to $SUM/name
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" >"$LOG/$name.log" 2>&1
  local rc=$?
  { echo "== $name: exit $rc in $((SECONDS - t0)) s"
    grep -E "^(\[gw[0-9]+\] )?(FAILED|ERROR)|(FAILED|ERROR) tests/" "$LOG/$name.log" | head -n 20
    tail -n 25 "$LOG/$name.log"; } >"$SUM/$name"
}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers, accelerate; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'transformers', transformers.__version__, 'accelerate', accelerate.__version__)"; } 2>&1 | tee "$LOG/env.log"
want() { [[ " ${GPU_STEPS:-bench_capture cuda_tests gpu_present_tests bench_round_trip} " == *" $1 "* ]]; }
if want bench_capture; then
  step bench_capture 220 python3 scripts/bench_gpu.py --shapes 2048x16,4096x32 --batch-sizes 8,32,256 --repeats 9 \
    --prompts-per-expert 96 --skip per_layer,upcycle,roundtrip
  cat "$SUM/bench_capture"
fi
if want cuda_tests; then
  step cuda_tests 120 python3 -m pytest -v -p no:cacheprovider -m cuda tests/test_cuda_paths.py -rs
  cat "$SUM/cuda_tests"
fi
if want gpu_present_tests; then  # 8 workers of 2 threads each on 16 cores (each would take 16 threads otherwise)
  OMP_NUM_THREADS=2 step gpu_present_tests "${GPU_SUITE_SECONDS:-200}" python3 -m pytest -v -p no:cacheprovider \
    -p no:benchmark -n 8 --tb=short -rfE tests/test_hidden_gates.py tests/test_research_path.py \
    tests/test_cli_build.py tests/test_route.py tests/test_plan_memory.py tests/test_trust_recipe.py
  cat "$SUM/gpu_present_tests"  # -v: each result is logged as it ends, a cut-off run too
fi
if want bench_round_trip; then
  step bench_round_trip 120 python3 scripts/bench_gpu.py --shapes 2048x16 --steps 50 --skip capture
  cat "$SUM/bench_round_trip"
fi
