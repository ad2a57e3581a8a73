"""The paper's run matrix as named recipes: ``paper("fib_stagger_w12")``, ``cpu("dense")``.

A name is ``dense`` or ``{fib|pow2}_{fixed|learned|stagger|coprime}_w{W}``. ``paper`` is the
paper's recipe (60.9M parameters, seq 1024, 13,000 steps of 32 x 1024 tokens, bf16); ``cpu``
is a family of the same names sized for studies on a 2-core CPU (d_model 128, 8 layers,
seq 256). Config files under ``configs/`` each name one of these.
"""

from __future__ import annotations

import dataclasses
import re

from fibjax.config import AttentionConfig, CheckpointConfig, ConfigError, DataConfig, ModelConfig, OptimConfig, SSAConfig, TrainConfig

WINDOWS = (6, 8, 10, 12)
VARIANTS = ("fib_fixed", "fib_learned", "fib_stagger", "fib_coprime", "pow2_stagger")
# 4 windows x 5 variants + pow2 fixed at W=8 = the paper's 21 sparse models, plus dense
MATRIX = tuple(f"{v}_w{w}" for w in WINDOWS for v in VARIANTS) + ("pow2_fixed_w8", "dense")
PAPER_MIXTURE = "fineweb_edu=0.35,wikipedia=0.22,tinystories=0.20,math=0.23"
# the commands that prepare the paper configs' data (docs/guides/your-own-data.md "5. The papers' and the CPU study's data"; online)
PREPARE_PAPER = (
    "python -m launch.prepare_data --out data/paper --vocab-size 32768 --max-tokens 150000000 "
    "--source fineweb_edu=hf:HuggingFaceFW/fineweb-edu:sample-10BT --source wikipedia=hf:wikimedia/wikipedia:20231101.en "
    "--source tinystories=hf:roneneldan/TinyStories --val tinystories=hf:roneneldan/TinyStories@validation "
    "--source math=hf:open-web-math/open-web-math"
)
PREPARE_SSA = (
    "python -m launch.prepare_data --out data/ssa --vocab-size 128256 --max-tokens 1000000000 "
    "--source fineweb_edu=hf:HuggingFaceTB/smollm-corpus:fineweb-edu-dedup --source cosmopedia=hf:HuggingFaceTB/smollm-corpus:cosmopedia-v2 "
    "--source python=hf:HuggingFaceTB/smollm-corpus:python-edu"
)
# the CPU family's data from Hugging Face (README; the project's own copy is ../shared/data)
PREPARE_CPU = (
    "python -m launch.prepare_data --out data/cpu --vocab-size 8192 --max-tokens 8000000 "
    "--source fineweb=hf:HuggingFaceFW/fineweb:sample-10BT --source wikipedia=hf:wikimedia/wikipedia:20231101.en "
    "--source tinystories=hf:roneneldan/TinyStories --val tinystories=hf:roneneldan/TinyStories@validation"
)
CPU_SEQ_LEN = 256
_SCHEDULES = {"fixed": "fixed", "learned": "learned", "stagger": "staggered", "coprime": "coprime"}


def attention(name: str, max_rung: int = 0) -> AttentionConfig:
    """The attention of a matrix name; ``max_rung`` bounds the Fibonacci rungs (not pow2's)."""
    if name == "dense":
        return AttentionConfig(kind="dense")
    m = re.fullmatch(r"(fib|pow2)_(fixed|learned|stagger|coprime)_w(\d+)", name)
    if not m:
        raise ConfigError(f"unknown model name {name!r}: expected 'dense' or {{fib|pow2}}_{{fixed|learned|stagger|coprime}}_w<W>")
    base = "fibonacci" if m[1] == "fib" else "pow2"
    return AttentionConfig(kind="offset", base=base, window=int(m[3]), alpha=_SCHEDULES[m[2]], max_rung=max_rung if base == "fibonacci" else 0)


def paper(name: str) -> TrainConfig:
    """The paper's recipe; data: a prepared mixture in data/paper (see docs/guides/your-own-data.md "5. The papers' and the CPU study's data")."""
    return TrainConfig(
        name=name,
        seed=42,
        steps=13_000,
        seq_len=1024,
        global_batch=32,
        log_every=50,
        model=ModelConfig(
            vocab_size=32768, d_model=512, num_layers=16, num_heads=8, num_kv_heads=2, rope_theta=1e4, dtype="bfloat16", attention=attention(name)
        ),
        data=DataConfig(path="data/paper", weights=PAPER_MIXTURE, prepare=PREPARE_PAPER),
        optim=OptimConfig(lr=3e-4, warmup_steps=300, weight_decay=0.1, clip_norm=1.0),
        checkpoint=CheckpointConfig(every_steps=1000, keep=3),
    )


