#!/usr/bin/env bash
# `qserve bench` against `qserve serve` (issue 17): the random Qwen2.5-14B GPTQ-4bit checkpoint under
# --gpu-memory-budget 24GiB, as users run it. First-request TTFT (the warm-up request on a fresh
# server), concurrency 1 and 16, Poisson 16 req/s, then 300 requests all at once; JSON + PNG per run in
# OUT_DIR. /health is probed every 100 ms through the last two (bench/health_probe.py: health_*.json).
#   PYTHONPATH=. bash bench/serving_http.sh "$OUT" [/tmp/qb]
# CONCURRENCY (default 1,16): the --max-concurrency list of the first run.
# QSERVE_ENABLE_MULTIPROCESSING=1: the engine core in its own process (issue 27). PROFILE_S=30: py-spy
# records the server (and its core process) for that long during the Poisson run (PROFILE_RUN=all_at_once:
# during the 300 at once instead); summary in $OUT/pyspy_summary.txt (bench/pyspy_summary.py).
# TOKENIZER=full (default since 2026-12-05, issue 27): a tokenizer under which every one of the 152,064
# ids is text, so every step sends an SSE chunk per sequence (bench/full_vocab_tokenizer.py), as with a
# real checkpoint's tokenizer; TOKENIZER=synthetic: the tests' small tokenizer (most ids decode to
# nothing), the case of the runs recorded before that date.
# SERVE_ARGS: more `qserve serve` flags, e.g. SERVE_ARGS="--max-num-batched-tokens 1024" (issue 27's ITL p99:
# a token waits behind a step carrying up to the step budget of prompt tokens).
set -euo pipefail
OUT=${1:?usage: serving_http.sh OUT_DIR [CHECKPOINT_DIR]}
CKPT=${2:-/tmp/qb}
PORT=${PORT:-8123}
export PYTHONPATH=${PYTHONPATH:-.}
mkdir -p "$OUT"
if [ ! -f "$CKPT/tokenizer_config.json" ]; then
    python3 -c "from pathlib import Path; from bench.e2e import QWEN14B, write_random_gptq; write_random_gptq(Path('$CKPT'), QWEN14B)"
fi
TOKENIZER=${TOKENIZER:-full}
SERVED=$CKPT
if [ "$TOKENIZER" = full ]; then
    SERVED=$(python3 bench/full_vocab_tokenizer.py "$CKPT" "${CKPT%/}-fullvocab")
fi
echo "tokenizer: $TOKENIZER ($SERVED)" | tee "$OUT/tokenizer.txt"
# shellcheck disable=SC2086  # SERVE_ARGS is a list of flags
python3 -m qserve.cli --log-level INFO serve qb="$SERVED" --gpu-memory-budget 24GiB --max-model-len 4096 --port "$PORT" \
    ${SERVE_ARGS:-} > "$OUT/serve.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true; wait $SERVER 2>/dev/null || true' EXIT
health="import urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/health', timeout=2)"
until python3 -c "$health" 2>/dev/null; do
    kill -0 "$SERVER" 2>/dev/null || { tail -30 "$OUT/serve.log"; exit 1; }
    sleep 2
done
# the workload of the recorded runs (qserve bench's own defaults are sized for the CPU demo)
COMMON=(--port "$PORT" --ignore-eos --vocab-size 152064 --disable-tqdm --result-dir "$OUT"
    --random-input-len 256 --random-output-len 256 --random-max-len 2048)
python3 -m qserve.cli bench "${COMMON[@]}" --num-prompts 48 --max-concurrency "${CONCURRENCY:-1,16}" --result-filename concurrency.json
PROFILER=
PROFILE_RUN=${PROFILE_RUN:-poisson16}
case $PROFILE_RUN in poisson16 | all_at_once) ;; *) echo "PROFILE_RUN=$PROFILE_RUN: expected poisson16 or all_at_once" >&2; exit 2 ;; esac
profile_from_here() {  # $1: the run about to start; py-spy records PROFILE_S seconds from now if it is PROFILE_RUN
    [ -n "${PROFILE_S:-}" ] && [ "$1" = "$PROFILE_RUN" ] || return 0
    # py-spy from PATH, else where the device call's `pip install --target /tmp/site` put the carried wheel's binary
    PYSPY=$(command -v py-spy || echo /tmp/site/bin/py-spy)
    "$PYSPY" record -s -t -r 100 -d "$PROFILE_S" -p "$SERVER" -f raw -o "$OUT/pyspy.txt" --nonblocking \
        > "$OUT/pyspy.log" 2>&1 &
    PROFILER=$!
}
profile_summary() {
    [ -n "$PROFILER" ] || return 0
    wait "$PROFILER" && python3 bench/pyspy_summary.py "$OUT/pyspy.txt" > "$OUT/pyspy_summary.txt"
    PROFILER=
}
probe() {  # /health every 100 ms while "$@" loads the server (issue 27: p99 <= 50 ms throughout)
    local name=$1; shift
    python3 bench/health_probe.py --port "$PORT" --out "$OUT/health_$name.json" &
    local prober=$!
    "$@"
    kill -TERM "$prober"; wait "$prober" || true
}
profile_from_here poisson16
probe poisson16 python3 -m qserve.cli bench "${COMMON[@]}" --num-prompts 400 --request-rate 16 --num-warmups 0 \
    --result-filename poisson16.json
profile_summary
profile_from_here all_at_once
probe all_at_once python3 -m qserve.cli bench "${COMMON[@]}" --num-prompts 300 --num-warmups 0 \
    --result-filename all_at_once.json
profile_summary
grep -E "allocated after start-up|warm start|memory plan" -A0 "$OUT/serve.log" || true
