#!/usr/bin/env bash
# The head-to-head benchmarks on the GPU machine in one call, under ~8 minutes:
#
#   OUT=/some/dir bash benchmarks/run_gpu.sh
#
# With WITH_CHECKS=1 it also runs benchmarks/engine_check.py, tests/gpu and
# benchmarks/recording.py --quick; with PACK_TO=<dir> it re-packs $OUT and the logs into
# <dir>/results.tar.gz after every part (for machines that return only a few files).
# Writes 7 files to $OUT: speculative.json, step_times_8b.json, step_times_8b.png,
# vs_transformers.json, sweep.json, sweep_ngram.png, sweep_eagle.png. Full logs go to
# /tmp/spectool_bench; the tables are printed again at the end (the reply keeps only the
# tail of the output). Estimated times (H200, demo model, CUDA warm-up and graph capture
# included): build <= 60 s, speculative <= 150 s, step_times_8b <= 80 s,
# vs_transformers <= 90 s, sweep <= 75 s: <= 455 s in all, each part capped by `timeout`.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/spectool_out}"
LOGS=/tmp/spectool_bench
mkdir -p "$OUT" "$LOGS"
export OUT PYTHONHASHSEED=0
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # in case the editable install fails
start=$SECONDS

if ! python3 -c "import spectool._native" 2>/dev/null; then
    timeout 120 python3 -m pip install -q --no-build-isolation --no-deps -e . >"$LOGS/build.log" 2>&1 \
        || timeout 120 python3 setup.py build_ext --inplace >>"$LOGS/build.log" 2>&1 \
        || { echo "native build failed:"; tail -20 "$LOGS/build.log"; }
fi
echo "build: $((SECONDS - start)) s"

run() {  # run NAME LIMIT_S ARGS...: one script under timeout, its output logged
    local name=$1 limit=$2 t0=$SECONDS
    shift 2
    timeout "$limit" python3 "benchmarks/$name.py" "$@" >"$LOGS/$name.log" 2>&1
    echo "$name: exit $? after $((SECONDS - t0)) s (limit $limit s)"
}

pack() {  # re-pack everything after each part: a call stopped at its limit still returns what ran
    [ -n "${PACK_TO:-}" ] && tar czf "$PACK_TO/results.tar.gz" -C "$(dirname "$OUT")" "$(basename "$OUT")" \
        -C "$LOGS/.." "$(basename "$LOGS")" 2>/dev/null
}

if [ -n "${WITH_CHECKS:-}" ]; then  # the engine sanity check and the GPU test suite ride along
    timeout 75 python3 benchmarks/engine_check.py --device cuda >"$OUT/engine_check.txt" 2>&1
    echo "engine_check: exit $?"; pack
fi
run speculative 130 --budget-s 95; pack
if [ -n "${WITH_CHECKS:-}" ]; then
    timeout 100 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_engine_gpu.py tests/gpu >"$OUT/gpu_tests.txt" 2>&1
    echo "tests/gpu: exit $?"; pack
fi
run step_times_8b 70 --accept-json "$OUT/speculative.json"; pack
if [ -n "${WITH_CHECKS:-}" ]; then
    timeout 60 python3 benchmarks/recording.py --device cuda --quick >"$OUT/recording.txt" 2>&1
    echo "recording: exit $?"; pack
fi
run vs_transformers 50; pack
run sweep 45 --budget-s 30 --out "$OUT"; pack
echo "total: $((SECONDS - start)) s; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"

for name in speculative step_times_8b vs_transformers sweep; do
    # each script prints its table after a line starting with its own name
    sed -n "/^$name.py —/,\$p" "$LOGS/$name.log" | grep -v "^Loading weights"
    grep -q "^$name.py —" "$LOGS/$name.log" || { echo "== $name: no table; log tail:"; tail -15 "$LOGS/$name.log"; }
done
