#!/usr/bin/env bash
# The H200 runs behind bench/RESULTS.md, in one device call: each stage has its own time limit, so a
# slow or failing stage costs only its share and the next still runs; every stage writes to OUT_DIR.
#   PYTHONPATH=. bash bench/gpu_session.sh smoke [OUT_DIR]            # first stage of every device call
#   PYTHONPATH=. bash bench/gpu_session.sh smoke,profile,e2e "$OUT"   # stages, comma-separated
#   PYTHONPATH=. bash bench/gpu_session.sh "$OUT" [stages]            # the older argument order
# OUT_DIR defaults to $OUT, else ./out. stages (run in this order; default: all but smoke, preempt and decode_pdl):
#   smoke          every `-m gpu` test (the files that hold one), then decode at batch 1 and 128 through
#                  the engine (SMOKE_E2E=0 skips it); under 4 minutes. Its pass count goes into bench/RESULTS.md's GPU test ledger.
#   gputests, http, overlap, profile, serving, serving_async, preempt, e2e, decode_pdl
# (http needs the server's wheels on PYTHONPATH: fastapi, uvicorn, pydantic.)
# preempt (two runs of up to 2 minutes: recompute vs swap preemption on a KV pool forced small) runs only
# when named: with it the default set would pass 10 minutes.
# gluon (only when named): the Gluon W4A16 kernel's GPU tests and bench/w4a16_gluon.py (issue 26).
# decode_pdl (decode-only e2e three times on one checkpoint: QSERVE_ENABLE_PDL off, on, off; quant_kernels.pdl) also only when named.
# optin (only when named): what landed opt-in without a GPU run, measured, as four stages that can also be
#   named alone (with them all the set passes 10 minutes: split it over two calls):
#   optin_tiles  the Hopper prefill tiles (QSERVE_PREFILL_TILES=h200): GPU attention tests, bench/attention_prefill.py
#   optin_moe    bench/moe.py (fused MoE vs per-expert loop vs cuBLAS grouped)
#   optin_lora   bench/lora.py (kernels, then --e2e)
#   optin_spec   bench/spec_decode.py (n-gram and a 12-layer self-draft, batch 1/32/128, eager and graphed verify;
#                then batch 1 with a mismatched draft, fixed and adaptive k: the 0%-acceptance case)
# lora_profile (only when named): bench/lora.py --e2e --profile-dir: issue 30's decode table, then the per-kernel
#   profile of a batch-32 decode step, base and LoRA with 8 adapters (lora_profile/profile_{base,lora}.md); ~70 s
#   on an H100 (14th session). LORA_OVERLAP (--overlap, default 0): comma list of QSERVE_LORA_OVERLAP modes, one
#   LoRA engine each (0,shrink,pair: without, shrinks beside the base GEMMs, shrink and expand beside; ~30 s each).
# piecewise (only when named): QSERVE_PIECEWISE_GRAPHS's GPU tests, then bench/profile_step.py eager vs piecewise
#   graphs (buckets 256-2048) on the pure-decode and mixed steps (issue 25).
# core (only when named; needs the server's wheels): bench/serving_http.sh with the engine core in-process,
#   then in its own process (QSERVE_ENABLE_MULTIPROCESSING=1), concurrency 16 (CONCURRENCY=1,16 adds the
#   slow batch-1 run), Poisson 16 req/s and 300 at once with /health probed, each run's folder packed into one .tgz
#   (the device call returns at most 8 files).
#   CORE_LAYOUTS (default "0 1") lists the runs: 0 in-process, 1 the core process, 1x2 with --api-server-count 2;
#   a trailing p (1p, 1x2p) profiles that run's Poisson load with py-spy for PROFILE_S seconds (default 30;
#   PROFILE_RUN=all_at_once profiles the 300 requests at once instead).
# serve_default (only when named): bench/serve_default.py: qserve serve on the 14B checkpoint with
#   QSERVE_ENABLE_MULTIPROCESSING unset: does an engine core process run, one completion, SIGTERM's exit code.
#   SERVE_DEFAULT_LAYOUTS="unset 0" also starts it in one process; each run's start-up milestones, timestamped.
#   SERVE_DEFAULT_PROFILE=1: py-spy records each start-up (carried wheel); the decode-graph capture's samples.
#   SERVE_DEFAULT_KEEP_CACHE="0 1": each layout with QSERVE_CAPTURE_KEEP_CACHE off, then on (no emptying per capture).
#   SERVE_DEFAULT_SMI=1: each second of each run, nvidia-smi's compute processes and the python processes (_smi.txt).
# coldstart (only when named; COLDSTART_RUNS pairs, default 2): bench/e2e.py decode at batch 1 with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False
#   and with qserve's default (expandable), alternated twice on one reused checkpoint: cold start, plan vs held.
# ampere_proxy (only when named): bench/kernels.py --ampere-proxy --sweep: the sm86/sm89 W4A16 code (mma.sync,
#   Ampere operand layout, 99 KB shared) timed on this card, issue 26's proxy for the users' dispatch table; 420 s.
# moe_e2e (only when named): bench/e2e.py --model qwen3-30b-a3b on a random Qwen3-30B-A3B-shaped GPTQ-4bit
#   checkpoint under the 24 GiB budget: decode at batch 1/8/32/128 against its floor (bytes of the
#   experts a step is expected to hit + attention, routers, lm_head), capacity at 1k tokens, offline
#   1,000 requests, peak allocator; 240 s, to $OUT/moe_e2e.md.
# moe_profile (only when named): bench/profile_step.py --model qwen3-30b-a3b: where a batch-1 and a batch-32
#   MoE decode step's time goes, per kernel family (issue 32's batch-1 target); to $OUT/profile_step.md.
# moe_sweep (only when named): bench/moe_sweep.py: the MMA MoE kernel's configs with split-K 1/2/4/8, each GEMM
#   alone, at 1/8/32 tokens (compiles spread over 12 processes first; ~1,100 timings); to $OUT/moe_sweep.md.
# moe_batch1 (only when named): issue 32's batch-1 decode, three engines on one checkpoint: the MMA MoE kernel
#   without split-K or the sort-free layout (QSERVE_MOE_SPLIT_K=0 QSERVE_MOE_DIRECT_BLOCKS=0), with split-K
#   (auto), and with the sort-free layout too (QSERVE_MOE_DIRECT_BLOCKS=32: the defaults), the later two reusing the first's checkpoint (--reuse-checkpoint); first
#   bench/moe.py --tokens 1,8 (its split column, its direct table); ~7 minutes. MOE_KERNELS=0 skips bench/moe.py;
#   MOE_VARIANTS: other engines, ';'-separated, each a space-separated list of VAR=value (e.g. switches on and off).
#   moe_profile's MOE_CKPT=/tmp/qbm/qwen3-30b-a3b-gptq profiles the checkpoint moe_batch1 wrote (none written),
#   MOE_PROFILE_DIR a subfolder of $OUT for its profile_step.md, MOE_PROFILE_DECODE its batches (default 1,32).
# spec_eagle (only when named): bench/spec_decode.py at batch 1 with EAGLE heads built from the target (--eagle
#   layers1,layers4,random; the random head also with adaptive k), graphed verify, median of 3 (issue 29); each head
#   with the engine's defaults: plain decode steps graphed (-dg; EAGLE_DECODE_GRAPHS=off|on|both, default on) and the
#   head's drafting forwards graphed (-hg; EAGLE_HEAD_GRAPHS=off|on|both, default on); ~2 min, "both" doubles it.
#   EAGLE_HEADS (default layers1,layers4,random) and EAGLE_ADAPTIVE_MODES (default eagle-random-dg-hg-cg-dd,eagle-layers1-dg-hg-cg-dd).
#   The head's catch-up forward graphed (-cg; EAGLE_CATCH_UP_GRAPHS=off|on|both, default on).
#   Drafts left on the device for the verify step (-dd; EAGLE_DEVICE_DRAFTS=off|on|both, default on).
#   EAGLE_DRAFT_LM_HEAD=int4|both: the -q4 modes (speculative_config "draft_lm_head": "int4", a 4-bit lm_head copy).
#   EAGLE_DRAFT_LAYERS=int4|both: the -l4 modes (speculative_config "draft_layers": "int4", 4-bit copies of the head's layers).
#   QSERVE_SPEC_BACKOFF=GROWTH,MAX_WAIT exported before the stage applies to every mode (the back-off of failing proposals).
# spec_serving (only when named): bench/serving.py without and with n-gram speculation (ngram-pw: with
#   QSERVE_PIECEWISE_SPEC=1), Poisson 4 req/s and all at once, SPEC_SERVING_REQUESTS requests (default 120;
#   SPEC_SERVING_MODES, default "off ngram ngram-pw"; issue 29).
# moe_fp8 (only when named): bench/e2e.py --model qwen3-30b-a3b, capacity at 1k tokens with fp8 KV (issue 32).
set -u
if [[ $# -ge 1 && ( -d "$1" || "$1" == */* ) ]]; then  # the older order: OUT_DIR first
    OUT=$1
    STAGES=${2:-gputests,http,overlap,profile,serving,serving_async,e2e}
else
    STAGES=${1:-gputests,http,overlap,profile,serving,serving_async,e2e}
    OUT=${2:-${OUT:-out}}
fi
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
[[ ",$STAGES," == *",optin,"* ]] && STAGES="$STAGES,optin_tiles,optin_moe,optin_lora,optin_spec"
has() { [[ ",$STAGES," == *",$1,"* ]]; }
stage() { echo "=== $1 ($(date +%T))"; }

# The device machine gets a copy of the working tree whose git metadata may be older than the tree:
# a hash of the code identifies what ran (bench/code_hash.sh computes the same on the machine here).
echo "code $(bash bench/code_hash.sh)"
python3 -c "import torch, triton; print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)"
if has smoke; then
    stage "smoke: every -m gpu test"
    # the files that hold a gpu test (collecting the rest would need the server's packages there)
    # (the longest first: the 14B-layer quantize tests take ~90 s each, async scheduling ~50 s)
    mapfile -t GPU_FILES < <(grep -rlE "pytest\.mark\.gpu|mark\.gpu\b" tests --include='test_*.py' \
        | awk '{ print (/quantize\/test_gpu/ ? 0 : /test_async_scheduling|test_w4a16/ ? 1 : 2), $0 }' | sort | cut -d' ' -f2 \
        | grep -vE "${SMOKE_EXCLUDE:-^$}")
    # SMOKE_EXCLUDE (a regex of test files): files left out of the count, e.g. an opt-in kernel's file that
    # failed in a stage of its own before the smoke; the ledger row names them
    [[ -n ${SMOKE_EXCLUDE:-} ]] && echo "smoke: files matching '$SMOKE_EXCLUDE' left out"
    # ~800 tests, most of their time in Triton compiles (CPU): spread over the machine's cores, work-stealing,
    # one worker per 6 GiB of the card (16 on an H200; 13 on an H100, where 16 workers' models, pools and
    # graphs may have filled the card: a decode-graph capture failed there on 2026-12-05, bench/RESULTS.md)
    WORKERS=$(python3 -c "import os, torch, xdist; print(min(16, os.cpu_count(), torch.cuda.get_device_properties(0).total_memory // (6 << 30)))" 2>/dev/null || echo 0)
    # the card's memory in use through the run, every 500 ms: the peak says whether the workers crowd it
    nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader,nounits -lms 500 > "$OUT/smoke_gpu_memory.csv" 2>/dev/null &
    MEMLOG=$!
    DIST=$(python3 -c "import xdist; print('worksteal' if tuple(map(int, xdist.__version__.split('.')[:2])) >= (3, 2) else 'load')" 2>/dev/null)
    PARALLEL=(); [[ $WORKERS -gt 1 ]] && PARALLEL=(-n "$WORKERS" --dist "$DIST")
    # one OpenMP/MKL thread pool of 2 per worker: 16 workers x 16 threads oversubscribed the 16 cores
    OMP_NUM_THREADS=2 MKL_NUM_THREADS=2 timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" --timeout=240 "${PARALLEL[@]}" \
        --durations=10 "${GPU_FILES[@]}" > "$OUT/smoke_gputests.txt" 2>&1
    echo "pytest -m gpu exit code $? (${WORKERS} workers)"
    kill "$MEMLOG" 2>/dev/null
    awk -F', ' '$1 > peak { peak = $1; total = $2 } END { if (total) print "card memory in use, peak: " peak " of " total " MiB" }' \
        "$OUT/smoke_gpu_memory.csv"
    grep -E "^(FAILED|ERROR)" "$OUT/smoke_gputests.txt" | head -20
    tail -1 "$OUT/smoke_gputests.txt"
    if [[ ${SMOKE_E2E:-1} != 0 ]]; then  # SMOKE_E2E=0: the tests alone (decode already measured at these kernels)
        stage "smoke: decode at batch 1 and 128 through the engine (Qwen2.5-14B-shaped GPTQ 4-bit)"
        timeout 150 python3 bench/e2e.py --skip small,offline,capacity --decode-batches 1,128 --tmp /tmp/qbe \
            --out "$OUT/smoke_e2e.md" 2>&1 | grep -v USDT | tail -6
    fi
fi
if [[ "$STAGES" =~ (http|overlap|profile|serving|preempt|core|piecewise|serve_default|spec_eagle) ]]; then
    # One Qwen2.5-14B-shaped random GPTQ-4bit checkpoint for the stages below (~10 s).
    python3 -c "from pathlib import Path; from bench.e2e import QWEN14B, write_random_gptq; write_random_gptq(Path('/tmp/qb'), QWEN14B)"
fi

if has gputests; then
    stage "GPU test: async scheduling gives the same outputs on CUDA (graphs and eager)"
    # the whole output goes to a file: a failure's assertion text must survive the call's output limit
    timeout 150 python3 -m pytest -x -q -m gpu -p no:cacheprovider -o addopts="" tests/integration/test_async_scheduling.py \
        > "$OUT/gputests.txt" 2>&1
    tail -3 "$OUT/gputests.txt"
fi
if has http; then
    stage "qserve bench against qserve serve: first request, concurrency 1 and 16, Poisson 16 req/s"
    timeout 260 bash bench/serving_http.sh "$OUT/http" /tmp/qb > "$OUT/http.txt" 2>&1
    tail -12 "$OUT/http.txt"
fi
if has overlap; then
    stage "wall vs device time per decode step, async scheduling off / on"
    timeout 170 python3 bench/step_overlap.py --checkpoint /tmp/qb --out "$OUT/step_overlap.md" 2>&1 | grep -v USDT | tail -12
fi
if has profile; then
    stage "per-kernel time of pure-decode and mixed steps"
    timeout 120 python3 bench/profile_step.py --ckpt /tmp/qb --out "$OUT" --decode 1,128 2>&1 | grep -v USDT | tail -5
fi
if has serving; then
    stage "serving under a 24 GiB budget: Poisson 16 req/s and all at once"
    timeout 170 python3 bench/serving.py --build-qwen14b /tmp/qb --gpu-memory-budget 24GiB --num-requests 400 \
        --rates 16,inf --sampling mixed --out "$OUT/serving.md" 2>&1 | grep -v USDT | tail -6
fi
if has serving_async; then
    stage "serving under a 24 GiB budget, greedy, async scheduling on: Poisson 16 req/s"
    timeout 150 python3 bench/serving.py --build-qwen14b /tmp/qb --gpu-memory-budget 24GiB --num-requests 400 \
        --rates 16 --sampling greedy --async-scheduling --out "$OUT/serving_async.md" 2>&1 | grep -v USDT | tail -6
fi
if has preempt; then
    for mode in recompute swap; do
        stage "preemption by $mode: 1200 KV pages, 300 requests all at once, no admission watermark"
        timeout 120 python3 bench/serving.py --build-qwen14b /tmp/qb --num-kv-blocks 1200 --num-requests 300 \
            --rates inf --watermark 0 --watermark-per-running 0 --preemption-mode "$mode" \
            --out "$OUT/preempt_$mode.md" 2>&1 | grep -v USDT | tail -4
    done
fi
if has e2e; then
    stage "end to end: decode batch 1-128 and the offline 1,000-request workload"
    timeout 200 python3 bench/e2e.py --skip small,capacity --num-requests 1000 --tmp /tmp/qbe --out "$OUT/e2e.md" \
        2>&1 | grep -v USDT | tail -12
fi
if has decode_pdl; then
    # off, on, off on one checkpoint (the last run shows the drift between engines; DECODE_PDL_ORDER moves it)
    run=0
    for pdl in ${DECODE_PDL_ORDER:-0 1 0}; do
        run=$((run + 1))
        stage "end to end, decode batch 1-128, programmatic dependent launch QSERVE_ENABLE_PDL=$pdl (run $run)"
        QSERVE_ENABLE_PDL=$pdl timeout 150 python3 bench/e2e.py --skip small,capacity,offline,fp8 --tmp /tmp/qbe \
            --reuse-checkpoint --out "$OUT/decode_pdl${pdl}_run$run.md" 2>&1 | grep -v USDT | grep -E "decode batch|Error"
        code=${PIPESTATUS[0]}
        [[ $code == 0 ]] || echo "bench/e2e.py exit code $code (124: past its 150 s)"
    done
fi
if has gluon; then
    # issue 26: the Gluon W4A16 kernel (the default at 65-512 rows on sm90): its GPU tests, then its candidates against
    # cuBLAS fp16 and the built-in dispatch (GLUON_MS rows, GLUON_SHAPES layers, GLUON_BUDGET_S seconds)
    stage "Gluon W4A16: GPU tests, then bench/w4a16_gluon.py"
    timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" tests/kernels/test_w4a16_wgmma_gluon.py \
        > "$OUT/gluon_tests.txt" 2>&1
    echo "gluon tests exit code $?"
    grep -E "^(FAILED|ERROR)|Error" "$OUT/gluon_tests.txt" | head -8
    tail -1 "$OUT/gluon_tests.txt"
    timeout $(( ${GLUON_BUDGET_S:-200} + 60 )) python3 bench/w4a16_gluon.py --ms "${GLUON_MS:-128,256,1024}" \
        --shapes "${GLUON_SHAPES:-gate_up,down,qkv,o}" --budget-s "${GLUON_BUDGET_S:-200}" --out "$OUT/w4a16_gluon.md" \
        --candidates "${GLUON_CANDIDATES:-}" \
        > "$OUT/w4a16_gluon.log" 2>&1
    echo "bench/w4a16_gluon.py exit code $?"
    tail -20 "$OUT/w4a16_gluon.log"
fi
if has optin_tiles; then
    stage "opt-in Hopper prefill tiles: GPU attention tests, then the prefill benchmark"
    QSERVE_PREFILL_TILES=h200 timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" \
        tests/kernels/test_attention.py tests/kernels/test_attention_int4.py > "$OUT/optin_tiles_tests.txt" 2>&1
    tail -1 "$OUT/optin_tiles_tests.txt"
    QSERVE_PREFILL_TILES=h200 timeout 150 python3 bench/attention_prefill.py --out "$OUT/optin_prefill.md" 2>&1 | tail -8
fi
if has optin_moe; then
    stage "fused MoE W4A16 (QSERVE_FUSED_MOE) against the per-expert loop and cuBLAS grouped"
    timeout 200 python3 bench/moe.py --out "$OUT/moe.md" 2>&1 | grep -v USDT | tail -10
fi
if has optin_lora; then
    stage "LoRA shrink/expand kernels, then decode with 1/8/32 adapters"
    timeout 120 python3 bench/lora.py --out "$OUT/lora.md" 2>&1 | grep -v USDT | tail -8
    timeout 240 python3 bench/lora.py --e2e --out "$OUT/lora_e2e.md" 2>&1 | grep -v USDT | tail -8
fi
if has lora_profile; then
    stage "LoRA decode with 1/8/32 adapters, then where a step of batch 32 goes, base and 8 adapters (issue 30)"
    timeout 300 python3 bench/lora.py --e2e --time-limit 220 --profile-dir "$OUT/lora_profile" --overlap "${LORA_OVERLAP:-0}" \
        --out "$OUT/lora_e2e.md" 2>&1 | grep -v USDT | tail -16
fi
if has optin_spec; then
    stage "speculative decoding: n-gram and a 12-layer self-draft, eager and graphed verify (QSERVE_SPEC_GRAPHS=1)"
    timeout 240 python3 bench/spec_decode.py --draft-layers 12 --out "$OUT/spec_decode.md" 2>&1 | grep -v USDT | tail -10
    stage "speculative decoding at batch 1 near 0% acceptance (a draft whose head is rolled), fixed and adaptive k, graphed verify"
    timeout 180 python3 bench/spec_decode.py --batches 1 --draft-layers 12 --mismatched-draft --adaptive --verify graphs \
        --out "$OUT/spec_decode_0.md" 2>&1 | grep -v USDT | tail -8
fi
if has spec_eagle; then
    stage "speculative decoding at batch 1 with EAGLE heads built from the target (its first 1 and 4 layers; a random head, fixed and adaptive k), plain decode steps eager and graphed (QSERVE_EAGLE_DECODE_GRAPHS)"
    # EAGLE_HEADS / EAGLE_ADAPTIVE_MODES: other heads, or other modes with adaptive k (e.g. eagle-layers1-dg);
    # EAGLE_PROFILE_MODES (e.g. off,eagle-layers4-dg-hg): where those modes' steps go, in spec_profile/
    timeout 540 python3 bench/spec_decode.py --checkpoint /tmp/qb --batches 1 --eagle "${EAGLE_HEADS:-layers1,layers4,random}" \
        --adaptive --adaptive-modes "${EAGLE_ADAPTIVE_MODES:-eagle-random-dg-hg-cg-dd,eagle-layers1-dg-hg-cg-dd}" \
        --eagle-decode-graphs "${EAGLE_DECODE_GRAPHS:-on}" --eagle-head-graphs "${EAGLE_HEAD_GRAPHS:-on}" \
        --eagle-catch-up-graphs "${EAGLE_CATCH_UP_GRAPHS:-on}" \
        --eagle-device-drafts "${EAGLE_DEVICE_DRAFTS:-on}" --eagle-draft-layers "${EAGLE_DRAFT_LAYERS:-checkpoint}" \
        --eagle-draft-lm-head "${EAGLE_DRAFT_LM_HEAD:-target}" --verify graphs \
        --profile-modes "${EAGLE_PROFILE_MODES:-}" --profile-dir "$OUT/spec_profile" \
        --repeats 3 --out "$OUT/spec_eagle.md" 2>&1 | grep -v USDT | tail -${SPEC_EAGLE_TAIL:-24}
fi
if has spec_serving; then
    # the same workload without and with n-gram speculation (disable_by_batch_size 64 as in spec_decode.py)
    # ngram-pw: with QSERVE_PIECEWISE_SPEC=1 (verify steps beside a prompt chunk through the piecewise graphs)
    for spec in ${SPEC_SERVING_MODES:-off ngram ngram-pw}; do
        stage "bench/serving.py, speculation $spec: ${SPEC_SERVING_REQUESTS:-120} requests at Poisson 4 req/s, then all at once"
        export QSERVE_PIECEWISE_SPEC=0; [[ $spec == *-pw ]] && export QSERVE_PIECEWISE_SPEC=1
        config=(); [[ $spec == ngram* ]] && config=(--speculative-config \
            '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1, "disable_by_batch_size": 64}')
        timeout 200 python3 bench/serving.py --build-qwen14b /tmp/qb --gpu-memory-budget 24GiB \
            --num-requests "${SPEC_SERVING_REQUESTS:-120}" --rates 4,inf "${config[@]}" --out "$OUT/spec_serving_$spec.md" 2>&1 \
            | grep -E "^rate|speculation at|budget check" | cut -c1-400
    done
    unset QSERVE_PIECEWISE_SPEC
fi
if has piecewise; then
    stage "piecewise CUDA graphs for steps that carry prefill: GPU tests, then eager vs piecewise step profile"
    timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" tests/integration/test_piecewise_graphs.py \
        > "$OUT/piecewise_tests.txt" 2>&1
    tail -1 "$OUT/piecewise_tests.txt"
    timeout 240 python3 bench/profile_step.py --ckpt /tmp/qb --out "$OUT" --decode 128 --piecewise both \
        --piecewise-buckets 256,512,1024,2048 2>&1 | grep -v USDT | tail -8
fi
if has core; then
    # CORE_LAYOUTS: the runs, in order: 0 (in-process), 1 (the core process, one front end), 1x2 (the core
    # process and --api-server-count 2), a trailing "p" (1p, 1x2p) records that run with py-spy for
    # PROFILE_S (default 30) seconds of its Poisson load (PROFILE_RUN=all_at_once: of the 300 at once), with
    # the carried py-spy wheel.
    for layout in ${CORE_LAYOUTS:-0 1}; do
        mp=${layout%%[xp]*}; rest=${layout#"$mp"}; extra=""; profile=""
        [[ $rest == *p ]] && { profile=${PROFILE_S:-30}; rest=${rest%p}; }
        [[ $rest == x* ]] && extra="--api-server-count ${rest#x}"
        name="http_mp$layout"
        stage "qserve bench against qserve serve, full-vocabulary tokenizer, QSERVE_ENABLE_MULTIPROCESSING=$mp $extra${profile:+ (py-spy ${profile} s)}"
        CONCURRENCY=${CONCURRENCY:-16} QSERVE_ENABLE_MULTIPROCESSING=$mp PROFILE_S=$profile \
            SERVE_ARGS="${SERVE_ARGS:-} $extra" timeout 250 bash bench/serving_http.sh "/tmp/$name" /tmp/qb > "/tmp/$name.txt" 2>&1
        echo "exit code $?"; tail -14 "/tmp/$name.txt"
        [[ -n $profile ]] && { head -60 "/tmp/$name/pyspy_summary.txt" 2>/dev/null; tail -5 "/tmp/$name/pyspy.log" 2>/dev/null; }
        mv "/tmp/$name.txt" "/tmp/$name/"; tar -czf "$OUT/$name.tgz" -C /tmp "$name"
    done
fi
if has serve_default; then
    stage "qserve serve with QSERVE_ENABLE_MULTIPROCESSING unset: which process layout, one completion, SIGTERM"
    # SERVE_DEFAULT_LAYOUTS="unset 0": also the same start-up in one process, to break the time to ready down
    for mp in ${SERVE_DEFAULT_LAYOUTS:-unset}; do
      for keep in ${SERVE_DEFAULT_KEEP_CACHE:-0}; do
        export QSERVE_CAPTURE_KEEP_CACHE=$keep
        echo "--- QSERVE_ENABLE_MULTIPROCESSING=$mp QSERVE_CAPTURE_KEEP_CACHE=$keep"
        # SERVE_DEFAULT_PROFILE=1: py-spy over the whole start-up, the decode-graph capture's samples summarized
        profile=(); [[ ${SERVE_DEFAULT_PROFILE:-0} == 1 ]] && profile=(--profile-startup "$OUT/serve_default_${mp}_keep$keep.pyspy.txt")
        # SERVE_DEFAULT_SMI=1: each second, the processes holding a CUDA context (nvidia-smi) and the python
        # processes' command lines, to tell the front end from the core
        smi=""; if [[ ${SERVE_DEFAULT_SMI:-0} == 1 ]]; then
            (while sleep 1; do echo "@ $(date +%s.%N)"; nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader
                ps -eo pid,ppid,etimes,args | grep -E "[p]ython3" | cut -c1-160; done) > "$OUT/serve_default_${mp}_keep${keep}_smi.txt" 2>&1 &
            smi=$!; fi
        timeout 240 python3 bench/serve_default.py --multiprocessing "$mp" "${profile[@]}" /tmp/qb -- --gpu-memory-budget 24GiB \
            > "$OUT/serve_default_${mp}_keep$keep.txt" 2>&1
        [[ -n $smi ]] && kill "$smi" 2>/dev/null
        grep -vE "^ +[0-9.]+ .*(INFO|DEBUG).*(GET|POST) /" "$OUT/serve_default_${mp}_keep$keep.txt" | tail -${SERVE_DEFAULT_TAIL:-40}
      done
    done
    unset QSERVE_CAPTURE_KEEP_CACHE
fi
if has coldstart; then
    # alternated, on one reused checkpoint (its page cache warm after the first): fixed vs expandable segments
    stage "cold start and plan vs held: PYTORCH_CUDA_ALLOC_CONF fixed segments vs qserve's default, twice each"
    for run in $(seq "${COLDSTART_RUNS:-2}"); do
        for conf in "expandable_segments:False" "default"; do
            echo "--- $conf (run $run)"
            if [[ $conf == default ]]; then unset PYTORCH_CUDA_ALLOC_CONF; else export PYTORCH_CUDA_ALLOC_CONF=$conf; fi
            timeout 150 python3 bench/e2e.py --skip small,offline,capacity --decode-batches 1 --tmp /tmp/qbe \
                --reuse-checkpoint --out "$OUT/coldstart_${run}_${conf//[:]/_}.md" 2>&1 | grep -E "cold start|plan vs held|decode batch"
        done
    done
    unset PYTORCH_CUDA_ALLOC_CONF
fi
if has ampere_proxy; then
    stage "W4A16 on the users' code path: sm86 mma.sync kernels on this card (DISABLE_MMA_V3=1; a proxy), swept"
    timeout 420 python3 bench/kernels.py --ampere-proxy --sweep --sweep-ms 1,16,64,128,256 --ms 1,16,64,128,256,512 \
        --peers "" --jobs 12 --budget-s 300 --out "$OUT/kernels_ampere_proxy.md" 2>&1 | grep -v USDT | tail -30
fi
if has moe_e2e; then
    stage "MoE end to end (Qwen3-30B-A3B-shaped GPTQ 4-bit): decode vs its floor, capacity at 1k, offline 1,000"
    timeout 240 python3 bench/e2e.py --model qwen3-30b-a3b --skip small,fp8 --num-requests 1000 --tmp /tmp/qbm \
        --out "$OUT/moe_e2e.md" 2>&1 | grep -v USDT | tail -12
fi
if has moe_profile; then
    stage "MoE step profile (Qwen3-30B-A3B-shaped GPTQ 4-bit): pure decode at 1 and 32, mixed, per kernel family"
    mkdir -p "$OUT/${MOE_PROFILE_DIR:-.}"
    timeout 200 python3 bench/profile_step.py --model qwen3-30b-a3b --ckpt "${MOE_CKPT:-/tmp/qbm-prof}" \
        --decode "${MOE_PROFILE_DECODE:-1,32}" --piecewise off --out "$OUT/${MOE_PROFILE_DIR:-.}" 2>&1 | grep -v USDT | tail -6
fi
if has moe_sweep; then
    stage "MoE MMA kernel config sweep (each GEMM alone)"
    timeout 420 python3 bench/moe_sweep.py --tokens 1,8,32 --jobs 12 --out "$OUT/moe_sweep.md" \
        > "$OUT/moe_sweep.log" 2>&1
    echo "exit code $?"; grep "^|" "$OUT/moe_sweep.log" | tail -10
fi
if has moe_batch1; then
    # one checkpoint, three engines one after the other (the split and the layout are read at capture)
    stage "MoE batch-1 decode: the MMA kernel plain, split over K, split + the sort-free layout (the default; issue 32)"
    if [[ ${MOE_KERNELS:-1} == 1 ]]; then
        timeout 120 python3 bench/moe.py --tokens 1,8 --out "$OUT/moe_kernels.md" > "$OUT/moe_kernels.log" 2>&1
        echo "bench/moe.py exit code $?"; grep -E "^\|" "$OUT/moe_kernels.md" | head -24
    fi
    IFS=';' read -r -a variants <<< "${MOE_VARIANTS:-QSERVE_MOE_SPLIT_K=0 QSERVE_MOE_DIRECT_BLOCKS=0;QSERVE_MOE_SPLIT_K=auto QSERVE_MOE_DIRECT_BLOCKS=0;QSERVE_MOE_SPLIT_K=auto QSERVE_MOE_DIRECT_BLOCKS=32}"
    for variant in "${variants[@]}"; do
        echo "--- $variant"
        env $variant timeout 150 python3 bench/e2e.py --model qwen3-30b-a3b --skip small,fp8,offline,capacity \
            --decode-batches 1,8 --tmp /tmp/qbm --reuse-checkpoint --out "$OUT/moe_batch1_${variant//[ =]/_}.md" 2>&1 \
            | grep -v USDT | grep -E "decode batch|cold start|Error"
    done
fi
if has moe_fp8; then
    stage "MoE capacity at 1k tokens, model-dtype and fp8 KV (Qwen3-30B-A3B-shaped GPTQ 4-bit)"
    timeout 200 python3 bench/e2e.py --model qwen3-30b-a3b --skip small,decode,offline --tmp /tmp/qbf \
        --out "$OUT/moe_fp8.md" 2>&1 | grep -v USDT | tail -8
fi
stage done
