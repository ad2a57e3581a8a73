#!/usr/bin/env bash
# Issue 8's GPU table in one shot, for a session that has an H200 (the device tool):
#   run(command="bash launch/gpu_check.sh", timeout_s=600)
# Uses the machine's own python3 and JAX (nothing is installed; nothing can be fetched there).
# Writes $OUT/gpu_check.log (everything) and $OUT/table.md (the tables for BUILD_NOTES.md).
# Steps, each bounded so a failure leaves the rest running:
#   1. the Triton-compiled kernels (offset and block-sparse) against the XLA path on the GPU
#      (forward, lse, all grads), PASS/FAIL at the test suite's tolerances (python -m launch.bench kernels);
#   2. a block-size sweep of the Pallas rows at 16k tokens, fwd+bwd, picking the fastest;
#   3. python -m launch.bench at 1k..64k, bf16, 8 heads, head dim 64: XLA, Pallas, cuDNN rows;
#   4. the block-sparse rows at 16k (issue 31: the XLA path, the Pallas kernels forward and
#      backward, cuDNN dense);
#   5. if the steps above left time: SSA's training overhead at paper B's shape (1B, 8k tokens,
#      batch 2), FullAttn against SSA (python -m launch.bench train).
# Every step has a timeout; the sum stays under the device tool's 600 s per command.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
exec > >(tee "$OUT/gpu_check.log") 2>&1

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
$PY -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"

echo "== 1. Triton kernels vs the XLA path on the GPU (fwd, lse, all grads); 2. block sizes at 16k, bf16, fwd+bwd"
# the last line names the fastest blocks that ran (launch.bench kernels; --small runs it on CPU)
BEST=$(timeout 180 $PY -m launch.bench kernels --sweep "64,64,4,2;128,128,4,2;128,128,8,2;32,64,4,2" --sweep-seq 16384 | tee /dev/stderr | sed -n 's/^blocks: //p')
echo "best blocks: ${BEST:=128,128,4,2}"

echo "== 3. the table (bf16, B=1, H=8, D=64, K=8; then K=2, the paper's GQA, at 16k)"
# one process per length, the issue's 16k first, so a timeout loses one row, not the table
for SEQ in 16384 1024 4096 65536 2048 8192 32768; do
  timeout 45 $PY -m launch.bench attention --seq $SEQ --dtype bfloat16 --heads 8 --kv-heads 8 --head-dim 64 \
    --repeats 10 --paths static,learned,static_pallas,learned_pallas,cudnn --pallas-blocks "$BEST" | tee -a "$OUT/table.md"
done
timeout 45 $PY -m launch.bench attention --seq 16384 --dtype bfloat16 --heads 8 --kv-heads 2 --head-dim 64 \
  --repeats 10 --paths static,learned,static_pallas,learned_pallas,cudnn --pallas-blocks "$BEST" | tee -a "$OUT/table.md"
echo "== 4. block-sparse (16 blocks of 16), bf16, 16k, K=2"
timeout 30 $PY -m launch.bench attention --seq 16384 --dtype bfloat16 --heads 8 --kv-heads 2 --head-dim 64 \
  --repeats 5 --paths block_sparse,block_sparse_pallas,cudnn --pallas-blocks "$BEST" | tee -a "$OUT/table.md"
echo "== 5. SSA's training overhead, paper B's shape (1B, 8k x 2), bf16, if time is left"
LEFT=$((575 - SECONDS))
if [ "$LEFT" -gt 150 ]; then
  timeout "$LEFT" $PY -m launch.bench train --configs configs/ssa/paper_fullattn.py,configs/ssa/paper_ssa.py \
    --steps 3 --rounds 2 global_batch=2 | tee -a "$OUT/table.md"
else
  echo "skipped: ${LEFT}s left"
fi
echo "done in ${SECONDS}s"
