#!/usr/bin/env bash
# One run on a machine with a CUDA GPU: checks and times fedshield's CUDA paths.
#
#   bash benchmarks/gpu_check.sh     # from the repository root; OUT=DIR for the outputs (default runs/gpu-check)
#
# 1. the CUDA tests (tests/aggregation/test_cuda.py: every codec, rule, optimizer and the pinned
#    staging on the real device, against the CPU path and float64 references; the batched engine's
#    training on the GPU against one by one on the CPU, tests/simulations/test_batched.py);
# 2. python benchmarks/aggregation.py --device cuda (the issue's cases on the GPU, effective GB/s);
# 3. torch.profiler tables of the CUDA paths (benchmarks/gpu_profile.py; SKIP_PROFILE=1 skips it);
# 4. short in-process simulations with the coordinator and the clients on the GPU (plain, topk,
#    SecAgg+, local DP with Opacus; SKIP_SIM=1 skips them);
# 5. with RUN_CPU=1, the benchmark's CPU cases on this machine's cores;
# 6. benchmarks/vs_pfl.py --device cuda: ResNetMini (BatchNorm) rounds, fedshield's in-process engine training a
#    round's clients as one batched computation on the GPU against the plain loop, pfl and Flower's Ray engine on
#    the same GPU (each where it is installed; SKIP_VS_PFL=1 skips it).
# Logs and the benchmark's JSON go to $OUT. Where the machine lacks the project's packages (a GPU
# image without flwr, opacus...), wheels in .whl/ (benchmarks/gpu_wheels.sh fetches them) are
# installed into a temporary directory first.
set -u
OUT=${OUT:-runs/gpu-check}
SIM=runs/gpu-check-sim  # each simulation's run directory (runs/ is not tracked)
mkdir -p "$(dirname "$SIM")"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FEDSHIELD_DEVICE=cuda
PY=${PYTHON:-python3}
if [ -d .whl ]; then
    SITE=$(mktemp -d)
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
        || { echo "wheels did not install"; exit 1; }
    export PYTHONPATH=$SITE:$PWD
else
    export PYTHONPATH=$PWD
fi
status=0

{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
    $PY -c "import torch, numpy, flwr, sys; print(sys.version.split()[0], 'torch', torch.__version__, 'numpy', numpy.__version__, 'flwr', flwr.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0))"
    $PY -c "from aggregation import kernels; print('fused CPU kernels (numba):', kernels.enabled())"
    $PY -c "import importlib.util as u; print('installed:', *(f'{m} {u.find_spec(m) is not None}' for m in ('ray', 'pfl')))"
    nproc
} 2>&1 | tee "$OUT/env.txt"

echo "== 1. CUDA tests"
timeout 150 $PY -m pytest -q -p no:cacheprovider --noconftest tests/aggregation/test_cuda.py \
    tests/simulations/test_batched.py -k "cuda" 2>&1 | tee "$OUT/test_cuda.txt"
[ "${PIPESTATUS[0]}" = 0 ] || status=1

echo "== 2. benchmarks/aggregation.py --device cuda"
timeout 270 $PY benchmarks/aggregation.py --device cuda --json "$OUT/aggregation_cuda.json" 2>&1 | tee "$OUT/aggregation_cuda.txt"
[ "${PIPESTATUS[0]}" = 0 ] || status=1

echo "== 3. where the time goes: torch.profiler tables (benchmarks/gpu_profile.py)"
if [ "${SKIP_PROFILE:-0}" = 1 ]; then echo skipped; else
    timeout 150 $PY benchmarks/gpu_profile.py > "$OUT/profile.txt" 2>&1 || status=1
    grep "=====" "$OUT/profile.txt"
fi

echo "== 4. in-process simulations on the GPU"
if [ "${SKIP_SIM:-0}" = 1 ]; then echo skipped; else
    (fail=0; for args in "--rounds 5" "--rounds 5 --set run.codec=\"topk\"" "examples/scenarios/secagg.toml --rounds 3" \
                "--rounds 3 --set run.dp=\"local\""; do
        rm -rf "$SIM"
        echo "-- simulate --engine inprocess $args"
        eval timeout 60 $PY -m simulations.cli simulate --engine inprocess --run-dir "$SIM" $args > "$SIM.log" 2>&1 \
            || { echo "exit status $?"; fail=1; }
        grep -v "━" "$SIM.log"
        ls "$SIM" 2>/dev/null | tr '\n' ' '; echo
        [ -f "$SIM/metrics.csv" ] && tail -n 2 "$SIM/metrics.csv"
    done; exit $fail) 2>&1 | tee "$OUT/simulate.txt"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi

echo "== 5. the CPU cases on this machine's cores (RUN_CPU=1)"
if [ "${RUN_CPU:-0}" = 1 ]; then
    FEDSHIELD_DEVICE=cpu timeout 240 $PY benchmarks/aggregation.py --device cpu --json "$OUT/aggregation_cpu.json" 2>&1 \
        | tee "$OUT/aggregation_cpu.txt"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
else echo skipped; fi

echo "== 6. benchmarks/vs_pfl.py --device cuda (issue 26: >= 5x faster than Flower's engine)"
if [ "${SKIP_VS_PFL:-0}" = 1 ]; then echo skipped; else
    timeout 300 $PY benchmarks/vs_pfl.py --device cuda --rounds 4 --repeat 2 --json "$OUT/vs_pfl_cuda.json" 2>&1 \
        | tee "$OUT/vs_pfl_cuda.txt"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi

echo "== summary"
grep -E "passed|failed|error" "$OUT/test_cuda.txt" | tail -n 2
grep -E "^\S.*\[cuda\]" "$OUT/aggregation_cuda.txt"
[ -f "$OUT/simulate.txt" ] && grep -E "^final|error" "$OUT/simulate.txt"
[ -f "$OUT/vs_pfl_cuda.txt" ] && grep -E "^fedshield vs|skipped" "$OUT/vs_pfl_cuda.txt"
exit $status
