#!/usr/bin/env bash
# The head-to-head benchmarks on the GPU machine in one call (issue 9), under ~8 minutes:
#
#   OUT=/some/dir bash benchmarks/run_gpu.sh
#
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

run speculative 150 --budget-s 105
run step_times_8b 80 --accept-json "$OUT/speculative.json"
run vs_transformers 90
run sweep 75 --budget-s 40 --out "$OUT"
echo "total: $((SECONDS - start)) s; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"

for name in speculative step_times_8b vs_transformers sweep; do
    # each script prints its table after a line starting with its own name
    sed -n "/^$name.py —/,\$p" "$LOGS/$name.log" | grep -v "^Loading weights"
    grep -q "^$name.py —" "$LOGS/$name.log" || { echo "== $name: no table; log tail:"; tail -15 "$LOGS/$name.log"; }
done
