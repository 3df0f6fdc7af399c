"""Parameter trees as the weight mappings see them: nested dicts of numpy arrays.

A jmegatron parameter tree is the ``params`` collection of
:class:`jmegatron.models.gpt.GPTModel` (after ``flax.linen.meta.unbox``; a ``{"params": ...}``
wrapper and still-boxed ``LogicallyPartitioned`` leaves are accepted), per-layer
(``decoder_layers_{i}``) or stacked for ``scan_layers`` (one ``decoder_layers`` subtree whose
leaves carry a leading ``[num_layers]`` axis). Leaves may be numpy or jax arrays or torch
tensors (read without importing torch). Imports numpy only.
"""

from __future__ import annotations

import re
from typing import Mapping

import numpy as np

_LAYER_RE = re.compile(r"^decoder_layers_(\d+)$")


def to_numpy(x) -> np.ndarray:
    """numpy view of a numpy/jax array or torch tensor (bfloat16 torch tensors -> float32)."""
    if hasattr(x, "unbox") and not hasattr(x, "shape"):  # flax LogicallyPartitioned / Partitioned
        x = x.unbox()
    if hasattr(x, "detach"):  # torch.Tensor, without importing torch
        t = x.detach().cpu()
        if str(t.dtype) == "torch.bfloat16":
            t = t.float()
        return t.numpy()
    return np.asarray(x)


def plain(tree) -> dict:
    """Nested Mapping (dict / FrozenDict, possibly ``{"params": ...}``) -> nested dict of numpy."""
    if isinstance(tree, Mapping) and set(tree.keys()) == {"params"}:
        tree = tree["params"]
    if isinstance(tree, Mapping):
        return {k: numpy_tree(v) for k, v in tree.items()}
    raise TypeError(f"expected a nested mapping of parameters, got {type(tree).__name__}")


def numpy_tree(node):
    """``node`` with every leaf as numpy (:func:`to_numpy`); nested Mappings become dicts."""
    if isinstance(node, Mapping):
        return {k: numpy_tree(v) for k, v in node.items()}
    return to_numpy(node)


def map_leaves(fn, tree):
    """``fn`` applied to every leaf of a nested Mapping, as a nested dict of the same keys."""
    if isinstance(tree, Mapping):
        return {k: map_leaves(fn, v) for k, v in tree.items()}
    return fn(tree)


def _layer_keys(params: Mapping) -> list[str]:
    """The ``decoder_layers_{i}`` keys of ``params``, by ``i``."""
    return sorted((k for k in params if _LAYER_RE.match(k)), key=lambda k: int(_LAYER_RE.match(k)[1]))


def stack_layers(params: Mapping, num_layers: int) -> dict:
    """Per-layer layout -> ``scan_layers`` layout.

    ``decoder_layers_0 .. decoder_layers_{n-1}`` (identical subtrees) become one
    ``decoder_layers`` subtree with each leaf ``np.stack``-ed on a new leading
    ``[num_layers]`` axis; other entries are kept. Leaves come back as numpy arrays of
    the input dtype. Raises ValueError if the layer subtrees are missing or extra.
    """
    params = plain(params)
    keys = _layer_keys(params)
    if keys != [f"decoder_layers_{i}" for i in range(num_layers)]:
        raise ValueError(f"stack_layers expected decoder_layers_0..decoder_layers_{num_layers - 1}, "
                         f"found {keys or 'none'}" + (" (already stacked?)" if "decoder_layers" in params else ""))
    layers = [params[k] for k in keys]

    def stack(*leaves):
        return np.stack(leaves, axis=0)

    out = {k: v for k, v in params.items() if k not in keys}
    out["decoder_layers"] = _tree_multimap(stack, layers)
    return out


def _tree_multimap(fn, trees: list, path: str = ""):
    """``fn`` over the matching leaves of nested Mappings of the same keys (ValueError where they differ)."""
    first = trees[0]
    if isinstance(first, Mapping):
        for t in trees[1:]:
            if not isinstance(t, Mapping) or set(t) != set(first):
                raise ValueError(f"layer subtrees differ at {path or '<root>'}")
        return {k: _tree_multimap(fn, [t[k] for t in trees], f"{path}/{k}") for k in first}
    return fn(*trees)


def unstack_layers(params: Mapping, num_layers: int) -> dict:
    """``scan_layers`` layout -> per-layer layout (the inverse of :func:`stack_layers`).

    Each leaf of ``decoder_layers`` must have a leading axis of length ``num_layers``;
    layer ``i`` becomes ``decoder_layers_{i}``. Raises ValueError otherwise.
    """
    params = plain(params)
    if "decoder_layers" not in params:
        raise ValueError("unstack_layers expected a stacked 'decoder_layers' subtree "
                         f"(found {_layer_keys(params) or 'none'})")

    def check(a):
        if a.ndim == 0 or a.shape[0] != num_layers:
            raise ValueError(f"stacked layer leaf has shape {a.shape}, expected leading axis {num_layers}")
        return a

    stacked = map_leaves(check, params["decoder_layers"])
    out = {k: v for k, v in params.items() if k != "decoder_layers"}
    for i in range(num_layers):
        out[f"decoder_layers_{i}"] = map_leaves(lambda a, i=i: a[i], stacked)
    return out


def get(tree: Mapping, path: str, cfg) -> np.ndarray:
    """The entry of ``tree`` at the ``/``-separated ``path``. Raises ValueError naming ``path``
    and the config fields that decide the parameters' structure (``cfg``: a
    :class:`jmegatron.config.JMegatronConfig`) when it is absent."""
    node = tree
    for part in path.split("/"):
        if not isinstance(node, Mapping) or part not in node:
            raise ValueError(
                f"params have no {path!r}: they do not match the config (num_layers={cfg.num_layers}, "
                f"normalization={cfg.normalization!r}, add_bias_linear={cfg.add_bias_linear}, "
                f"untie_embeddings_and_output_weights={cfg.untie_embeddings_and_output_weights})")
        node = node[part]
    return node


def check_shape(name: str, a: np.ndarray, shape: tuple) -> np.ndarray:
    """``a`` unchanged when its shape is ``shape``; else ValueError naming ``name``, the
    shape found and the one the config expects."""
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(a.shape)}, expected {tuple(shape)} from the config")
    return a
