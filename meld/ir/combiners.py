"""Reduction combiners: how partial results over a split range merge.

Each combiner is defined once here, as a numeric function on NumPy arrays. The frontend recognises a
captured TVM reducer by evaluating it against these on random values; the CPU reference executor uses
them to merge partials; the CUDA templates implement the same formula.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Combiner:
    name: str
    state: tuple[str, ...]  # names of the state components, e.g. ("m", "l", "acc")
    identity: tuple[float, ...]
    merge: Callable[..., tuple[np.ndarray, ...]]  # merge(*lhs_state, *rhs_state) -> state


def _online_softmax(m1, l1, a1, m2, l2, a2):
    """Merge two softmax partials: running max m, sum of exp(s - m) l, sum of exp(s - m) * v acc."""
    m = np.maximum(m1, m2)
    # exp(-inf - -inf) is NaN; an empty side (m = -inf) contributes weight 0.
    m1, l1, m2, l2 = (np.asarray(v, dtype=np.float64) for v in (m1, l1, m2, l2))
    w1 = np.where(m1 == -np.inf, 0.0, np.exp(m1 - np.where(m == -np.inf, 0.0, m)))
    w2 = np.where(m2 == -np.inf, 0.0, np.exp(m2 - np.where(m == -np.inf, 0.0, m)))
    a1, a2 = np.asarray(a1), np.asarray(a2)
    expand = (...,) + (None,) * (a1.ndim - np.ndim(w1))   # acc may carry trailing feature axes
    return m, l1 * w1 + l2 * w2, a1 * w1[expand] + a2 * w2[expand]


def _sum(a1, a2):
    return (a1 + a2,)


# "weighted_sum" merges exactly like "sum"; it differs in what the parts are: each part is
# weight_j * value_j, the weight applied to the part BEFORE the merge (MoE's combine: part j of token t is
# topk_weight[t, j] * expert_out[t, j, :]). The name tells codegen and the reference executor to scale.
COMBINERS: dict[str, Combiner] = {
    "online_softmax": Combiner("online_softmax", ("m", "l", "acc"), (-np.inf, 0.0, 0.0), _online_softmax),
    "sum": Combiner("sum", ("acc",), (0.0,), _sum),
    "weighted_sum": Combiner("weighted_sum", ("acc",), (0.0,), _sum),
}
