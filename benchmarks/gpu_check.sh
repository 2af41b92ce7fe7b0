#!/usr/bin/env bash
# The GPU checks in one run, on a machine with a CUDA device (issue 28). From the repository's root:
#
#     OUT=/some/folder bash benchmarks/gpu_check.sh          # default OUT: ./gpu-check-out
#
# 1. tests/cuda (twins against torch.amp.GradScaler, host syncs per step, CUDA graph capture and replay, the quick
#    demo on cuda, per-layer scales on GPT-2): about 1.5 minutes on one H100 (84 tests on 2026-11-26; 45 s with
#    4 workers), stopped after 4.
# 2. benchmarks/run_all.py --device cuda, one benchmark at a time (GPU_BENCHMARKS, merged with --only, so one that
#    fails leaves the others' sections): the GPU sections of a copy of benchmarks/RESULTS.md, about 5 minutes
#    on one H100, each benchmark stopped after 150 s (language_model: 240 s) or when the script's BUDGET (default
#    540 s, under the device tool's 600 s per command) runs out; the open measurements run first.
#
# 3. benchmarks/profile_step.py at the end-to-end model's size and at GPT-2 medium's: where a step's time goes, op by
#    op, for torch's scaler and LossScaleOptimizer with DynamicScale, PredictiveScale and per-layer scales by module
#    and by block (about a minute and a half).
#
# ONLY="name,name" runs those benchmarks of run_all.GPU_BENCHMARKS alone (tests/cuda and profile_step still run), for a
# check that has little device time left.
#
# Writes seven files under OUT: env.txt (nvidia-smi, python, torch, CUDA), cuda-tests.txt and cuda-tests.xml
# (pytest's report), benchmarks.txt (the benchmarks' log), RESULTS.md (the CPU sections as they were, the GPU sections
# new: copy it over benchmarks/RESULTS.md), json.tar.gz (each benchmark's JSON) and profile.txt (the profiles). The repository's own files are left
# alone. Uses python3 (PYTHON to change it) with lossscale from src/ on PYTHONPATH; needs torch with CUDA, pytest,
# matplotlib and tqdm (the demo). Exits 1 if a test or a benchmark failed.

set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-check-out}
PYTHON=${PYTHON:-python3}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$OUT/json"
BUDGET=${BUDGET:-540}
status=0
started=$SECONDS

{
    nvidia-smi
    "$PYTHON" -c "import sys, torch; print('python', sys.version.split()[0]); print('torch', torch.__version__, 'CUDA',
torch.version.cuda); print('device', torch.cuda.get_device_name() if torch.cuda.is_available() else None)
try:
    import triton; print('triton', triton.__version__)
except ImportError:
    print('triton: not installed (PredictiveScale reads amax with torch inf-norm)')"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

echo "== tests/cuda"
# Warnings are errors, as in CI (pyproject.toml). Four workers where pytest-xdist is installed; the image's
# pytest-benchmark plugin, which warns that xdist disables it, is left out.
workers=$("$PYTHON" -c "import xdist" 2>/dev/null && echo "-n 4")
timeout 240 "$PYTHON" -m pytest tests/cuda -q -rfEs --durations=8 $workers -p no:cacheprovider -p no:benchmark \
    --junitxml="$OUT/cuda-tests.xml" 2>&1 \
    | tee "$OUT/cuda-tests.txt" || status=1
echo "== tests/cuda took $((SECONDS - started)) s"

cp benchmarks/RESULTS.md "$OUT/RESULTS.md"
names=$("$PYTHON" -c "import sys; sys.path.insert(0, 'benchmarks'); import run_all
only = set(filter(None, '${ONLY:-}'.split(',')))
unknown = only - {name for name, _, _ in run_all.GPU_BENCHMARKS}
assert not unknown, f'ONLY names {sorted(unknown)}: not in run_all.GPU_BENCHMARKS'
print(' '.join(name for name, _, _ in run_all.GPU_BENCHMARKS if not only or name in only))") || exit 1
for name in $names; do
    left=$((BUDGET - (SECONDS - started)))
    if [ "$left" -lt 20 ]; then
        status=1
        echo "== $name NOT RUN: the budget of $BUDGET s is spent" | tee -a "$OUT/benchmarks.txt"
        continue
    fi
    echo "== benchmark $name (at $((SECONDS - started)) s)"
    limit=150
    [ "$name" = language_model ] && limit=240  # seven GPT-2 medium runs: about 3 minutes on one H100
    if ! timeout $((left < limit ? left : limit)) "$PYTHON" benchmarks/run_all.py --device cuda --only "$name" \
            --out "$OUT/RESULTS.md" --json-dir "$OUT/json" 2>&1 | tee -a "$OUT/benchmarks.txt"; then
        status=1
        echo "== $name FAILED" | tee -a "$OUT/benchmarks.txt"
    fi
done
echo "== profile_step (at $((SECONDS - started)) s)"
for size in "--d-model 512 --layers 6 --heads 8 --context 256 --sequences 32" \
            "--d-model 1024 --layers 24 --heads 16 --context 256 --sequences 16"; do
    left=$((BUDGET - (SECONDS - started)))
    if [ "$left" -lt 30 ]; then
        echo "== profile_step $size NOT RUN: the budget of $BUDGET s is spent" | tee -a "$OUT/profile.txt"
        continue
    fi
    # shellcheck disable=SC2086  # the sizes are words
    timeout $((left < 90 ? left : 90)) "$PYTHON" benchmarks/profile_step.py --device cuda $size >> "$OUT/profile.txt" 2>&1 \
        || echo "== profile_step $size FAILED" | tee -a "$OUT/profile.txt"
done
tar -czf "$OUT/json.tar.gz" -C "$OUT" json && rm -rf "$OUT/json"
echo "== done in $((SECONDS - started)) s, status $status"
exit $status
