#!/usr/bin/env bash
# The GPU check in one shot, for a session that has an H200 (the device tool):
#   run(command="bash launch/gpu_check.sh", timeout_s=600)
# Uses the machine's own python3 and JAX (nothing is installed; nothing can be fetched there).
# Writes $OUT/gpu_check.log (everything) and $OUT/table.md (the tables for BUILD_NOTES.md).
# Timed from the first run (BUILD_NOTES, "GPU check"): compiling dominates, ~55 s per kernel case
# and path in step 1, ~95 s for a length's four attention paths, so the steps are few and bounded:
#   1. the Triton-compiled kernels (offset and block-sparse) against the XLA path on the GPU
#      (forward, lse, all grads; fp32 T=1000 with the reference at full fp32 precision, bf16 T=4096
#      GQA), PASS/FAIL at the test suite's tolerances (python -m launch.bench kernels);
#   2. the 16k row at the paper's GQA (K=2): cuDNN, the XLA offset paths, the Pallas kernels;
#   3. the block-sparse rows at 16k (issue 31: the XLA path, the Pallas kernels, cuDNN dense);
#   4. if the steps above left time: SSA's training overhead at paper B's shape (1B, 8k tokens,
#      batch 2), FullAttn against SSA (python -m launch.bench train).
# Block sizes: BLOCKS=BQ,BK,WARPS,STAGES (default 128,128,4,2); a sweep is its own command
# (python -m launch.bench kernels --sweep "64,64,4,2;128,128,8,2" --sweep-seq 16384, ~60 s a candidate).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
exec > >(tee "$OUT/gpu_check.log") 2>&1

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
$PY -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"

echo "== 1. Triton kernels vs the XLA path on the GPU (fwd, lse, all grads)"
BEST=${BLOCKS:-128,128,4,2}
timeout 340 $PY -m launch.bench kernels --pallas-blocks "$BEST" --sweep-seq 0

echo "== 2. the 16k row (bf16, B=1, H=8, D=64, K=2: the paper's GQA)"
timeout 130 $PY -m launch.bench attention --seq 16384 --dtype bfloat16 --heads 8 --kv-heads 2 --head-dim 64 \
  --repeats 10 --paths cudnn,static,static_pallas,learned_pallas --pallas-blocks "$BEST" | tee -a "$OUT/table.md"

echo "== 3. block-sparse (16 blocks of 16), bf16, 16k, K=2"
timeout 45 $PY -m launch.bench attention --seq 16384 --dtype bfloat16 --heads 8 --kv-heads 2 --head-dim 64 \
  --repeats 5 --paths block_sparse,block_sparse_pallas,cudnn --pallas-blocks "$BEST" | tee -a "$OUT/table.md"
echo "== 4. SSA's training overhead, paper B's shape (1B, 8k x 2), bf16, if time is left"
LEFT=$((575 - SECONDS))
if [ "$LEFT" -gt 150 ]; then
  timeout "$LEFT" $PY -m launch.bench train --configs configs/ssa/paper_fullattn.py,configs/ssa/paper_ssa.py \
    --steps 3 --rounds 2 global_batch=2 | tee -a "$OUT/table.md"
else
  echo "skipped: ${LEFT}s left"
fi
echo "done in ${SECONDS}s"
