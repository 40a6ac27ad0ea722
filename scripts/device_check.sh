#!/usr/bin/env bash
# The device check: every test with ROPE_RTC_REQUIRE_GPU=1 (a skipped GPU or device test is a
# failure; the slow CPU tests are left to CI, tests/conftest.py), then the benchmark. Results land under $OUT (default ./out). Run from the repository
# root on a GPU machine:
#     bash scripts/device_check.sh [--quick-bench|--full-bench|--no-bench] [--shards N] [extra pytest args]
# --shards N runs the tests in N processes side by side (ROPE_RTC_TEST_SHARD, tests/conftest.py),
# sharing one kernel cache; each writes $OUT/tests.<i>.log and junit.<i>.xml, and $OUT/tests.log
# gathers their summaries. The default is one process per 4 CPU cores, at most 4 (4 on the
# 16-core device machine: the suite in about 3.5 minutes, where one process no longer fits a
# 10-minute device command); --shards 1 runs a single process.
# --full-bench also regenerates docs/benchmarks.md and docs/benchmarks/<gpu>.json/.png (copies
# under $OUT/docs to bring back from a device machine). It takes well over 10 minutes: where one
# command may not run that long, run scripts/bench.py in parts (--cases) and join their JSON with
# --from-json FIRST --merge-json NEXT --write-docs.
# Wheels the device image lacks (liger-kernel, platformdirs; onnx and protobuf under .whl/onnx) are
# installed from ./.whl when present.
set -uo pipefail
OUT=${OUT:-$(pwd)/out}
mkdir -p "$OUT"
bench=quick
shards=
while [[ $# -gt 0 ]]; do
    case $1 in
        --quick-bench) bench=quick; shift ;;
        --full-bench) bench=full; shift ;;
        --no-bench) bench=none; shift ;;
        --shards)
            shards=${2:-}
            if ! [[ $shards =~ ^[1-9][0-9]*$ ]]; then echo "--shards needs a positive count, got '${shards}'" >&2; exit 2; fi
            shift 2 ;;
        *) break ;;
    esac
done
if [[ -z $shards ]]; then
    cores=$(nproc 2>/dev/null || echo 1)
    shards=$((cores / 4))
    ((shards < 1)) && shards=1
    ((shards > 4)) && shards=4
fi

if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
# The ONNX reference evaluator for the RotaryEmbedding tests, when the image lacks it (protobuf
# only when absent too, so an installed one is never shadowed).
if compgen -G ".whl/onnx/onnx-*.whl" >/dev/null && ! python3 -c "import onnx" 2>/dev/null; then
    wheels=(.whl/onnx/onnx-*.whl)
    python3 -c "import google.protobuf" 2>/dev/null || wheels+=(.whl/onnx/protobuf-*.whl)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-onnx "${wheels[@]}" \
        && export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/site-onnx"
fi
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
export ROPE_RTC_REQUIRE_GPU=1 PYTHONUNBUFFERED=1
if [[ $(nvidia-smi -L 2>/dev/null | wc -l) -ge 2 ]]; then export ROPE_RTC_REQUIRE_MULTI_GPU=1; fi
export ROPE_RTC_CACHE_DIR=${ROPE_RTC_CACHE_DIR:-$(mktemp -d)}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
if [[ $shards -eq 1 ]]; then
    python3 -m pytest tests -q -p no:cacheprovider "$@" --junitxml="$OUT/junit.xml" 2>&1 | tee "$OUT/tests.log"
    tests_rc=${PIPESTATUS[0]}
else
    pids=()
    # A private --basetemp each: pytest prunes older numbered directories under the shared
    # /tmp/pytest-of-<user>, which are the other shards' live ones.
    basetemp=$(mktemp -d)
    # Interrupted or killed: stop the shards too (background jobs of a script ignore SIGINT).
    trap 'kill "${pids[@]}" 2>/dev/null; exit 130' INT TERM
    for ((i = 0; i < shards; i++)); do
        ROPE_RTC_TEST_SHARD="$i/$shards" python3 -m pytest tests -q -p no:cacheprovider "$@" \
            --basetemp="$basetemp/shard$i" --junitxml="$OUT/junit.$i.xml" >"$OUT/tests.$i.log" 2>&1 &
        pids+=($!)
    done
    # Exit code 5 is pytest's "no tests collected": a shard left empty by a filter that selected
    # fewer pieces than there are shards. It fails the check only when every shard is empty.
    tests_rc=0
    codes=()
    for ((i = 0; i < shards; i++)); do
        wait "${pids[$i]}"
        codes+=($?)
    done
    trap - INT TERM
    empty=0
    : >"$OUT/tests.log"
    for ((i = 0; i < shards; i++)); do
        code=${codes[$i]}
        if [[ $code -eq 5 ]]; then empty=$((empty + 1)); elif [[ $code -ne 0 ]]; then tests_rc=1; fi
        grep -E "^(FAILED|ERROR) " "$OUT/tests.$i.log" >>"$OUT/tests.log"
        summary=$(grep -E "[0-9]+ (passed|failed|errors?|deselected)|no tests ran" "$OUT/tests.$i.log" | tail -n 1)
        echo "shard $i/$shards: exit $code: ${summary:-no summary line (see tests.$i.log)}" >>"$OUT/tests.log"
    done
    if [[ $empty -eq $shards ]]; then tests_rc=5; fi
    cat "$OUT/tests.log"
fi

bench_rc=0
case $bench in
    quick) python3 scripts/bench.py --quick --json "$OUT/bench.json" --plot "$OUT/bench.png" 2>&1 | tee "$OUT/bench.log"; bench_rc=${PIPESTATUS[0]} ;;
    # The full run is what docs/benchmarks.md shows: it also writes the docs (mirrored under $OUT/docs).
    full) python3 scripts/bench.py --write-docs --json "$OUT/bench.json" --plot "$OUT/bench.png" 2>&1 | tee "$OUT/bench.log"; bench_rc=${PIPESTATUS[0]} ;;
esac

echo "== device check summary =="
if [[ $shards -eq 1 ]]; then
    grep -E "^[0-9]+ (passed|failed)|passed|failed" "$OUT/tests.log" | tail -n 1
else
    grep -E "^shard " "$OUT/tests.log"
fi
echo "tests rc=$tests_rc bench rc=$bench_rc"
[[ $tests_rc -eq 0 && $bench_rc -eq 0 ]]