def cpu(name: str) -> TrainConfig:
    """The same model names at CPU size; data: data/cpu from ../shared/data (see docs/guides/your-own-data.md "5. The papers' and the CPU study's data").

    Fibonacci rungs are bounded by the training length (<= 255: up to 233), so that, as in the
    paper (987 < 1024), every rung at alpha <= 1 was attended in training."""
    return TrainConfig(
        name=f"cpu_{name}",
        seed=42,
        steps=1000,
        seq_len=CPU_SEQ_LEN,
        global_batch=16,
        log_every=10,
        model=ModelConfig(vocab_size=8192, d_model=128, num_layers=8, num_heads=4, num_kv_heads=2, attention=attention(name, max_rung=CPU_SEQ_LEN - 1)),
        data=DataConfig(path="data/cpu", weights="fineweb=0.5,wikipedia=0.3,tinystories=0.2", prepare=PREPARE_CPU),
        optim=OptimConfig(lr=1e-3, warmup_steps=100),
        checkpoint=CheckpointConfig(every_steps=250, keep=2),
    )


# --- paper B (SSA) -------------------------------------------------------------------------
SSA_METHODS = ("fullattn", "moba", "ssa", "ssa_fib")


def _ssa_method(name: str, attention: AttentionConfig) -> tuple[AttentionConfig, SSAConfig]:
    """FullAttn: dense training. MoBA: block-sparse only. SSA: both streams, MoBA blocks.
    SSA-Fib: both streams, Fibonacci offsets as the sparse stream (unpublished variant)."""
    if name == "fullattn":
        return attention, SSAConfig()
    if name == "moba":
        return dataclasses.replace(attention, kind="block_sparse"), SSAConfig()
    if name in ("ssa", "ssa_fib"):
        return attention, SSAConfig(enabled=True, sparse_kind="block_sparse" if name == "ssa" else "offset")
    raise ConfigError(f"unknown SSA method {name!r}: expected one of {SSA_METHODS}")


def ssa_cpu(name: str) -> TrainConfig:
    """Paper B's methods at CPU size (block 16 x 4 blocks = receptive field 64 at seq 256)."""
    attention = AttentionConfig(kind="dense", block_size=16, num_blocks=4, window=8, alpha="staggered", max_rung=CPU_SEQ_LEN - 1)
    attention, ssa = _ssa_method(name, attention)
    return TrainConfig(
        name=f"ssa_cpu_{name}",
        seed=42,
        steps=1000,
        seq_len=CPU_SEQ_LEN,
        global_batch=16,
        log_every=10,
        model=ModelConfig(vocab_size=8192, d_model=128, num_layers=8, num_heads=4, num_kv_heads=2, attention=attention),
        data=DataConfig(path="data/cpu", weights="fineweb=0.5,wikipedia=0.3,tinystories=0.2", prepare=PREPARE_CPU),
        optim=OptimConfig(lr=1e-3, warmup_steps=100),
        checkpoint=CheckpointConfig(every_steps=250, keep=2),
        ssa=ssa,
    )


def ssa_paper(name: str) -> TrainConfig:
    """Paper B's Llama-3.2-1B shape (16 layers, hidden 2048, 32 heads, 2 KV heads, head dim 64,
    RoPE theta 5e5) at 8k tokens, block 16 x 16 blocks (receptive field 256), align weight 10."""
    attention = AttentionConfig(kind="dense", block_size=16, num_blocks=16, window=12, alpha="staggered")
    attention, ssa = _ssa_method(name, attention)
    return TrainConfig(
        name=f"ssa_paper_{name}",
        seed=42,
        steps=100_000,
        seq_len=8192,
        global_batch=16,
        log_every=50,
        model=ModelConfig(
            vocab_size=128256,
            d_model=2048,
            num_layers=16,
            num_heads=32,
            num_kv_heads=2,
            head_dim=64,
            mlp_hidden=8192,
            rope_theta=5e5,
            dtype="bfloat16",
            remat="full",
            attention=attention,
        ),
        data=DataConfig(path="data/ssa", prepare=PREPARE_SSA),
        optim=OptimConfig(lr=3e-4, warmup_steps=2000),
        checkpoint=CheckpointConfig(every_steps=1000, keep=3),
        ssa=ssa,
    )
