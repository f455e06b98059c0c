#!/usr/bin/env bash
# Every GPU figure of docs/BENCHMARKS.md in one run, each part under its own `timeout`:
#
#   OUT=/some/dir bash benchmarks/run_gpu.sh                                  # the whole set, <= ~55 min
#   OUT=/some/dir PARTS="decode speculative recording kernels" bash benchmarks/run_gpu.sh   # <= ~9 min
#   OUT=/some/dir PARTS=large bash benchmarks/run_gpu.sh                      # the 113M target, <= ~8 min
#   python3 benchmarks/headline.py --json /some/dir                           # then the headline table
#
# Parts (limit on an H200, the figure of docs/BENCHMARKS.md, the JSON written to $OUT):
#   decode        130 s  Plain decoding: 8B and 1B shapes, bs 1 and 8, deterministic, PDL  decode.json
#   speculative   120 s  Speculative decoding on the demo model, bs 1 and 16                speculative.json
#   recording     120 s  Recording: on/off at the 8B shape, bs 1, every method              recording_8B.json
#   kernels       135 s  Kernels: tree index and verify kernels, the fused GEMVs            tree_kernels.json, gemv.json
#   step_times     70 s  Step times at the 8B shape (accept lengths from speculative.json)  step_times_8b.json, .png
#   vs_transformers 60 s Against transformers                                               vs_transformers.json
#   sweep          45 s  Setting sweeps (docs/sweep_*.png)                                  sweep.json, sweep_*.png
#                        (these three run on the 113M target when out/large holds it, as after
#                        PARTS=large on the same machine, else on the demo model)
#   ngram         150 s  N-gram corpus (on the CPU cores)                                   ngram_corpus.json
#   tune_profiles 450 s  What-if tuner: the cost profiles spectool ships (a call of its own) profiles/*.json
#   large         470 s  Speculative decoding, 113M target: trains it into out/large, then  large/speculative.json
#                        speculative.py on it (STDLIB names the packed corpus, default
#                        .corpus/stdlib-3.11.tar.xz when present; else this Python's stdlib)
#   tune_accuracy 300 s  What-if tuner: predicted against measured, shipped H200 profile    tune_accuracy.json
#                        ($OUT/profiles/demo-h200.json instead when a tune_profiles part wrote it)
#   tune_large    510 s  What-if tuner on the 113M target: trains it into out/large when     large/tune_accuracy.json
#                        absent (120 s budget), then 8 configurations x batch 1 and 4 per method,
#                        calibrated in the same run
#   draft_model   270 s  Standalone draft model (trains its small draft for 120 s first)   draft_model.json
#   tests         600 s  tests/gpu (no figure: the GPU behaviour the figures rely on)       gpu_tests.txt
# Default PARTS: all of them, large first so that step_times, vs_transformers and sweep run on the
# 113M target (<= 3,430 s of limits, plus <= 60 s to build the native extension when it is missing). Logs go to $OUT/logs, with progress bars off; each
# part's exit status and seconds are printed as it ends, and every table again at the end.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/spectool_out}"
PARTS="${PARTS:-decode speculative recording kernels large step_times vs_transformers sweep ngram tune_profiles tune_accuracy tune_large draft_model tests}"
LOGS="$OUT/logs"
mkdir -p "$OUT" "$LOGS"
OUT="$(cd "$OUT" && pwd)"
LOGS="$OUT/logs"
export OUT PYTHONHASHSEED=0 TQDM_DISABLE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_NO_ADVISORY_WARNINGS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # in case the editable install fails
start=$SECONDS

declare -A LIMIT=([decode]=130 [speculative]=120 [recording]=120 [kernels]=135 [step_times]=70
                  [vs_transformers]=60 [sweep]=45 [ngram]=150 [tune_profiles]=450 [large]=470 [tune_accuracy]=300 [tune_large]=510
                  [draft_model]=270 [tests]=600)
total=0
for part in $PARTS; do
    [ -n "${LIMIT[$part]:-}" ] || { echo "unknown part '$part'; parts: $(printf '%s\n' "${!LIMIT[@]}" | sort | xargs)"; exit 2; }
    total=$((total + LIMIT[$part]))
done
echo "parts: $PARTS (limits add up to $total s)"

if ! python3 -c "import spectool._native" 2>/dev/null; then
    timeout 120 python3 -m pip install -q --no-build-isolation --no-deps -e . >"$LOGS/build.log" 2>&1 \
        || timeout 120 python3 setup.py build_ext --inplace >>"$LOGS/build.log" 2>&1 \
        || { echo "native build failed:"; tail -20 "$LOGS/build.log"; }
