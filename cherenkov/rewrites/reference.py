"""Float64 reference semantics of index-notation terms, fused forms included.

Every value is a NumPy array with one dimension per axis name of the term (size 1 where
it does not vary), so broadcasting does the index bookkeeping. Fused forms evaluate the
way their kernels compute, not by their definition: the online-softmax fold and flash
attention stream over the key axis in blocks, combining partial ``(m, l, acc)`` states;
LayerNorm rows combine Welford partial statistics. Comparing these against the naive
graph checks each rewrite's identity numerically.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from cherenkov.graph.evaluate import round_to_dtype
from cherenkov.rewrites import terms as t
from cherenkov.rewrites.terms import Term

FOLD_BLOCK = 3  # keys per streaming step: small, so tests cross many block boundaries

Env = frozenset  # of (axis name, extent) pairs


def softmax_fold(s: np.ndarray, v: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The online-softmax fold over ``axis``: returns ``(m, l, acc)`` with
    ``m = max s``, ``l = Σ e^{s−m}``, ``acc = Σ e^{s−m}·v``, combined block by block."""
    shape = np.broadcast_shapes(s.shape, v.shape)
    s, v = np.broadcast_to(s, shape), np.broadcast_to(v, shape)
    reduced = list(shape)
    reduced[axis] = 1
    m = np.full(reduced, -np.inf)
    l = np.zeros(reduced)
    acc = np.zeros(reduced)
    for start in range(0, shape[axis], FOLD_BLOCK):
        block = [slice(None)] * len(shape)
        block[axis] = slice(start, start + FOLD_BLOCK)
        s_block, v_block = s[tuple(block)], v[tuple(block)]
        m_new = np.maximum(m, s_block.max(axis=axis, keepdims=True))
        live = np.isfinite(m_new)
        rescale = np.where(live, np.exp(np.where(live, m - m_new, 0.0)), 0.0)
        p = np.where(live, np.exp(s_block - np.where(live, m_new, 0.0)), 0.0)
        l = l * rescale + p.sum(axis=axis, keepdims=True)
        acc = acc * rescale + (p * v_block).sum(axis=axis, keepdims=True)
        m = m_new
    return m, l, acc


