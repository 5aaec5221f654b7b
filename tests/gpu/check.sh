#!/bin/bash
# The GPU checks as one run, from the repository root on a machine with CUDA and the project's
# packages: tests/test_cuda.py on a cold Inductor cache, the realistic rows on the GPU
# (benchmarks/run.py --device cuda), then tests/test_cuda.py again on the warm cache.
# Writes env.txt, cuda_cold.txt, results.md/.json, bench_logs.txt, cuda_warm.txt to $OUT
# (default benchmarks/out/gpu). Stage limits in seconds: T_COLD, T_BENCH, T_WARM; rows: MODELS,
# METHODS. With torch older than 2.13, tests/gpu/sitecustomize.py patches its Triton launcher.
export PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/out/gpu}
mkdir -p "$OUT"
if python3 -c "import sys, torch; sys.exit(tuple(map(int, torch.__version__.split('.')[:2])) >= (2, 13))"; then
  export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/tests/gpu
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
{ date; nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv; nproc
  uptime; python3 -c "import torch, triton, transformers; print('torch', torch.__version__,
'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
PT="python3 -m pytest -q -p no:cacheprovider -p no:logging -rA --tb=short --durations=0 tests/test_cuda.py"
CACHE=$(mktemp -d)
T0=$(date +%s); TORCHINDUCTOR_CACHE_DIR=$CACHE timeout "${T_COLD:-300}" $PT > "$OUT/cuda_cold.txt" 2>&1
echo "cold rc=$? $(( $(date +%s) - T0 )) s"; grep -E "^(PASSED|FAILED|ERROR)|passed|failed" "$OUT/cuda_cold.txt" | tail -14
T0=$(date +%s); BENCH=$(mktemp -d)
timeout "${T_BENCH:-400}" python3 benchmarks/run.py --realistic --quick --steps 20 --warmup 3 \
  --device cuda --models ${MODELS:-mlp_1024 resnet_gn hf_gpt2_256 hf_llama_256 hf_gpt2_124m} \
  --methods ${METHODS:-eager compile opacus_ghost dpfx} --timeout 300 --out "$BENCH" > "$OUT/bench_stdout.txt" 2>&1
echo "bench rc=$? $(( $(date +%s) - T0 )) s"
cp "$BENCH/results.md" "$BENCH/results.json" "$OUT/" 2>/dev/null
cat "$BENCH"/logs/*.log 2>/dev/null | grep -v "^\s*$" | tail -300 > "$OUT/bench_logs.txt"
grep -E "^\| [0-9]" "$BENCH/results.md" 2>/dev/null | cut -c1-150
T0=$(date +%s); TORCHINDUCTOR_CACHE_DIR=$CACHE timeout "${T_WARM:-200}" $PT > "$OUT/cuda_warm.txt" 2>&1
echo "warm rc=$? $(( $(date +%s) - T0 )) s"; grep -E "passed|failed" "$OUT/cuda_warm.txt" | tail -2