fi
echo "build: $((SECONDS - start)) s"

run() {  # run LOG LIMIT_S SCRIPT ARGS...: one benchmark under timeout, its output in $LOGS/LOG.log
    local log=$1 limit=$2 script=$3 t0=$SECONDS
    shift 3
    timeout "$limit" python3 "benchmarks/$script.py" "$@" >>"$LOGS/$log.log" 2>&1
    echo "$log ($script.py): exit $? after $((SECONDS - t0)) s (limit $limit s)"
}

large_model() {  # the 113M target's options where a PARTS=large run left it, else none (the demo model)
    model=()
    [ -f out/large/target/config.json ] \
        && model=(--model out/large/target --draft-dir out/large --prompts out/large/prompts.jsonl)
}

for part in $PARTS; do : >"$LOGS/$part.log"; done
for part in $PARTS; do
    case $part in
        decode) run decode 130 decode --shapes 8B,1B --batches 1,8 --no-hf --deterministic --quick --no-pdl ;;
        speculative) run speculative 120 speculative --batches 1,16 --budget-s 80 ;;
        recording) run recording 120 recording --device cuda --part engine --shape 8B --batches 1 --repeats 3 \
            --max-new-tokens 96 ;;
        kernels) run kernels 75 tree_kernels; run kernels 60 gemv --shapes 8B 1B --configs default ;;
        step_times)
            accept="$OUT/speculative.json"
            [ -f "$OUT/large/speculative.json" ] && accept="$OUT/large/speculative.json"
            run step_times 70 step_times_8b --accept-json "$accept" ;;
        vs_transformers) large_model; run vs_transformers 60 vs_transformers "${model[@]}" ;;
        sweep) large_model; run sweep 45 sweep "${model[@]}" --budget-s 30 --out "$OUT" ;;
        ngram) run ngram 150 ngram_corpus --iters 100 ;;
        tune_profiles) run tune_profiles 450 tune_profiles --out "$OUT/profiles" --repeats 10 ;;
        tune_accuracy)
            profile=spectool/tune/profiles/demo-h200.json  # or the one a tune_profiles part just measured
            [ -f "$OUT/profiles/demo-h200.json" ] && profile="$OUT/profiles/demo-h200.json"
            run tune_accuracy 300 tune_accuracy --profile "$profile" ;;
        tune_large)
            if [ ! -f out/large/target/config.json ]; then
                stdlib="${STDLIB:-.corpus/stdlib-3.11.tar.xz}"
                train=(--out out/large --budget-s 120)
                [ -f "$stdlib" ] && train+=(--stdlib "$stdlib")
                rm -rf out/large
                run tune_large 180 train_large_target "${train[@]}"
            fi
            mkdir -p "$OUT/large"; rm -f "$OUT/large/large-h200.json"  # calibrated again in this run, for this target
            run tune_large 330 tune_accuracy --model out/large/target --draft-dir out/large \
                --prompts out/large/prompts.jsonl --batch-sizes 1,4 --max-configs 8 --num-prompts 8 --new-tokens 128 \
                --repeats 3 --calibration-repeats 20 --profile "$OUT/large/large-h200.json" --out "$OUT/large" ;;
        draft_model) run draft_model 270 draft_model --device cuda ;;
        large)
            stdlib="${STDLIB:-.corpus/stdlib-3.11.tar.xz}"
            train=(--out out/large --budget-s 240)
            [ -f "$stdlib" ] && train+=(--stdlib "$stdlib")
            rm -rf out/large
            run large 300 train_large_target "${train[@]}"
            run large 170 speculative --model out/large/target --draft-dir out/large --prompts out/large/prompts.jsonl \
                --batches 1,4,16 --budget-s 140 --out "$OUT/large" ;;
        tests)
            t0=$SECONDS
            timeout 600 python3 -m pytest -q -p no:cacheprovider tests/gpu >"$OUT/gpu_tests.txt" 2>&1
            echo "tests (tests/gpu): exit $? after $((SECONDS - t0)) s (limit 600 s)"; tail -3 "$OUT/gpu_tests.txt" ;;
    esac
done
echo "total: $((SECONDS - start)) s; files in $OUT: $(cd "$OUT" && find . -type f ! -path './logs/*' | sort | tr '\n' ' ')"

for part in $PARTS; do  # the tables again: the output's tail is what a caller sees first
    [ -f "$LOGS/$part.log" ] || continue
    echo "== $part"
    grep -v "^Loading weights" "$LOGS/$part.log" | tail -40
done
