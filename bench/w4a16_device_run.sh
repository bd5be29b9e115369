#!/bin/bash
# One device call for the W4A16 kernel (H200): the GPU correctness tests of the MMA kernel first
# (a kernel change is measured only once it is right), then the sweep + GemLite + cuBLAS for the
# four Qwen2.5-14B layers, then an ncu profile of chosen launches. Run from the repo root on the
# device machine, GemLite's wheel installed on PYTHONPATH, e.g.
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \
#   export PYTHONPATH=/tmp/site:$PWD && bash bench/w4a16_device_run.sh     (about 300 s of run time)
# Environment: OUT (output folder), SWEEP_MS (the M values swept; others time the built-in
# dispatch), MS (the M values timed), NCU_CASES (shape:M,... profiled), BENCH_S (the bench's limit),
# SKIP_TESTS (non-empty: no GPU tests), TESTS_S (their limit, default 110), SKIP_NCU, PDL (non-empty: also time the default with PDL launches;
# the PDL GPU test runs with the others).
export PYTHONUNBUFFERED=1
set -o pipefail
OUT=${OUT:-out}
SWEEP_MS=${SWEEP_MS:-1,16,64,128,256,512}
MS=${MS:-1,2,4,8,16,32,64,128,256,512,1024,4096}
NCU_CASES=${NCU_CASES:-gate_up:1,down:64}
BENCH_S=${BENCH_S:-170}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/env.txt"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" | tee -a "$OUT/env.txt"
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout ${TESTS_S:-110} python3 -m pytest -x -q -m gpu -o addopts="" tests/kernels/test_w4a16_mma.py tests/kernels/test_pdl.py -n 14 -p no:cacheprovider \
    >"$OUT/pytest.txt" 2>&1
  echo "pytest rc=$? at ${SECONDS}s: $(tail -1 "$OUT/pytest.txt")"
fi
timeout "$BENCH_S" python3 bench/kernels.py --sweep --sweep-ms "$SWEEP_MS" --ms "$MS" --budget-s $((BENCH_S / 2)) \
  --peers gemlite --shapes gate_up,down,qkv,o --jobs 14 ${PDL:+--pdl} --out "$OUT/kernels.md" 2>&1 | tee "$OUT/bench.log" \
  | grep -v "WRONG\|Error" | tail -5
echo "bench rc=$? at ${SECONDS}s"
[ -n "${SKIP_NCU:-}" ] && exit 0
timeout 40 ncu --clock-control none --kernel-name regex:w4a16_mma_kernel --section SpeedOfLight --section WarpStateStats \
  --section Occupancy --section LaunchStats python3 bench/profile_w4a16.py --calls 1 --cases "$NCU_CASES" \
  >"$OUT/ncu.txt" 2>&1
echo "ncu rc=$? at ${SECONDS}s"
