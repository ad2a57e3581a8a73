"""Hugging Face tensors onto a device mesh as fibjax parameters, and back.

Import maps each tensor of the checkpoint (``safetensors.TensorRef.map``: no bytes read yet) and
builds its ``jax.Array`` with ``jax.make_array_from_callback``, which asks for each device's
slice of the (transposed) map under the parameter's ``NamedSharding``: only those slices are read
and converted, one tensor at a time, so host memory holds the placed model and one tensor's
slices, never the model twice.
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
        array = jax.make_array_from_callback(t.shape, _get(shardings, t.path), lambda idx, view=view: np.asarray(view[idx]).astype(dtype, copy=False))
        _set(params, t.path, array)
        del view  # the map is closed once the last slice is read
    filled = {path for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]}
    shapes = jax.tree_util.tree_flatten_with_path(wanted, is_leaf=lambda x: isinstance(x, tuple))[0]
    missing = [path for path, _ in shapes if path not in filled]
    if missing:
        raise ValueError(f"fibjax's model has parameters no Hugging Face tensor fills: {missing[:3]} (only dense models import)")
    return params


def hf_tensors(cfg: ModelConfig, params: dict, dtype: np.dtype) -> Iterator[tuple[str, np.dtype, tuple[int, ...], callable]]:
    """``(name, dtype, shape, fetch)`` for ``safetensors.write``: each fetch copies one parameter
    to the host (transposed back to [out, in] where Hugging Face stores it so)."""

    def fetch(t: Tensor):
        array = np.asarray(jax.device_get(_get(params, t.path)))
        return (array.T if t.transposed else array).astype(dtype)

    for t in tensors(cfg):
        yield t.hf_name, np.dtype(dtype), hf_shape(t), lambda t=t: fetch(t)
