"""Hugging Face Llama-family tensor names <-> fibjax's parameter tree.

Hugging Face stores a linear layer's weight as [out, in]; fibjax's ``nnx.Linear`` kernel is
[in, out], so projections are transposed on the way in and out. Embedding tables, norm scales and
biases keep their layout. Query head h uses KV head h // (H / K) in both (Hugging Face's
``repeat_kv`` and fibjax's ``group_queries``), and both rotate the two halves of each head's
width (``rotate_half``), so no head or channel is permuted.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fibjax.config import ModelConfig
from fibjax.hf import safetensors
from fibjax.hf.config import UnsupportedModel

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# buffers some checkpoints carry that are recomputed from the config, not parameters
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# how much of each table ``check_tied`` compares at a time
TIE_CHUNK_BYTES = 64 * 2**20

_LAYER = {
    "input_layernorm.weight": (("attn_norm", "scale"), False),
    "post_attention_layernorm.weight": (("mlp_norm", "scale"), False),
    "self_attn.q_proj.weight": (("attn", "q_proj", "kernel"), True),
    "self_attn.k_proj.weight": (("attn", "k_proj", "kernel"), True),
    "self_attn.v_proj.weight": (("attn", "v_proj", "kernel"), True),
    "self_attn.o_proj.weight": (("attn", "o_proj", "kernel"), True),
    "mlp.gate_proj.weight": (("mlp", "gate", "kernel"), True),
    "mlp.up_proj.weight": (("mlp", "up", "kernel"), True),
    "mlp.down_proj.weight": (("mlp", "down", "kernel"), True),
}
_BIASES = {f"self_attn.{p}_proj.bias": (("attn", f"{p}_proj", "bias"), False) for p in "qkv"}


@dataclass(frozen=True)
class Tensor:
    """One parameter: its Hugging Face name, its fibjax path, and whether it is transposed."""

    hf_name: str
    path: tuple  # keys into the pure parameter dict, e.g. ("blocks", 3, "attn", "q_proj", "kernel")
    transposed: bool
    shape: tuple[int, ...]  # fibjax's shape


def tensors(cfg: ModelConfig) -> Iterator[Tensor]:
    """Every parameter of a dense fibjax model of ``cfg`` with its Hugging Face name."""
    d, h, k, e, f, v = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim, cfg.resolved_mlp_hidden, cfg.vocab_size
    shapes = {
        "attn_norm": (d,),
        "mlp_norm": (d,),
        "q_proj": (d, h * e),
        "k_proj": (d, k * e),
        "v_proj": (d, k * e),
        "o_proj": (h * e, d),
        "gate": (d, f),
        "up": (d, f),
        "down": (f, d),
    }
    yield Tensor("model.embed_tokens.weight", ("embed", "embedding"), False, (v, d))
    for i in range(cfg.num_layers):
        layer = {**_LAYER, **(_BIASES if cfg.qkv_bias else {})}
        for suffix, (path, transposed) in layer.items():
            shape = shapes[path[-2]] if path[-1] != "bias" else (shapes[path[-2]][1],)
            yield Tensor(f"model.layers.{i}.{suffix}", ("blocks", i, *path), transposed, shape)
    yield Tensor("model.norm.weight", ("final_norm", "scale"), False, (d,))
    if not cfg.tie_embeddings:
        yield Tensor("lm_head.weight", ("lm_head",), False, (v, d))


def hf_shape(t: Tensor) -> tuple[int, ...]:
    return t.shape[::-1] if t.transposed else t.shape


def index(model_dir: Path) -> dict[str, safetensors.TensorRef]:
    """Every tensor of the checkpoint in ``model_dir`` (one file or shards named by the index),
    with each shard checked for presence and truncation. Pickled weights are refused."""
    model_dir = Path(model_dir)
    if (model_dir / INDEX_FILE).exists():
        try:
            weight_map = json.loads((model_dir / INDEX_FILE).read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UnsupportedModel(f"{model_dir / INDEX_FILE} has no readable weight_map ({e})") from None
        files = sorted(set(weight_map.values()))
    elif (model_dir / SINGLE_FILE).exists():
        weight_map, files = None, [SINGLE_FILE]
    else:
        pickled = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(p.name for p in model_dir.glob("*.pt*"))
        why = f"; {', '.join(pickled)} are pickles, which fibjax never loads (convert them to safetensors)" if pickled else ""
        raise UnsupportedModel(f"{model_dir} has no {SINGLE_FILE} or {INDEX_FILE}{why}")
    refs: dict[str, safetensors.TensorRef] = {}
    for name in files:
        try:
            shard = safetensors.read_header(model_dir / name)
        except safetensors.SafetensorsError as e:
            raise UnsupportedModel(str(e)) from None
        twice = sorted(shard.keys() & refs.keys())
        if twice:
            raise UnsupportedModel(f"tensor {twice[0]!r} is stored twice, in {refs[twice[0]].file.name} and {name}: which one is the model's is unknowable")
        refs.update(shard)
    if weight_map is not None:
        missing = sorted(n for n, f in weight_map.items() if n not in refs)
        if missing:
            raise UnsupportedModel(f"{model_dir / INDEX_FILE} names {len(missing)} tensor(s) its shards lack, e.g. {missing[0]!r}")
        moved = sorted(n for n, f in weight_map.items() if refs[n].file.name != f)
        if moved:
            n = moved[0]
            raise UnsupportedModel(f"{model_dir / INDEX_FILE} puts tensor {n!r} in {weight_map[n]}, but it is in {refs[n].file.name}")
    return refs


def check(cfg: ModelConfig, refs: dict[str, safetensors.TensorRef]) -> np.dtype:
    """Every tensor ``cfg`` needs is present with its shape, nothing else is, and all share one
    dtype (returned); UnsupportedModel naming the first problem."""
    expected = {t.hf_name: t for t in tensors(cfg)}
    for name, t in expected.items():
        if name not in refs:
            raise UnsupportedModel(f"the checkpoint lacks tensor {name!r}, which config.json implies")
        if refs[name].shape != hf_shape(t):
            raise UnsupportedModel(f"tensor {name!r} has shape {refs[name].shape}; config.json implies {hf_shape(t)}")
    tied_copy = {"lm_head.weight"} if cfg.tie_embeddings else set()  # some tied checkpoints store the table twice (check_tied)
    extra = sorted(n for n in refs if n not in expected and n not in tied_copy and not n.endswith(IGNORED_SUFFIXES))
    if extra:
        raise UnsupportedModel(f"the checkpoint has {len(extra)} tensor(s) fibjax's model lacks, e.g. {extra[0]!r}: another architecture than config.json says")
    dtypes = {refs[n].dtype for n in expected}
    if len(dtypes) > 1:
        raise UnsupportedModel(f"the checkpoint mixes dtypes {sorted(str(d) for d in dtypes)}; fibjax expects one")
    (dtype,) = dtypes
    if dtype.name not in ("float32", "bfloat16", "float16"):
        raise UnsupportedModel(f"the checkpoint's tensors are {dtype}; supported: float32, bfloat16, float16")
    return dtype


def _equal(a: safetensors.TensorRef, b: safetensors.TensorRef) -> bool:
    """Bit for bit, a slab of rows at a time (an embedding table can be gigabytes)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    rows = max(1, TIE_CHUNK_BYTES * a.shape[0] // max(1, a.nbytes))
    a_map, b_map = a.map(), b.map()
    return all(np.array_equal(a_map[i : i + rows], b_map[i : i + rows], equal_nan=True) for i in range(0, a.shape[0], rows))


def check_tied(cfg: ModelConfig, refs: dict[str, safetensors.TensorRef]) -> None:
    """A tied model whose checkpoint also stores ``lm_head.weight`` must store the embedding table
    there again, bit for bit. transformers' versions resolve a *different* stored head in
    different ways (kept by some, overwritten by ``tie_weights`` in others), so which model the
    checkpoint means is unknowable: refused by name, with both ways out."""
    if cfg.tie_embeddings and "lm_head.weight" in refs and not _equal(refs["lm_head.weight"], refs["model.embed_tokens.weight"]):
        raise UnsupportedModel(
            "config.json says tie_word_embeddings: true, but the checkpoint's 'lm_head.weight' differs from 'model.embed_tokens.weight' "
            "(transformers versions disagree on which one the model uses): set tie_word_embeddings to false in config.json to use the "
            "stored lm_head.weight, or delete lm_head.weight from the checkpoint to tie it to the embeddings"
        )
