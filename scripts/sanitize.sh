#!/usr/bin/env bash
# compute-sanitizer over the GPU tests that cover every build: memcheck over the specialised and
# generic RoPE builds (every dtype, layout, pair style and position scheme, prefill and decode,
# in and out of place), MRoPE, QK-norm and the tail kernel; racecheck and synccheck over the
# kernels that use shared memory (MRoPE with interleaved sections, gathered per block; the staged
# QK-norm build, whose threads each keep their own slots). Run from
# the repository root on a GPU machine:
#     bash scripts/sanitize.sh [scale]
# SANITIZE_ONLY=<regex> runs only the tool runs whose "<tool> <name>" matches (say 'mrope' for the
# multimodal builds alone).
# Each tool run is cut after its share of time (seconds below, times scale, default 1; interrupted,
# pytest stops and the tool still prints its summary of what ran); the summary lists each run's
# errors, its tests and its exit status. Logs land under $OUT (default ./out).
set -uo pipefail
OUT=${OUT:-$(pwd)/out}
SCALE=${1:-1}
mkdir -p "$OUT"
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}" ROPE_RTC_REQUIRE_GPU=1 PYTHONUNBUFFERED=1
export ROPE_RTC_CACHE_DIR=${ROPE_RTC_CACHE_DIR:-$(mktemp -d)}
# Compile the kernels first, outside the sanitizer (its start-up per module is what costs).
python3 -m pytest -q -p no:cacheprovider tests/test_gpu_fixed.py tests/test_gpu_mrope.py tests/test_gpu_qk_norm.py \
    tests/test_gpu_tail.py >"$OUT/sanitize-warm.log" 2>&1 || echo "warm-up run failed: see $OUT/sanitize-warm.log"

run() {  # run <seconds> <tool> <log name> <pytest args...>
    local limit tool=$2 name=$3
    [[ -n ${SANITIZE_ONLY:-} && ! "$tool $name" =~ $SANITIZE_ONLY ]] && return 0
    limit=$(python3 -c "print(round($1 * $SCALE))")
    shift 3
    timeout -s INT -k 30 "$limit" compute-sanitizer --tool "$tool" --error-exitcode 99 --print-limit 50 \
        python3 -m pytest -q -p no:cacheprovider "$@" >"$OUT/sanitize-$name.log" 2>&1
    local rc=$?
    local summary
    summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/sanitize-$name.log" | tail -n 1)
    local tests
    tests=$(grep -E "[0-9]+ (passed|failed)" "$OUT/sanitize-$name.log" | tail -n 1)
    echo "$tool $name: rc=$rc${summary:+; $summary}${tests:+; $tests}$([[ $rc -eq 124 ]] && echo "; cut at ${limit} s")"
}

{
    run 150 memcheck fixed tests/test_gpu_fixed.py
    run 90 memcheck mrope tests/test_gpu_mrope.py
    run 60 memcheck qk-norm tests/test_gpu_qk_norm.py -k "bfloat16 or decode"
    run 40 memcheck tail tests/test_gpu_tail.py
    run 90 racecheck mrope-shared tests/test_gpu_mrope.py
    run 50 synccheck mrope-shared tests/test_gpu_mrope.py
    run 90 racecheck qk-norm-staged tests/test_gpu_qk_norm.py -k staged
} | tee "$OUT/sanitize-summary.txt"
