"""Tiny Hugging Face model directories for the import/export tests, made two ways:

- by hand (``handmade``): a config.json, random tensors written with fibjax's own safetensors
  writer and a tokenizer.json trained with the ``tokenizers`` package; needs neither torch nor
  transformers, so the bad-input tests run everywhere;
- by ``transformers`` itself (``by_transformers``): its own config class and ``save_pretrained``,
  for the parity tests (skipped with one line where the ``hf-parity`` extra is not installed).
"""

from pathlib import Path

import pytest

from fibjax.hf import synthetic

VOCAB = synthetic.SMALL["vocab_size"]  # the models' rows; the tokenizer has 300 (models often pad their vocabulary)
PARITY_EXTRA = "pip install -e '.[hf-parity]' (torch and transformers) to run the Hugging Face parity tests"

# the four architectures of the parity tests: their transformers config kwargs
ARCHS = {
    "llama": ("LlamaConfig", dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "llama3": (
        "LlamaConfig",
        dict(
            num_key_value_heads=2,
            rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
            tie_word_embeddings=True,
        ),
    ),
    "mistral": ("MistralConfig", dict(num_key_value_heads=1, sliding_window=None, head_dim=24)),
    # a sliding window shorter than the tests' sequences (40 tokens, 12 + 32 generated): the window kind
    "mistral_window": ("MistralConfig", dict(num_key_value_heads=1, sliding_window=8, head_dim=24)),
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=2, tie_word_embeddings=True)),
}


def handmade(model_dir: Path, *, model_type: str = "llama", tie: bool = False, shards: int = 1, seed: int = 0, **config) -> Path:
    """A Llama-layout model directory written without torch (``fibjax.hf.synthetic``)."""
    return synthetic.write_model(model_dir, synthetic.small_config(model_type, tie, **config), shards=shards, seed=seed)


def transformers_or_skip():
    try:
        import torch  # noqa: F401
        import transformers
    except ImportError:
        pytest.skip(PARITY_EXTRA)
    return transformers


def by_transformers(model_dir: Path, arch: str, seed: int = 0):
    """A random model of ``arch`` built and saved by transformers itself; returns it (eval mode)."""
    transformers = transformers_or_skip()
    import torch

    config_class, kwargs = ARCHS[arch]
    config = getattr(transformers, config_class)(**synthetic.SMALL, **kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # the initialiser's tiny weights give near-uniform logits: greedy ties
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(model_dir)
    synthetic.write_tokenizer(model_dir)
    return model
