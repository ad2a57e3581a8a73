#!/usr/bin/env bash
# The TPU counterpart of launch/gpu_check.sh: run it on one TPU VM (a single-host slice, e.g.
# v5litepod-1 or v4-8) after `pip install -e ".[tpu]"`, from the repository root:
#   bash launch/tpu_check.sh            # OUT=/tmp/tpu_check by default
# Writes $OUT/tpu_check.log (everything) and $OUT/table.md (the tables for BUILD_NOTES.md).
# Until its output is in BUILD_NOTES.md, implementation=None keeps the XLA path on TPU
# (PALLAS_BY_DEFAULT in fibjax/attention/pallas/backend.py). Steps, each bounded:
#   1. the Mosaic-compiled kernels (offset and block-sparse) against the XLA path on the TPU
#      (forward, lse, all grads), PASS/FAIL at the test suite's tolerances (python -m launch.bench kernels);
#   2. a block-size sweep of the Pallas rows at 16k tokens, fwd+bwd (multiples of 128: the
#      TPU's lane width), picking the fastest;
#   3. python -m launch.bench at 1k..64k, bf16, 8 heads, head dim 64: XLA, Pallas (the block-sparse
#      kernels forward and backward among them), and the dense row, which on TPU is JAX's Pallas
#      flash attention (fibjax/attention/fused.py).
# Rehearse it on CPU (interpret mode, small shapes, no timing): python -m launch.bench kernels --small
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/tpu_check}
mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
exec > >(tee "$OUT/tpu_check.log") 2>&1

$PY -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"

echo "== 1. Mosaic kernels vs the XLA path on the TPU (fwd, lse, all grads); 2. block sizes at 16k, bf16, fwd+bwd"
BEST=$(timeout 600 $PY -m launch.bench kernels --pallas-blocks 128,128 --sweep "128,128;256,256;512,512;128,512;512,128" --sweep-seq 16384 \
  | tee /dev/stderr | sed -n 's/^blocks: //p')
echo "best blocks: ${BEST:=128,128,4,2}"

echo "== 3. the table (bf16, B=1, H=8, D=64, K=8; then K=2, the paper's GQA, at 16k)"
for SEQ in 16384 1024 4096 65536 2048 8192 32768; do
  timeout 300 $PY -m launch.bench attention --seq $SEQ --dtype bfloat16 --heads 8 --kv-heads 8 --head-dim 64 \
    --repeats 10 --paths dense,static,learned,static_pallas,learned_pallas,block_sparse,block_sparse_pallas --pallas-blocks "$BEST" | tee -a "$OUT/table.md"
done
timeout 300 $PY -m launch.bench attention --seq 16384 --dtype bfloat16 --heads 8 --kv-heads 2 --head-dim 64 \
  --repeats 10 --paths dense,static,learned,static_pallas,learned_pallas,block_sparse,block_sparse_pallas --pallas-blocks "$BEST" | tee -a "$OUT/table.md"
echo "done"
