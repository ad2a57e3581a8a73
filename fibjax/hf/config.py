"""Hugging Face ``config.json`` of the Llama family <-> fibjax's :class:`ModelConfig`.

Only JSON is read: nothing from a model directory is ever imported or executed. Every field that
changes the function is mapped (sizes, GQA, head dim, RoPE theta and scaling, norm epsilon, q/k/v
biases, tied embeddings); a field fibjax cannot represent exactly is refused by name
(:class:`UnsupportedModel`), before anything is written. Both layouts of RoPE are read:
``rope_theta`` + ``rope_scaling`` (transformers 4) and ``rope_parameters`` (transformers 5).
"""

from __future__ import annotations

import json
from pathlib import Path

from fibjax.config import ModelConfig
from fibjax.errors import FibjaxError

# model_type -> whether its attention has q/k/v biases (Qwen2's do, always)
FAMILY = {"llama": False, "mistral": False, "qwen2": True}
# fields whose presence with another value changes the function: field -> the value fibjax supports
MUST_BE = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}


class UnsupportedModel(FibjaxError, ValueError):
    """The model directory holds an architecture (or a file) fibjax cannot load exactly."""


def read_json(path: Path) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UnsupportedModel(f"{path} is missing") from None
    except (OSError, ValueError) as e:
        raise UnsupportedModel(f"{path} is not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise UnsupportedModel(f"{path} holds no JSON object")
    return data


def rope_of(hf: dict) -> tuple[float, dict]:
    """(theta, the scaling dict or {}) from either config layout."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict):
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        if scaling.get("rope_type", "default") == "default":
            scaling = {}
        return float(params.get("rope_theta", hf.get("rope_theta", 10000.0))), scaling
    return float(hf.get("rope_theta", 10000.0)), dict(hf.get("rope_scaling") or {})


def _rope_fields(hf: dict) -> dict:
    theta, scaling = rope_of(hf)
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if not scaling:
        return {"rope_theta": theta}
    if rope_type == "linear":
        return {"rope_theta": theta, "rope_scaling": "linear", "rope_factor": float(scaling["factor"])}
    if rope_type == "llama3":
        return {
            "rope_theta": theta,
            "rope_scaling": "llama3",
            "rope_factor": float(scaling["factor"]),
            "rope_original_len": int(scaling["original_max_position_embeddings"]),
            "rope_low_freq_factor": float(scaling["low_freq_factor"]),
            "rope_high_freq_factor": float(scaling["high_freq_factor"]),
        }
    raise UnsupportedModel(f"config.json: rope_scaling type {rope_type!r} is not supported (supported: none, linear, llama3)")


def model_config(hf: dict, dtype: str = "float32", param_dtype: str = "float32") -> ModelConfig:
    """The ModelConfig computing what ``hf`` (a parsed config.json) computes; UnsupportedModel
    naming the first field that stands in the way."""
    model_type = hf.get("model_type")
    if model_type not in FAMILY:
        raise UnsupportedModel(f"config.json: model_type {model_type!r} is not supported (supported: {', '.join(FAMILY)})")
    for name, value in MUST_BE.items():
        if name in hf and hf[name] != value:
            raise UnsupportedModel(f"config.json: {name}={hf[name]!r} is not supported (fibjax's layers need {value!r})")
    if hf.get("sliding_window") is not None and (model_type == "mistral" or hf.get("use_sliding_window")):
        raise UnsupportedModel(f"config.json: sliding_window={hf['sliding_window']} (sliding-window attention) is not supported: only full attention")
    if any(t != "full_attention" for t in hf.get("layer_types") or []):
        raise UnsupportedModel(f"config.json: layer_types {sorted(set(hf['layer_types']))} is not supported; only full_attention layers")
    heads = int(hf["num_attention_heads"])
    d_model = int(hf["hidden_size"])
    try:
        return ModelConfig(
            vocab_size=int(hf["vocab_size"]),
            d_model=d_model,
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or d_model // heads),
            mlp_hidden=int(hf["intermediate_size"]),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            qkv_bias=FAMILY[model_type],
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            dtype=dtype,
            param_dtype=param_dtype,
            **_rope_fields(hf),
        )
    except KeyError as e:
        raise UnsupportedModel(f"config.json: the field {e.args[0]!r} is missing") from None


def hf_config(cfg: ModelConfig, model_type: str, max_position_embeddings: int, extra: dict | None = None) -> dict:
    """A config.json for ``cfg`` (transformers 4's RoPE layout, which transformers 5 also reads)."""
    if cfg.qkv_bias != FAMILY[model_type]:
        raise UnsupportedModel(f"{model_type} has {'' if FAMILY[model_type] else 'no '}q/k/v biases; this model has{'' if cfg.qkv_bias else ' none'}")
    if cfg.rope_scaling not in ("none", "linear", "llama3"):
        raise UnsupportedModel(f"rope_scaling {cfg.rope_scaling!r} has no Hugging Face equivalent here (none, linear, llama3)")
    scaling = None
    if cfg.rope_scaling == "linear":
        scaling = {"rope_type": "linear", "factor": cfg.rope_factor}
    elif cfg.rope_scaling == "llama3":
        scaling = {
            "rope_type": "llama3",
            "factor": cfg.rope_factor,
            "original_max_position_embeddings": cfg.rope_original_len,
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
        }
    out = {
        "architectures": [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}[model_type]],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.resolved_mlp_hidden,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.resolved_head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": scaling,
        "tie_word_embeddings": cfg.tie_embeddings,
        "max_position_embeddings": max_position_embeddings,
        "torch_dtype": cfg.param_dtype,
    }
    if model_type == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    if model_type in ("mistral", "qwen2"):
        out.update(sliding_window=None, use_sliding_window=False)
    return {**out, **(extra or {})}
