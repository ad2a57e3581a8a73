#!/usr/bin/env bash
# The GPU check in one shot, for a session that has an H200 (the device tool):
#   run(command="bash launch/gpu_check.sh", timeout_s=600)
# and its rehearsal on any CPU (interpret mode, small sizes, the same steps end to end):
#   bash launch/gpu_check.sh --rehearse
# Uses the machine's own python3 and JAX (nothing is installed; nothing can be fetched there).
# Writes $OUT/gpu_check.log (everything) and $OUT/table.md (the tables for BUILD_NOTES.md).
# Steps, most wanted first, each bounded by its own cap and by DEADLINE (540 s: the 9 minutes
# issue 40 allows, compilation included); a step that no longer fits says "skipped":
#   0. the backend probe: dense causal flash attention on Pallas' Triton and Mosaic GPU backends
#      against cuDNN at 16k (BUILD_NOTES, "Backend and pin");
#   1. the Pallas kernels (offset, learned, block-sparse) against the XLA path on the GPU: forward,
#      lse, all grads; fp32 T=1000 at full precision, bf16 T=4096 GQA (python -m launch.bench kernels);
#   2. the 16k rows: the offset paths at K=8 (cudnn, static, static_pallas, learned_pallas), then
#      block-sparse at K=2 (cudnn, block_sparse, block_sparse_pallas, nsa) with --phases;
#      then (issue 53) the block-sparse kernels' variants side by side at 16k, K=2, each over the
#      default kernels in the same run (2c), and the offset kernels' block sizes in a short sweep,
#      each candidate over the first, the default (2d); the window kind against the offset path at
#      equal keys per query: cuDNN's local_window_size, the window XLA path, static, static_pallas (2e);
#   3. SSA's training step against FullAttn at paper B's shape (1B, 8k tokens, batch 2);
#   4. the same rows at 64k, then at 4k.
# Caps come from the first run (BUILD_NOTES, "GPU check": ~55 s compiling a kernel case and path,
# ~95 s a length's four attention paths); they are estimates until this script's first H200 run.
# Every table row carries GB/s, TFLOP/s and / ref (the time over cuDNN's).
# STEPS="2c 2d" runs only the steps named (their ids), the others say "not selected".
# Block sizes: BLOCKS=BQ,BK,WARPS,STAGES (default 128,128,4,2); step 2d sweeps four (~60 s a
# candidate, first run's estimate; a longer sweep: python -m launch.bench kernels --sweep-only ...).
set -uo pipefail
cd "$(dirname "$0")/.."
REHEARSE=0
[ "${1:-}" = "--rehearse" ] && REHEARSE=1
BEST=${BLOCKS:-128,128,4,2}
SCALE=1 REF=cudnn
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
if [ "$REHEARSE" = 1 ]; then
  # stand-ins for 16k / 64k / 4k and a two-layer SSA model; Pallas runs interpreted, the GPU-only
  # rows (cudnn, triton_flash, mosaic_flash) report themselves skipped and the XLA dense path is
  # the reference row; twice the time (a shared 2-core CPU); figures mean nothing
  OUT=${OUT:-/tmp/gpu_check_rehearsal}
  PY=${PY:-python}
  export JAX_PLATFORMS=cpu
  SEQ_MAIN=256 SEQ_LONG=512 SEQ_SHORT=128 REPEATS=1 BEST=${BLOCKS:-64,64,4,2} SCALE=2 REF=dense
  SEQ_VARIANTS=128 SWEEP="64,64,4,2;32,32,4,2"
  KERNELS=(--small)
  TRAIN=(model.d_model=64 model.num_layers=2 model.num_heads=4 model.num_kv_heads=2 model.vocab_size=512 seq_len=256 mesh.devices=1)
else
  OUT=${OUT:-/tmp/gpu_check}
  PY=${PY:-python3}
  # a rerun on the same warm machine skips the compiles this one did
  export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/fibjax_jax_cache}
  SEQ_MAIN=16384 SEQ_LONG=65536 SEQ_SHORT=4096 REPEATS=10
  # the first candidate is the default (BlockSizes()), whose programs step 2a has likely put in the cache
  SEQ_VARIANTS=$SEQ_MAIN SWEEP="128,128,4,2;64,64,4,2;128,128,8,2;64,64,4,3"
  KERNELS=(--sweep-seq 0)
  TRAIN=()
