"""A value as leaves and the text of its structure, and back: what a point-to-point
transfer carries (a pytree of tensors, None, bool, int, float and str) and what both
ends of it, the pipeline transport and the process backend's p2p, take apart and put
together.

Invariants:
- ``unflatten(*flatten(tree))`` rebuilds ``tree`` (its leaves in their place); the text
  is torch's ``treespec_dumps``, so both ends of a transfer read it alike.
- A tensor and a flat tuple of tensors (a stage's usual output and input gradients)
  skip the pytree walk: these run on every pipeline hop, on a cache the stage's compute
  left cold.
- A leaf that is no tensor travels as it is, and only as one of the values
  :func:`check_value` takes.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from shardwise.sharding.errors import CollectiveError

__all__ = ["check_value", "flatten", "is_tensor_leaf", "spec_of", "spec_text", "unflatten"]

_LEAF_VALUES = (type(None), bool, int, float, str)

_SPECS: dict[Any, str] = {}   # TreeSpec -> its JSON (a step repeats a few structures)


def spec_text(spec: Any) -> str:
    """``treespec_dumps(spec)``, cached (a TreeSpec's hash costs far less than its
    dump)."""
    text = _SPECS.get(spec)
    if text is None:
        if len(_SPECS) > 256:
            _SPECS.clear()
        text = _SPECS[spec] = pytree.treespec_dumps(spec)
    return text


@functools.lru_cache(maxsize=256)
def spec_of(text: str) -> Any:
    """The TreeSpec of :func:`spec_text`'s text (cached)."""
    return pytree.treespec_loads(text)


def is_tensor_leaf(x: Any) -> bool:
    """A tensor that the pytree walk keeps as one leaf (not a subclass registered as a
    node)."""
    return isinstance(x, torch.Tensor) and type(x) not in pytree.SUPPORTED_NODES


_LEAF_TEXT = pytree.treespec_dumps(pytree.tree_flatten(0)[1])
_TUPLE_TEXTS: dict[int, str] = {}    # n -> the text of a tuple of n leaves
_TUPLE_SIZES: dict[str, int] = {}    # and back


def flatten(tree: Any) -> tuple[list[Any], str]:
    """``tree``'s leaves and its structure as :func:`spec_text` writes it. A tensor and a
    flat tuple of tensors (a stage's usual output and input gradients) skip the pytree
    walk, which is Python on a hop's cold cache.

    >>> leaves, text = flatten((torch.ones(1), torch.zeros(2)))
    >>> len(leaves), unflatten(leaves, text)[1].shape
    (2, torch.Size([2]))
    >>> unflatten(*flatten({"x": [1, None]}))
    {'x': [1, None]}
    """
    if is_tensor_leaf(tree):
        return [tree], _LEAF_TEXT
    if type(tree) is tuple and all(map(is_tensor_leaf, tree)):
        n = len(tree)
        text = _TUPLE_TEXTS.get(n)
        if text is None:
            text = _TUPLE_TEXTS[n] = pytree.treespec_dumps(pytree.tree_flatten(tree)[1])
            _TUPLE_SIZES[text] = n
        return list(tree), text
    leaves, spec = pytree.tree_flatten(tree)
    return leaves, spec_text(spec)


def unflatten(leaves: Sequence[Any], text: str) -> Any:
    """The tree of :func:`flatten`'s ``(leaves, text)`` (any leaves in their place)."""
    if text == _LEAF_TEXT:
        return leaves[0]
    n = _TUPLE_SIZES.get(text)
    if n is None:
        spec = spec_of(text)
        if not (spec.type is tuple and all(c.is_leaf() for c in spec.children())):
            return pytree.tree_unflatten(list(leaves), spec)
        n = _TUPLE_SIZES[text] = spec.num_children   # (a tuple of leaves: known now)
    if len(leaves) != n:
        return pytree.tree_unflatten(list(leaves), spec_of(text))  # (raises, naming both)
    return tuple(leaves)


def check_value(x: Any, who: str) -> None:
    """Refuse a leaf that is neither a tensor nor a value a transfer carries as it is
    (None, bool, int, float, str), naming ``who`` sends it.

    >>> check_value(2.5, "send")
    >>> check_value(object(), "send")
    Traceback (most recent call last):
    ...
    shardwise.sharding.errors.CollectiveError: send: cannot send a leaf of type object ...
    """
    if not isinstance(x, _LEAF_VALUES):
        raise CollectiveError(
            f"{who}: cannot send a leaf of type {type(x).__name__} ({x!r:.60}); a value "
            "must be a tree (tuple, list, dict) of tensors, None, bool, int, float or str.")
