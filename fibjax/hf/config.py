"""Hugging Face ``config.json`` of the Llama family <-> fibjax's [ModelConfig][fibjax.config.ModelConfig].

Only JSON is read: nothing from a model directory is ever imported or executed. Every field that
changes the function is mapped (sizes, GQA, head dim, RoPE theta and scaling, norm epsilon, q/k/v
biases, tied embeddings), and the attention a fibjax export recorded (``fibjax_attention``); a
field fibjax cannot represent exactly is refused by name ([UnsupportedModel][fibjax.hf.UnsupportedModel]), before
anything is written, and so is a field the import reads that is missing or of the wrong type
(``FIELDS``). Both layouts of RoPE are read: ``rope_theta`` + ``rope_scaling`` (transformers 4)
and ``rope_parameters`` (transformers 5), ``rope_type: default`` meaning no scaling in both.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from fibjax.config import AttentionConfig, ConfigError, ModelConfig, from_dict
from fibjax.errors import FibjaxError
from fibjax.kinds import registry

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


def _positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _positive_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


_KINDS = {
    "int": (_positive_int, "a positive integer"),
    "number": (_positive_number, "a positive number"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "object": (lambda v: isinstance(v, dict), "a JSON object"),
    "names": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of strings"),
}
# every config.json field the import reads: (kind, required). null counts as absent (transformers
# writes null for "not set"); an absent optional field takes transformers' default
FIELDS = {
    "vocab_size": ("int", True),
    "hidden_size": ("int", True),
    "intermediate_size": ("int", True),
    "num_hidden_layers": ("int", True),
    "num_attention_heads": ("int", True),
    "num_key_value_heads": ("int", False),
    "head_dim": ("int", False),
    "max_position_embeddings": ("int", False),
    "rms_norm_eps": ("number", False),
    "rope_theta": ("number", False),
    "tie_word_embeddings": ("bool", False),
    "use_sliding_window": ("bool", False),
    "rope_scaling": ("object", False),
    "rope_parameters": ("object", False),
    "layer_types": ("names", False),
    "fibjax_attention": ("object", False),
}
# the fields of each RoPE scaling type, inside rope_scaling (or rope_parameters)
ROPE_FIELDS = {
    "linear": {"factor": "number"},
    "llama3": {"factor": "number", "original_max_position_embeddings": "int", "low_freq_factor": "number", "high_freq_factor": "number"},
}


def _check(where: dict, name: str, kind: str, required: bool, prefix: str = "") -> None:
    ok, what = _KINDS[kind]
    value = where.get(name)
    if value is None:
        if required:
            raise UnsupportedModel(f"config.json: the field '{prefix}{name}' is missing ({what}; the import needs it)")
    elif not ok(value):
        raise UnsupportedModel(f"config.json: {prefix}{name}={value!r} is not {what}")


def check_fields(hf: dict) -> None:
    """Every field the import reads is present where required and of its type; UnsupportedModel
    naming the first that is not."""
    for name, (kind, required) in FIELDS.items():
        _check(hf, name, kind, required)
    params = hf.get("rope_parameters") or {}
    _check(params, "rope_theta", "number", False, "rope_parameters.")


def rope_of(hf: dict) -> tuple[float, dict]:
    """(theta, the scaling dict or {}) from either config layout; ``rope_type: default`` (no
    scaling, as transformers writes it) is {} in both."""
    params = hf.get("rope_parameters")
    if params:
        theta, scaling = params.get("rope_theta", hf.get("rope_theta")), {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta, scaling = hf.get("rope_theta"), dict(hf.get("rope_scaling") or {})
    if scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = {}
    return float(10000.0 if theta is None else theta), scaling


def _rope_fields(hf: dict) -> dict:
    theta, scaling = rope_of(hf)
    if not scaling:
        return {"rope_theta": theta}
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type not in ROPE_FIELDS:
        raise UnsupportedModel(f"config.json: rope_scaling type {rope_type!r} is not supported (supported: none, linear, llama3)")
    for name, kind in ROPE_FIELDS[rope_type].items():
        _check(scaling, name, kind, True, "rope_scaling.")
    if rope_type == "linear":
        return {"rope_theta": theta, "rope_scaling": "linear", "rope_factor": float(scaling["factor"])}
    return {
        "rope_theta": theta,
        "rope_scaling": "llama3",
        "rope_factor": float(scaling["factor"]),
        "rope_original_len": scaling["original_max_position_embeddings"],
        "rope_low_freq_factor": float(scaling["low_freq_factor"]),
        "rope_high_freq_factor": float(scaling["high_freq_factor"]),
    }


def attention_of(hf: dict) -> AttentionConfig:
    """The attention a fibjax export recorded in ``fibjax_attention`` (an exported Fibonacci model
    imports as one), else dense. Its ``ssa`` flag says how the weights were trained, not what
    the model computes, so it is not part of the model."""
    fields = {k: v for k, v in (hf.get("fibjax_attention") or {}).items() if k != "ssa"}
    try:
        return from_dict(AttentionConfig, fields, "fibjax_attention")
    except ConfigError as e:
        raise UnsupportedModel(f"config.json: {e}; remove fibjax_attention to import the weights as a dense model") from None


def sliding_window(hf: dict, model_type: str) -> int | None:
    """transformers' sliding window W when every layer uses it (query i attends keys j with
    0 <= i - j < W: ``masking_utils.sliding_window_overlay``), None for full attention; a model
    whose layers mix the two is refused by name. Mistral slides whenever ``sliding_window`` is
    set; Qwen2 only with ``use_sliding_window``, and then in the layers from ``max_window_layers``
    on, so it imports only when that is every layer; ``layer_types`` (transformers 5) says it per
    layer."""
    w = hf.get("sliding_window")
    types = set(hf.get("layer_types") or [])
    if types - {"full_attention", "sliding_attention"}:
        raise UnsupportedModel(f"config.json: layer_types {sorted(types)} is not supported; only full_attention and sliding_attention layers")
    if types:
        slides = types == {"sliding_attention"}
        if len(types) > 1:
            raise UnsupportedModel(f"config.json: layer_types mixes {sorted(types)}; fibjax runs one attention in every layer")
    elif model_type == "qwen2" and hf.get("use_sliding_window") and w is not None:
        first = hf.get("max_window_layers", 0)
        if 0 < first < hf["num_hidden_layers"]:
            raise UnsupportedModel(
                f"config.json: use_sliding_window with max_window_layers={first} slides in layers {first}.. only; fibjax runs one attention in every layer"
            )
        slides = first == 0
    else:
        slides = model_type == "mistral"
    if not slides or w is None:
        return None
    if not _positive_int(w):
        raise UnsupportedModel(f"config.json: sliding_window={w!r} is not a positive integer")
    return w


def model_config(hf: dict, dtype: str = "float32", param_dtype: str = "float32") -> ModelConfig:
    """The ModelConfig computing what ``hf`` (a parsed config.json) computes; UnsupportedModel
    naming the first field that stands in the way.

    Args:
        hf: The parsed config.json.
        dtype: The compute dtype.
        param_dtype: The parameters' dtype.

    Returns:
        The ModelConfig.

    Raises:
        UnsupportedModel: A model type or field fibjax's layers cannot compute.
    """
    model_type = hf.get("model_type")
    if model_type not in FAMILY:
        raise UnsupportedModel(f"config.json: model_type {model_type!r} is not supported (supported: {', '.join(FAMILY)})")
    for name, value in MUST_BE.items():
        if name in hf and hf[name] != value:
            raise UnsupportedModel(f"config.json: {name}={hf[name]!r} is not supported (fibjax's layers need {value!r})")
    check_fields(hf)
    window, attention = sliding_window(hf, model_type), attention_of(hf)
    if window is not None:
        slid = AttentionConfig(kind=registry.SLIDING_WINDOW, window=window)
        if hf.get("fibjax_attention") and attention != slid:
            raise UnsupportedModel(f"config.json: sliding_window={window} and fibjax_attention (kind {attention.kind}) name different attentions; remove one")
        attention = slid
    heads, d_model = hf["num_attention_heads"], hf["hidden_size"]
    try:
        return ModelConfig(
            vocab_size=hf["vocab_size"],
            d_model=d_model,
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or d_model // heads,
            mlp_hidden=hf["intermediate_size"],
            norm_eps=float(hf.get("rms_norm_eps") or 1e-6),
            qkv_bias=FAMILY[model_type],
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention=attention,
            dtype=dtype,
            param_dtype=param_dtype,
            **_rope_fields(hf),
        )
    except ConfigError as e:
        raise UnsupportedModel(f"config.json describes no model fibjax can build: {e}") from None


def transformers_window(cfg: ModelConfig, model_type: str) -> int | None:
    """The sliding window transformers runs for ``cfg`` exported as ``model_type`` (Mistral and
    Qwen2 have one, Llama not), None when the model is not a sliding window."""
    if cfg.attention.kind == registry.SLIDING_WINDOW and model_type in ("mistral", "qwen2"):
        return cfg.attention.window
    return None


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
        window = transformers_window(cfg, model_type)
        out.update(sliding_window=window, use_sliding_window=window is not None)
        if model_type == "qwen2" and window is not None:
            out.update(max_window_layers=0)  # from layer 0 on: every layer slides
    return {**out, **(extra or {})}