fi
DEADLINE=${DEADLINE:-$((540 * SCALE))}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_check.log") 2>&1

# step NAME CAP CMD...: CMD (a command or an exported function) under min(CAP x SCALE, what
# DEADLINE leaves), its stdout also into table.md
step() {
  local name=$1 cap=$(($2 * SCALE))
  shift 2
  if [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" ${name%%.*} "* ]]; then
    echo "== $name: not selected"
    return
  fi
  local left=$((DEADLINE - SECONDS))
  local limit=$((cap < left ? cap : left))
  if [ "$limit" -lt 20 ]; then
    echo "== $name: skipped (${left}s left of ${DEADLINE}s)"
    return
  fi
  echo "== $name (at most ${limit}s; ${SECONDS}s in)"
  printf '\n## %s\n\n' "$name" >>"$OUT/table.md"
  timeout "$limit" bash -c '"$@"' _ "$@" | tee -a "$OUT/table.md"
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 124 ] && echo "== $name: TIMED OUT after ${limit}s"
  echo "== $name: exit $rc at ${SECONDS}s"
}

attention() { # attention SEQ KV_HEADS PATHS [more flags]: one bench run, bf16, B 1, H 8, D 64
  local seq=$1 kv=$2 paths=$3
  shift 3
  $PY -m launch.bench attention --seq "$seq" --dtype bfloat16 --heads 8 --kv-heads "$kv" --head-dim 64 \
    --repeats "$REPEATS" --paths "$paths" --pallas-blocks "$BEST" "$@"
}

export -f attention
export PY REPEATS BEST
OFFSETS=$REF,static,static_pallas,learned_pallas
SPARSE=$REF,block_sparse,block_sparse_pallas,nsa
VARIANTS=default,gather,bf16_partials,skip_padding,blocks4,combined  # fibjax/attention/pallas/block_kernels.py

[ "$REHEARSE" = 1 ] || nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
$PY -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"

step "0. backend probe: dense flash, Triton vs Mosaic GPU vs cuDNN, seq $SEQ_MAIN" 60 attention "$SEQ_MAIN" 8 cudnn,triton_flash,mosaic_flash
step "1. kernels vs the XLA path (fp32 full precision, bf16 GQA)" 200 $PY -m launch.bench kernels --pallas-blocks "$BEST" ${KERNELS[@]+"${KERNELS[@]}"}
step "2a. offsets, seq $SEQ_MAIN, K=8" 90 attention "$SEQ_MAIN" 8 "$OFFSETS"
step "2b. block-sparse 16 x 16 and NSA, seq $SEQ_MAIN, K=2, phases" 90 attention "$SEQ_MAIN" 2 "$SPARSE" --phases
step "2c. block-sparse kernel variants side by side, seq $SEQ_VARIANTS, K=2" 150 attention "$SEQ_VARIANTS" 2 "$REF,block_sparse_pallas" \
  --pallas-variants "$VARIANTS" --rounds 3
step "2d. offset kernels' block sizes, seq $SEQ_MAIN, K=8 (each over the first)" 120 $PY -m launch.bench kernels --sweep-only \
  --sweep "$SWEEP" --sweep-seq "$SEQ_MAIN" --repeats "$REPEATS"
step "2e. window vs offsets at equal keys per query, seq $SEQ_MAIN, K=8" 60 attention "$SEQ_MAIN" 8 "$REF,cudnn_window,window,static,static_pallas"
step "3. SSA training step vs FullAttn (paper B's shape, batch 2)" 120 $PY -m launch.bench train \
  --configs configs/ssa/paper_fullattn.py,configs/ssa/paper_ssa.py --steps 3 --rounds 2 global_batch=2 ${TRAIN[@]+"${TRAIN[@]}"}
step "4a. offsets, seq $SEQ_LONG, K=8" 70 attention "$SEQ_LONG" 8 "$OFFSETS"
step "4b. block-sparse and NSA, seq $SEQ_LONG, K=2, phases" 70 attention "$SEQ_LONG" 2 "$SPARSE" --phases
step "4c. offsets, seq $SEQ_SHORT, K=8" 50 attention "$SEQ_SHORT" 8 "$OFFSETS"
step "4d. block-sparse and NSA, seq $SEQ_SHORT, K=2, phases" 50 attention "$SEQ_SHORT" 2 "$SPARSE" --phases
echo "done in ${SECONDS}s"
