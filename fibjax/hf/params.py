"""Hugging Face tensors onto a device mesh as fibjax parameters, and back.

Import maps each tensor of the checkpoint (``safetensors.TensorRef.map``: no bytes read yet) and
builds its ``jax.Array`` with ``jax.make_array_from_callback``, which asks for each device's
slice of the (transposed) map under the parameter's ``NamedSharding``: only those slices are read
and converted, one tensor at a time, so host memory holds the placed model and one tensor's
slices, never the model twice. Each slice is checked as it is read: a NaN or infinity is refused
naming its tensor.
"""

from __future__ import annotations

from collections.abc import Iterator

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from fibjax import sharding
from fibjax.config import ModelConfig
from fibjax.hf import safetensors
from fibjax.hf.config import UnsupportedModel
from fibjax.hf.weights import Tensor, hf_shape, tensors


def abstract_params(cfg: ModelConfig) -> nnx.State:
    from fibjax.model import Transformer

    return nnx.state(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))), nnx.Param)


def _get(tree: dict, path: tuple):
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def unfilled(cfg: ModelConfig, abstract: nnx.State | None = None) -> list[str]:
    """The parameters of a model of ``cfg`` that no Hugging Face tensor fills (a learned alpha,
    NSA's gates: the attention's own), as "a/b/c" paths; [] for every model an import can build."""
    filled = {t.path for t in tensors(cfg)}
    flat = nnx.to_flat_state(abstract if abstract is not None else abstract_params(cfg))
    return ["/".join(str(k) for k in path) for path, _ in flat if tuple(path) not in filled]


def _finite(t: Tensor, chunk: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``chunk`` in ``dtype``, refused if it holds a NaN or an infinity: every later command would
    call the run's own checkpoint damaged, so the import names the tensor instead."""
    bad = int(np.count_nonzero(~np.isfinite(chunk)))
    if bad:
        raise UnsupportedModel(f"tensor {t.hf_name!r} holds {bad:,} NaN or infinite value(s): the checkpoint is damaged (fibjax imports finite weights only)")
    return chunk.astype(dtype, copy=False)


def place(cfg: ModelConfig, refs: dict[str, safetensors.TensorRef], mesh: Mesh) -> dict:
    """The parameters (pure dict of jax.Arrays in ``cfg.param_dtype``) of a dense model of ``cfg``
    from the checked tensors ``refs`` (``weights.check``), each sharded on ``mesh`` by its logical axes."""
    abstract = abstract_params(cfg)
    shardings = sharding.param_shardings(abstract, mesh)
    wanted = jax.tree.map(lambda x: x.shape, nnx.to_pure_dict(abstract))
    params: dict = {}
    dtype = np.dtype(cfg.param_dtype)
    for t in tensors(cfg):
        view = refs[t.hf_name].map()
        view = view.T if t.transposed else view
        assert _get(wanted, t.path) == t.shape, (t, _get(wanted, t.path))
        array = jax.make_array_from_callback(t.shape, _get(shardings, t.path), lambda idx, view=view, t=t: _finite(t, np.asarray(view[idx]), dtype))
        _set(params, t.path, array)
        del view  # the map is closed once the last slice is read
    missing = unfilled(cfg, abstract)
    if missing:
        raise UnsupportedModel(
            f"fibjax's model has parameters no Hugging Face tensor fills, e.g. {missing[0]} (only models without parameters of their own attention import)"
        )
    return params


def hf_tensors(cfg: ModelConfig, params: dict, dtype: np.dtype) -> Iterator[tuple[str, np.dtype, tuple[int, ...], callable]]:
    """``(name, dtype, shape, fetch)`` for ``safetensors.write``: each fetch copies one parameter
    to the host (transposed back to [out, in] where Hugging Face stores it so)."""

    def fetch(t: Tensor):
        array = np.asarray(jax.device_get(_get(params, t.path)))
        return (array.T if t.transposed else array).astype(dtype)

    for t in tensors(cfg):
        yield t.hf_name, np.dtype(dtype), hf_shape(t), lambda t=t: fetch(t)