def welford(x: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """Mean and (biased) variance over ``axis``, merging block statistics (Chan et al.)."""
    count, mean, m2 = 0, 0.0, 0.0
    for start in range(0, x.shape[axis], FOLD_BLOCK):
        block = np.take(x, range(start, min(start + FOLD_BLOCK, x.shape[axis])), axis=axis)
        n_b = block.shape[axis]
        mean_b = block.mean(axis=axis, keepdims=True)
        m2_b = ((block - mean_b) ** 2).sum(axis=axis, keepdims=True)
        delta = mean_b - mean
        total = count + n_b
        mean = mean + delta * n_b / total
        m2 = m2 + m2_b + delta**2 * count * n_b / total
        count = total
    return mean, m2 / count


class _Evaluator:
    def __init__(self, inputs: Mapping[str, np.ndarray], names: list[str]) -> None:
        self.inputs = inputs
        self.position = {name: i for i, name in enumerate(names)}
        self.rank = len(names)
        self.memo: dict[tuple[Term, Env], np.ndarray] = {}

    def scalar(self, value: object) -> np.ndarray:
        return np.full((1,) * self.rank, value)

    def index(self, ix: Term, env: dict[str, int]) -> np.ndarray:
        head = ix[0]
        if head == "Ax":
            shape = [1] * self.rank
            shape[self.position[ix[1]]] = env[ix[1]]
            return np.arange(env[ix[1]]).reshape(shape)
        if head == "IxLit":
            return self.scalar(ix[1])
        if head == "IxAdd":
            return self.index(ix[1], env) + ix[2]
        if head == "IxDiv":
            return self.index(ix[1], env) // ix[2]
        if head == "IxMod":
            return self.index(ix[1], env) % ix[2]
        if head == "IxLin":
            return self.index(ix[1], env) * ix[2] + self.index(ix[3], env)
        raise ValueError(f"not an index term: {ix}")

    def along(self, value: np.ndarray, axis: str, extent: int) -> np.ndarray:
        shape = list(value.shape)
        shape[self.position[axis]] = extent
        return np.broadcast_to(value, shape)

    def value(self, term: Term, env: dict[str, int]) -> np.ndarray:
        key = (term, Env(env.items()))
        if key not in self.memo:
            self.memo[key] = self._value(term, env)
        return self.memo[key]

    def _value(self, term: Term, env: dict[str, int]) -> np.ndarray:
        head, args = term[0], term[1:]
        v = self.value
        match head:
            case "Tensor":
                array = self.inputs[args[0]]
                items = t.ix_items(args[1])
                if len(items) != array.ndim:
                    raise ValueError(f"{args[0]} has {array.ndim} axes but is indexed with {len(items)}")
                index = tuple(np.clip(self.index(ix, env), 0, size - 1) for ix, size in zip(items, array.shape))
                return array[index] if index else np.full((1,) * self.rank, array)
            case "Num" | "Flag":
                return self.scalar(args[0])
            case "Iota":
                return self.index(args[0], env).astype(np.float64)
            case "Cast":
                return round_to_dtype(np.asarray(v(args[1], env), dtype=np.float64), args[0])
            case "Exp2":
                return np.exp2(v(args[0], env))
            case "Exp":
                return np.exp(v(args[0], env))
            case "Log2":
                return np.log2(v(args[0], env))
            case "Sin":
                return np.sin(v(args[0], env))
            case "Sqrt":
                return np.sqrt(v(args[0], env))
            case "Recip":
                return 1.0 / v(args[0], env)
            case "Neg":
                return -v(args[0], env)
            case "Add":
                return v(args[0], env) + v(args[1], env)
            case "Mul":
                return v(args[0], env) * v(args[1], env)
            case "Mod":
                return np.mod(v(args[0], env), v(args[1], env))
            case "Lt":
                return v(args[0], env) < v(args[1], env)
            case "Maximum":
                return np.maximum(v(args[0], env), v(args[1], env))
            case "Where":
                return np.where(v(args[0], env), v(args[1], env), v(args[2], env))
            case "PadAxis":
                ix, lo, size, fill, body = args
                position = self.index(ix, env)
                return np.where((position >= lo) & (position < lo + size), v(body, env), fill)
            case "Sum" | "Max" | "Contract":
                axis, extent = args[0], args[1]
                inner = {**env, axis: extent}
                body = v(args[2], inner) if head != "Contract" else v(args[2], inner) * v(args[3], inner)
                body = self.along(body, axis, extent)
                reduce = np.max if head == "Max" else np.sum
                return reduce(body, axis=self.position[axis], keepdims=True)
            case "SoftmaxFoldL" | "SoftmaxFoldAcc" | "OnlineSoftmaxContract":
                axis, extent = args[0], args[1]
                inner = {**env, axis: extent}
                scores = self.along(v(args[2], inner), axis, extent)
                values = v(args[3], inner) if head != "SoftmaxFoldL" else self.scalar(1.0)
                _, l, acc = softmax_fold(scores, values, self.position[axis])
                return {"SoftmaxFoldL": l, "SoftmaxFoldAcc": acc}.get(head, acc / l)
            case "FlashAttention":
                return self._flash(args, env)
            case "SoftmaxRow":
                axis, extent, scores = args
                s = self.along(v(scores, {**env, axis: extent}), axis, extent)
                m, l, _ = softmax_fold(s, self.scalar(1.0), self.position[axis])
                return np.exp(s - m) / l
            case "RmsNormRow":
                axis, extent, x, eps = args
                xv = self.along(v(x, {**env, axis: extent}), axis, extent)
                return xv / np.sqrt((xv * xv).mean(axis=self.position[axis], keepdims=True) + eps)
            case "LayerNormRow":
                axis, extent, x, eps = args
                xv = self.along(v(x, {**env, axis: extent}), axis, extent)
                mean, variance = welford(xv, self.position[axis])
                return (xv - mean) / np.sqrt(variance + eps)
            case "Scheduled":
                return v(args[0], env)
        raise ValueError(f"no reference semantics for {head}")

    def _flash(self, args: tuple, env: dict[str, int]) -> np.ndarray:
        key, n_keys, dim, n_dim, q, k, v, scale, mask = args
        over_keys = {**env, key: n_keys}
        over_both = {**over_keys, dim: n_dim}
        product = self.along(self.value(q, over_both) * self.value(k, over_both), dim, n_dim)
        scores = self.along(scale * product.sum(axis=self.position[dim], keepdims=True), key, n_keys)
        if mask[0] == "CausalMask":
            query_index = self.index(mask[1], over_keys)
            key_index = self.index(t.ax(key), over_keys)
            scores = np.where(query_index < key_index, -np.inf, scores)
        _, l, acc = softmax_fold(scores, self.value(v, over_keys), self.position[key])
        return acc / l


def axis_names(term: Term) -> set[str]:
    """Every axis name a term mentions, free or bound."""
    names: set[str] = set()
    for sub in t.subterms(term):
        if sub[0] == "Ax":
            names.add(sub[1])
        elif sub[0] in t.BINDERS:
            names.update(sub[i] for i in t.BINDERS[sub[0]])
    return names


def evaluate_term(
    term: Term, inputs: Mapping[str, np.ndarray], axes: tuple[str, ...], extents: Mapping[str, int]
) -> np.ndarray:
    """The value of ``term`` as an array over ``axes`` (in that order), in float64."""
    names = sorted(axis_names(term) | set(axes))
    evaluator = _Evaluator({k: np.asarray(a, dtype=np.float64) for k, a in inputs.items()}, names)
    with np.errstate(all="ignore"):
        value = evaluator.value(term, {a: extents[a] for a in axes})
    value = np.asarray(value, dtype=np.float64)
    stray = [n for n in names if n not in axes and value.shape[evaluator.position[n]] != 1]
    if stray:
        raise ValueError(f"term varies along axes {stray} that are not among the requested {axes}")
    target = [extents[n] if n in axes else 1 for n in names]
    full = np.broadcast_to(value, target)
    ordered = np.transpose(full, [evaluator.position[a] for a in axes] + [evaluator.position[n] for n in names if n not in axes])
    return ordered.reshape([extents[a] for a in axes])
