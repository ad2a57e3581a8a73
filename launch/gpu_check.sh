#!/usr/bin/env bash
# Issue 8's GPU table in one shot, for a session that has an H200 (the device tool):
#   run(command="bash launch/gpu_check.sh", timeout_s=600)
# Uses the machine's own python3 and JAX (nothing is installed; nothing can be fetched there).
# Writes $OUT/gpu_check.log (everything) and $OUT/table.md (the tables for BUILD_NOTES.md).
# Steps, each bounded so a failure leaves the rest running:
#   1. the Triton-compiled kernels against the XLA path on the GPU (forward, lse, all grads);
#   2. a block-size sweep of the Pallas rows at 16k tokens, fwd+bwd, picking the fastest;
#   3. python -m launch.bench at 1k..64k, bf16, 8 heads, head dim 64: XLA, Pallas, cuDNN rows.
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

echo "== 1. Triton kernels vs the XLA path on the GPU"
timeout 90 $PY - <<'EOF'
import jax, jax.numpy as jnp, numpy as np
from fibjax.attention import attended_distances
from fibjax.attention.offset_xla import interpolated_attention_xla, offset_attention_xla
from fibjax.attention.pallas import interpolated_attention_pallas, offset_attention_pallas

def grads(f, q, k, v, a, w):
    loss = lambda q, k, v, a: (lambda o: jnp.sum(o[0].astype(jnp.float32) * w) + jnp.sum(o[1]))(f(q, k, v, a))
    return jax.jit(lambda *x: (f(*x), jax.grad(loss, (0, 1, 2, 3))(*x)))(q, k, v, a)

for t, h, kh, dtype in ((1000, 8, 8, jnp.float32), (1000, 8, 2, jnp.bfloat16), (4096, 8, 2, jnp.bfloat16)):
    ks = jax.random.split(jax.random.PRNGKey(t), 4)
    q, k, v = (jax.random.normal(kk, (2, t, n, 64), jnp.float32).astype(dtype) for kk, n in zip(ks, (h, kh, kh)))
    w, a = jax.random.normal(ks[3], q.shape), jnp.float32(0.93)
    ds = attended_distances(window=12, base="fibonacci", alpha=0.93, seq_len=t)
    pairs = {
        "static": (lambda q, k, v, a: offset_attention_pallas(q, k, v, distances=ds, return_lse=True),
                   lambda q, k, v, a: offset_attention_xla(q, k, v, distances=ds, return_lse=True)),
        "learned": (lambda q, k, v, a: interpolated_attention_pallas(q, k, v, window=12, base="fibonacci", alpha=a, return_lse=True),
                    lambda q, k, v, a: interpolated_attention_xla(q, k, v, window=12, base="fibonacci", alpha=a, return_lse=True)),
    }
    for name, (fp, fx) in pairs.items():
        try:
            (got, g_got), (ref, g_ref) = grads(fp, q, k, v, a, w), grads(fx, q, k, v, a, w)
            err = lambda x, y: float(np.max(np.abs(np.asarray(x, np.float32) - np.asarray(y, np.float32))))
            errs = [err(got[0], ref[0]), err(got[1], ref[1])] + [err(x, y) for x, y in zip(g_got, g_ref)]
            print(f"T={t} H={h} K={kh} {jnp.dtype(dtype).name} {name}: max |pallas - xla| out, lse, dq, dk, dv, dalpha =",
                  " ".join(f"{e:.2e}" for e in errs), f"(dalpha xla {float(g_ref[3]):.4g})")
        except Exception as e:  # keep going: the benchmark below still says what runs
            print(f"T={t} {name}: FAILED {type(e).__name__}: {str(e)[:2000]}")
EOF

echo "== 2. block sizes at 16k tokens, bf16, fwd+bwd"
BEST=$(timeout 120 $PY - <<'EOF' | tee /dev/stderr | tail -1
import sys
import jax.numpy as jnp
from fibjax.attention.pallas import BlockSizes
from fibjax.bench import attention as ab
from fibjax.bench.timing import measure
best = None
for blocks in ((64, 64, 4, 2), (128, 128, 4, 2), (128, 128, 8, 2), (32, 64, 4, 2)):
    case = ab.Case(seq_len=16384, kv_heads=8, dtype="bfloat16", block_sizes=BlockSizes(*blocks))
    q, k, v = ab.inputs(case)
    try:
        ms = [measure(ab.forward_backward(ab.PATHS[p](case)), q, k, v, jnp.float32(case.alpha), repeats=10).ms for p in ("static_pallas", "learned_pallas")]
    except Exception as e:
        print(blocks, "FAILED", type(e).__name__, str(e)[:500], file=sys.stderr)
        continue
    print(blocks, "fwd+bwd ms static %.3f learned %.3f" % tuple(ms), file=sys.stderr)
    if best is None or ms[0] + ms[1] < best[0]:
        best = (ms[0] + ms[1], blocks)
print(",".join(map(str, best[1] if best else (128, 128, 4, 2))))
EOF
)
echo "best blocks: ${BEST:=128,128,4,2}"

echo "== 3. the table (bf16, B=1, H=8, D=64, K=8; then K=2, the paper's GQA, at 16k)"
# one process per length, the issue's 16k first, so a timeout loses one row, not the table
for SEQ in 16384 1024 4096 65536 2048 8192 32768; do
  timeout 45 $PY -m launch.bench attention --seq $SEQ --dtype bfloat16 --heads 8 --kv-heads 8 --head-dim 64 \
    --repeats 10 --paths static,learned,static_pallas,learned_pallas,cudnn --pallas-blocks "$BEST" | tee -a "$OUT/table.md"
done
timeout 45 $PY -m launch.bench attention --seq 16384 --dtype bfloat16 --heads 8 --kv-heads 2 --head-dim 64 \
  --repeats 10 --paths static,learned,static_pallas,learned_pallas,cudnn --pallas-blocks "$BEST" | tee -a "$OUT/table.md"
echo "done"
