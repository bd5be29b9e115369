#!/bin/bash
# One device call for the W4A16 kernel (H200): sweep + GemLite + cuBLAS for the four Qwen2.5-14B
# layers at all 12 M, an ncu profile of the decode / M=64 launches, then the -m gpu kernel tests.
# Run from the repo root on the device machine, GemLite's wheel installed on PYTHONPATH, e.g.
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \
#   export PYTHONPATH=/tmp/site:$PWD && bash bench/w4a16_device_run.sh     (about 250 s of run time)
export PYTHONUNBUFFERED=1
set -o pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/env.txt"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" | tee -a "$OUT/env.txt"
timeout 170 python3 bench/kernels.py --sweep --sweep-ms 1,16,64,128,256,512 --budget-s 90 --peers gemlite \
  --shapes gate_up,down,qkv,o --jobs 14 --out "$OUT/kernels.md" 2>&1 | tee "$OUT/bench.log" | grep -v "WRONG\|Error"
echo "bench rc=$? at ${SECONDS}s"
timeout 25 ncu --clock-control none --kernel-name regex:w4a16_mma_kernel --section SpeedOfLight --section WarpStateStats \
  --section Occupancy --section LaunchStats python3 bench/profile_w4a16.py --calls 1 --cases gate_up:1,down:64 \
  >"$OUT/ncu.txt" 2>&1
echo "ncu rc=$? at ${SECONDS}s"
timeout $((250 - SECONDS)) python3 -m pytest -v -m gpu tests/kernels/test_w4a16_mma.py tests/kernels -n 14 \
  -p no:cacheprovider >"$OUT/pytest.txt" 2>&1
echo "pytest rc=$?: passed $(grep -c ' PASSED ' "$OUT/pytest.txt") failed $(grep -c ' FAILED ' "$OUT/pytest.txt")"
