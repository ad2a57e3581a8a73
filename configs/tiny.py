"""The embedded default: a tiny depth-staggered Fibonacci model on Python's own documentation.

Runs offline on a 2-core CPU in a few minutes: ``python -m launch.train``.
"""

from fibjax.config import AttentionConfig, CheckpointConfig, ModelConfig, OptimConfig, TrainConfig


def get_config() -> TrainConfig:
    return TrainConfig(
        name="tiny",
        steps=600,
        seq_len=256,
        global_batch=16,
        log_every=10,
        model=ModelConfig(
            vocab_size=2048,
            d_model=128,
            num_layers=4,
            num_heads=4,
            num_kv_heads=2,
            attention=AttentionConfig(kind="offset", base="fibonacci", window=8, alpha="staggered", max_rung=255),
        ),
        optim=OptimConfig(lr=3e-3, warmup_steps=30),
        checkpoint=CheckpointConfig(every_steps=200, keep=2),
    )
