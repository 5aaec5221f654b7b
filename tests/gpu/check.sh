#!/bin/bash
# The GPU checks as one run, from the repository root on a machine with CUDA and the project's
# packages: tests/gpu/test_cuda.py on a cold Inductor cache, the realistic rows on the GPU
# (benchmarks/run.py --device cuda), each step taken apart (benchmarks/kernels.py --device cuda:
# wall, host and GPU busy time, kernels, the host's time by call), then tests/gpu/test_cuda.py again
# on the warm cache. Writes env.txt, cuda_cold.txt, results.md/.json, bench_logs.txt,
# kernels_gpu.md, cuda_warm.txt to $OUT (default benchmarks/out/gpu).
# Stage limits in seconds (their defaults fit a 10-minute command; 0 skips a stage): T_COLD,
# T_BENCH, T_KERN, T_WARM; rows: MODELS, METHODS (run.py), KERN_MODELS, KERN_FLAGS (kernels.py;
# default --memory: the buffers live at each step's peak).
# VARIANTS: Inductor settings measured as levers, each a further kernels.py run of T_VAR seconds
# with that setting on both sides (e.g. VARIANTS="combo_kernels=True"), written to
# kernels_gpu_<setting>.md. T_AB (default 0: off): dpfx with and without combo kernels, interleaved
# in one process (benchmarks/step_ab.py combo_kernels) for each "model:batch" of AB_ROWS, to
# step_ab.md. Wheels the machine lacks
# (opacus, dp-accounting and its dm-tree, for its Python) can travel in $WHEELS (default .whl,
# an ignored folder): they are installed under /tmp for the run. With torch older than 2.13,
# tests/gpu/sitecustomize.py patches its Triton launcher.
export PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/out/gpu}
WHEELS=${WHEELS:-.whl}
mkdir -p "$OUT"
if ls "$WHEELS"/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/dpfx-gpu-site "$WHEELS"/*.whl && export PYTHONPATH=/tmp/dpfx-gpu-site
fi
if python3 -c "import sys, torch; sys.exit(tuple(map(int, torch.__version__.split('.')[:2])) >= (2, 13))"; then
  export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/tests/gpu
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
{ date; nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv; nproc
  uptime; python3 -c "import torch, triton, transformers; print('torch', torch.__version__,
'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
PT="python3 -m pytest -q -p no:cacheprovider -p no:logging -rA --tb=short --durations=0 tests/gpu/test_cuda.py"
CACHE=$(mktemp -d)
if [ "${T_COLD:-180}" != 0 ]; then
T0=$(date +%s); TORCHINDUCTOR_CACHE_DIR=$CACHE timeout "${T_COLD:-180}" $PT > "$OUT/cuda_cold.txt" 2>&1
echo "cold rc=$? $(( $(date +%s) - T0 )) s"; grep -E "^(PASSED|FAILED|ERROR)|passed|failed" "$OUT/cuda_cold.txt" | tail -16
fi
if [ "${T_BENCH:-170}" != 0 ]; then
T0=$(date +%s); BENCH=$(mktemp -d)
timeout "${T_BENCH:-170}" python3 benchmarks/run.py --realistic --quick --steps 20 --warmup 3 \
  --device cuda --models ${MODELS:-mlp_1024 hf_gpt2_256 hf_llama_256} \
  --methods ${METHODS:-eager compile opacus_ghost dpfx} --timeout 120 --out "$BENCH" > "$OUT/bench_stdout.txt" 2>&1
echo "bench rc=$? $(( $(date +%s) - T0 )) s"
cp "$BENCH/results.md" "$BENCH/results.json" "$OUT/" 2>/dev/null
cat "$BENCH"/logs/*.log 2>/dev/null | grep -v "^\s*$" | tail -300 > "$OUT/bench_logs.txt"
grep -E "^\| [0-9]" "$BENCH/results.md" 2>/dev/null | cut -c1-150
fi
kernels() {   # name, time limit, kernels.py flags
  T0=$(date +%s)
  timeout "$2" python3 benchmarks/kernels.py ${KERN_MODELS:-mlp_1024 hf_gpt2_256} --device cuda \
    --steps 30 --top 25 ${KERN_FLAGS---memory} "${@:3}" --out "$OUT/$1.md" > "$OUT/$1_stdout.txt" 2>&1
  echo "$1 rc=$? $(( $(date +%s) - T0 )) s"
  grep -E "^\| [a-z]" "$OUT/$1.md" 2>/dev/null | grep -v "^| model"
}
[ "${T_KERN:-150}" != 0 ] && kernels kernels_gpu "${T_KERN:-150}"
for v in $VARIANTS; do kernels "kernels_gpu_${v%%=*}" "${T_VAR:-120}" --inductor "$v"; done
if [ "${T_AB:-0}" != 0 ]; then
  T0=$(date +%s)
  for row in ${AB_ROWS:-hf_gpt2_256:16 mlp_1024:1024}; do
    timeout "$T_AB" python3 benchmarks/step_ab.py combo_kernels "${row%%:*}" "${row##*:}" \
      --rounds 30 --device cuda 2>> "$OUT/step_ab_stderr.txt" | tee -a "$OUT/step_ab.md"
  done
  echo "step_ab $(( $(date +%s) - T0 )) s"
fi
if [ "${T_WARM:-60}" != 0 ]; then
T0=$(date +%s); TORCHINDUCTOR_CACHE_DIR=$CACHE timeout "${T_WARM:-60}" $PT > "$OUT/cuda_warm.txt" 2>&1
echo "warm rc=$? $(( $(date +%s) - T0 )) s"; grep -E "passed|failed" "$OUT/cuda_warm.txt" | tail -2
fi
