"""Reference semantics of index-notation terms, fused forms included, on NumPy or torch.

Every value is an array with one dimension per axis name of the term (size 1 where it does
not vary), so broadcasting does the index bookkeeping. ``Contract`` goes through einsum
over the dimensions each operand varies along, so a matmul never materialises its
``M·N·K`` products; the other binders reduce a broadcast body. Fused forms evaluate the way
their kernels compute: the online-softmax fold and flash attention stream over the key
axis in blocks of ``fold_block`` keys, combining partial ``(m, l, acc)`` states; LayerNorm
rows merge Welford partial statistics.

One evaluator serves two uses through an :class:`Arrays` backend: :func:`evaluate_term`
is the float64 NumPy ground truth, streaming in blocks of 3 keys so that tests cross many
block boundaries (comparing rewritten forms against the naive graph checks each rewrite's
identity); :mod:`cherenkov.search.torch_eval` runs it with torch on the GPU in one block
(the forms' definitions), as the reference measured kernels are checked against.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from cherenkov.graph.evaluate import round_to_dtype
from cherenkov.rewrites import terms as t
from cherenkov.rewrites.terms import Term

FOLD_BLOCK = 3  # keys per streaming step of the NumPy reference
LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"  # einsum subscripts, one per axis name

Env = frozenset  # of (axis name, extent) pairs


class Arrays:
    """What differs between array libraries. Everything else the evaluator calls on ``xp``
    by a name NumPy and torch share (exp, exp2, log2, sin, sqrt, maximum, where,
    remainder, clip, isfinite, einsum)."""

    xp: Any

    def full(self, shape: tuple[int, ...], value: float) -> Any:
        """An array of the working float dtype."""
        raise NotImplementedError

    def full_index(self, shape: tuple[int, ...], value: int) -> Any:
        raise NotImplementedError

    def arange(self, n: int) -> Any:
        raise NotImplementedError

    def to_float(self, x: Any) -> Any:
        raise NotImplementedError

    def cast(self, x: Any, dtype: str) -> Any:
        """``x`` rounded to a graph dtype and back to the working float dtype."""
        raise NotImplementedError

    def reduce(self, x: Any, dim: int, how: str) -> Any:
        """``sum`` or ``max`` over ``dim``, keeping it (size 1)."""
        raise NotImplementedError

    def expand(self, x: Any, shape: list[int]) -> Any:
        raise NotImplementedError

    def arrange(self, x: Any, shape: list[int], order: list[int], final: list[int]) -> Any:
        """``x`` broadcast to ``shape``, its dimensions permuted to ``order``, reshaped to ``final``."""
        raise NotImplementedError


class NumpyArrays(Arrays):
    """NumPy in float64."""

    xp = np

    def full(self, shape: tuple[int, ...], value: float) -> Any:
        return np.full(shape, value, dtype=np.float64)

    def full_index(self, shape: tuple[int, ...], value: int) -> Any:
        return np.full(shape, value, dtype=np.int64)

    def arange(self, n: int) -> Any:
        return np.arange(n)

    def to_float(self, x: Any) -> Any:
        return np.asarray(x, dtype=np.float64)

    def cast(self, x: Any, dtype: str) -> Any:
        return round_to_dtype(np.asarray(x, dtype=np.float64), dtype)

    def reduce(self, x: Any, dim: int, how: str) -> Any:
        return (np.max if how == "max" else np.sum)(x, axis=dim, keepdims=True)

    def expand(self, x: Any, shape: list[int]) -> Any:
        return np.broadcast_to(x, shape)

    def arrange(self, x: Any, shape: list[int], order: list[int], final: list[int]) -> Any:
        return np.transpose(np.broadcast_to(x, shape), order).reshape(final)


def softmax_fold(
    arrays: Arrays, s: Any, v: Any | None, dim: int, block: int | None
) -> tuple[Any, Any, Any | None]:
    """The online-softmax fold over ``dim``: ``(m, l, acc)`` with ``m = max s``,
    ``l = Σ e^{s−m}`` (0 where ``m`` is −∞) and ``acc = Σ e^{s−m}·v`` (None without ``v``),
    combined ``block`` keys at a time (None: all at once)."""
    xp = arrays.xp
    n = s.shape[dim]
    step = block or n
    reduced = list(s.shape)
    reduced[dim] = 1
    m, l = arrays.full(tuple(reduced), -np.inf), arrays.full(tuple(reduced), 0.0)
    acc = None
    for start in range(0, n, step):
        window = [slice(None)] * len(s.shape)
        window[dim] = slice(start, start + step)
        s_block = s[tuple(window)]
        m_new = xp.maximum(m, arrays.reduce(s_block, dim, "max"))
        live = xp.isfinite(m_new)
        rescale = xp.where(live, xp.exp(xp.where(live, m, 0.0) - xp.where(live, m_new, 0.0)), 0.0)
        p = xp.where(live, xp.exp(s_block - xp.where(live, m_new, 0.0)), 0.0)
        l = l * rescale + arrays.reduce(p, dim, "sum")
        if v is not None:
            v_block = v if v.shape[dim] == 1 else v[tuple(window)]
            part = contract(arrays, p, v_block, dim, p.shape[dim])
            acc = part if acc is None else acc * rescale + part
        m = m_new
    return m, l, acc


def normalised(xp: Any, acc: Any, l: Any) -> Any:
    """``acc / l``, and 0 for a row without a live score (``l = 0``): the streaming forms'
    safe softmax, which PyTorch's attention with a mask tensor follows too."""
    live = l > 0
    return xp.where(live, acc / xp.where(live, l, 1.0), 0.0)


SPLIT_REFERENCE_CHUNKS = 3
"""Key chunks the reference folds a split-KV form over (uneven on the rule's 7 keys)."""


def split_fold(arrays: Arrays, s: Any, v: Any, dim: int, splits: int, block: int | None) -> Any:
    """``Σ softmax(s)·v`` over ``dim`` as split-KV attention computes it: each of ``splits``
    chunks of the keys folds to its normalised partial ``o_c = acc_c / l_c`` and log-sum-exp
    ``λ_c = m_c + log l_c``; the result is ``Σ_c e^{λ_c − Λ} o_c`` with ``Λ = log Σ_c e^{λ_c}``
    (a chunk whose keys are all masked has ``λ_c = −∞`` and weight 0)."""
    xp = arrays.xp
    n = s.shape[dim]
    step = -(-n // splits)
    partials, lses = [], []
    for start in range(0, n, step):
        window = [slice(None)] * len(s.shape)
        window[dim] = slice(start, start + step)
        v_chunk = v if v.shape[dim] == 1 else v[tuple(window)]
        m, l, acc = softmax_fold(arrays, s[tuple(window)], v_chunk, dim, block)
        live = l > 0
        partials.append(normalised(xp, acc, l))
        lses.append(xp.where(live, m + xp.log(xp.where(live, l, 1.0)), -np.inf))
    top = lses[0]
    for lse in lses[1:]:
        top = xp.maximum(top, lse)
    finite = xp.isfinite(top)
    weights = [xp.where(finite, xp.exp(lse - xp.where(finite, top, 0.0)), 0.0) for lse in lses]
    total = sum(weights)
    return sum(w * o for w, o in zip(weights, partials)) / xp.where(total > 0, total, 1.0)


def welford(arrays: Arrays, x: Any, dim: int, block: int | None) -> tuple[Any, Any]:
    """Mean and (biased) variance over ``dim``, merging the statistics of ``block``-wide
    slices (Chan et al.; None: one slice)."""
    n = x.shape[dim]
    step = block or n
    count, mean, m2 = 0, 0.0, 0.0
    for start in range(0, n, step):
        window = [slice(None)] * len(x.shape)
        window[dim] = slice(start, start + step)
        part = x[tuple(window)]
        n_b = part.shape[dim]
        mean_b = arrays.reduce(part, dim, "sum") / n_b
        m2_b = arrays.reduce((part - mean_b) ** 2, dim, "sum")
        delta = mean_b - mean
        total = count + n_b
        mean = mean + delta * (n_b / total)
        m2 = m2 + m2_b + delta**2 * (count * n_b / total)
        count = total
    return mean, m2 / count


def contract(arrays: Arrays, a: Any, b: Any, dim: int, extent: int) -> Any:
    """``Σ_dim a·b`` without materialising the broadcast product (einsum over the
    dimensions each operand varies along)."""
    if a.shape[dim] == 1 and b.shape[dim] == 1:
        return a * b * extent
    a_dims = [i for i, size in enumerate(a.shape) if size > 1]
    b_dims = [i for i, size in enumerate(b.shape) if size > 1]
    out_dims = sorted((set(a_dims) | set(b_dims)) - {dim})
    spec = (
        "".join(LETTERS[i] for i in a_dims) + ","
        + "".join(LETTERS[i] for i in b_dims) + "->"
        + "".join(LETTERS[i] for i in out_dims)
    )  # fmt: skip
    result = arrays.xp.einsum(spec, a.reshape([a.shape[i] for i in a_dims]), b.reshape([b.shape[i] for i in b_dims]))
    shape = [1] * len(a.shape)
    for i in out_dims:
        shape[i] = max(a.shape[i], b.shape[i])
    return result.reshape(shape)


class TermEvaluator:
    """Values of the subterms of one term, memoised by (subterm, bound extents)."""

    def __init__(self, arrays: Arrays, inputs: Mapping[str, Any], names: list[str], fold_block: int | None) -> None:
        if len(names) > len(LETTERS):
            raise ValueError(f"a term with {len(names)} axis names is over the evaluator's {len(LETTERS)}")
        self.arrays = arrays
        self.xp = arrays.xp
        self.inputs = inputs
        self.position = {name: i for i, name in enumerate(names)}
        self.rank = len(names)
        self.fold_block = fold_block
        self.memo: dict[tuple[Term, Env], Any] = {}

    def scalar(self, value: float) -> Any:
        return self.arrays.full((1,) * self.rank, float(value))

    def index(self, ix: Term, env: Mapping[str, int]) -> Any:
        head = ix[0]
        if head == "Ax":
            shape = [1] * self.rank
            shape[self.position[ix[1]]] = env[ix[1]]
            return self.arrays.arange(env[ix[1]]).reshape(shape)
        if head == "IxLit":
            return self.arrays.full_index((1,) * self.rank, ix[1])
        if head == "IxAdd":
            return self.index(ix[1], env) + ix[2]
        if head == "IxDiv":
            return self.index(ix[1], env) // ix[2]
        if head == "IxMod":
            return self.index(ix[1], env) % ix[2]
        if head == "IxLin":
            return self.index(ix[1], env) * ix[2] + self.index(ix[3], env)
        raise ValueError(f"not an index term: {ix}")

    def along(self, value: Any, axis: str, extent: int) -> Any:
        shape = list(value.shape)
        shape[self.position[axis]] = extent
        return self.arrays.expand(value, shape)

    def value(self, term: Term, env: Mapping[str, int]) -> Any:
        key = (term, Env(env.items()))
        if key not in self.memo:
            self.memo[key] = self._value(term, env)
        return self.memo[key]

    def _value(self, term: Term, env: Mapping[str, int]) -> Any:
        xp, arrays = self.xp, self.arrays
        head, args = term[0], term[1:]
        v = self.value
        match head:
            case "Tensor":
                array = self.inputs[args[0]]
                items = t.ix_items(args[1])
                if len(items) != array.ndim:
                    raise ValueError(f"{args[0]} has {array.ndim} axes but is indexed with {len(items)}")
                if not items:
                    return arrays.to_float(array).reshape((1,) * self.rank)
                index = tuple(xp.clip(self.index(ix, env), 0, size - 1) for ix, size in zip(items, array.shape))
                return arrays.to_float(array[index])
            case "Num" | "Flag":
                return self.scalar(args[0])
            case "Iota":
                return arrays.to_float(self.index(args[0], env))
            case "Cast":
                return arrays.cast(v(args[1], env), args[0])
            case "Exp2":
                return xp.exp2(v(args[0], env))
            case "Exp":
                return xp.exp(v(args[0], env))
            case "Log2":
                return xp.log2(v(args[0], env))
            case "Sin":
                return xp.sin(v(args[0], env))
            case "Sqrt":
                return xp.sqrt(v(args[0], env))
            case "Recip":
                return 1.0 / v(args[0], env)
            case "Tanh":
                return xp.tanh(v(args[0], env))
            case "Neg":
                return -v(args[0], env)
            case "Add":
                return v(args[0], env) + v(args[1], env)
            case "Mul":
                return v(args[0], env) * v(args[1], env)
            case "Mod":
                return xp.remainder(v(args[0], env), v(args[1], env))
            case "Lt":
                return arrays.to_float(v(args[0], env) < v(args[1], env))
            case "Maximum":
                return xp.maximum(v(args[0], env), v(args[1], env))
            case "Where":
                return xp.where(v(args[0], env) != 0, v(args[1], env), v(args[2], env))
            case "PadAxis":
                ix, lo, size, fill, body = args
                position = self.index(ix, env)
                return xp.where((position >= lo) & (position < lo + size), v(body, env), self.scalar(fill))
            case "Sum" | "Max":
                axis, extent = args[0], args[1]
                body = self.along(v(args[2], {**env, axis: extent}), axis, extent)
                return arrays.reduce(body, self.position[axis], head.lower())
            case "Contract":
                axis, extent = args[0], args[1]
                inner = {**env, axis: extent}
                return contract(arrays, v(args[2], inner), v(args[3], inner), self.position[axis], extent)
            case "SoftmaxFoldL" | "SoftmaxFoldAcc" | "OnlineSoftmaxContract":
                axis, extent = args[0], args[1]
                inner = {**env, axis: extent}
                scores = self.along(v(args[2], inner), axis, extent)
                values = v(args[3], inner) if head != "SoftmaxFoldL" else None
                _, l, acc = softmax_fold(arrays, scores, values, self.position[axis], self.fold_block)
                return {"SoftmaxFoldL": l, "SoftmaxFoldAcc": acc}.get(head, normalised(xp, acc, l) if acc is not None else l)
            case "LogSumExp":
                axis, extent, scores = args
                m, l, _ = softmax_fold(arrays, self.along(v(scores, {**env, axis: extent}), axis, extent), None,
                                       self.position[axis], self.fold_block)  # fmt: skip
                live = l > 0
                return xp.where(live, m + xp.log(xp.where(live, l, 1.0)), -np.inf)
            case "AttentionLse":
                key, n_keys, dim, n_dim, q, k, scale, mask = args
                scores = self._scores(key, n_keys, dim, n_dim, q, k, scale, mask, {**env, key: n_keys})
                m, l, _ = softmax_fold(arrays, scores, None, self.position[key], self.fold_block)
                live = l > 0
                return xp.where(live, m + xp.log(xp.where(live, l, 1.0)), -np.inf)
            case "AttentionDs":
                return self._score_gradient(args, env)
            case "FlashAttentionGradQ":  # c·Σ_j dS·k2
                key, n_keys, *_, scale, _, k2 = args
                over_keys = {**env, key: n_keys}
                ds = self._score_gradient(args[:12], over_keys)
                return scale * contract(arrays, ds, v(k2, over_keys), self.position[key], n_keys)
            case "FlashAttentionGradK":  # c·Σ_i dS·q2
                query, n_queries, *_, scale, _, q2 = args
                over_queries = {**env, query: n_queries}
                ds = self._score_gradient(args[2:14], over_queries)
                return scale * contract(arrays, ds, v(q2, over_queries), self.position[query], n_queries)
            case "FlashAttentionGradV":  # Σ_i P·do2
                query, n_queries, key, n_keys, dim, n_dim, q, k, scale, mask, do2 = args
                over_queries = {**env, query: n_queries}
                p = self._probabilities(key, n_keys, dim, n_dim, q, k, scale, mask, over_queries)
                return contract(arrays, p, v(do2, over_queries), self.position[query], n_queries)
            case "FlashAttentionGradKGroup" | "FlashAttentionGradVGroup":  # Σ_g of the per-head form
                axis, extent = args[0], args[1]
                inner = (head.removesuffix("Group"), *args[2:])
                body = self.along(v(inner, {**env, axis: extent}), axis, extent)
                return arrays.reduce(body, self.position[axis], "sum")
            case "FlashAttention":
                return self._flash(args, env)
            case "FlashAttentionSplitKv":
                return self._flash(args, env, splits=SPLIT_REFERENCE_CHUNKS)
            case "FlashAttentionScaled":  # g·Σ_j softmax_j(c·f_q·f_k·Σ_d q·k)·v_j; the factors free of j and d
                *flash, scale, mask, query_factor, key_factor, out_factor = args
                scaled = scale * self.value(query_factor, env) * self.value(key_factor, env)
                return self.value(out_factor, env) * self._flash((*flash, scaled, mask), env)
            case "SoftmaxRow":
                axis, extent, scores = args
                s = self.along(v(scores, {**env, axis: extent}), axis, extent)
                m, l, _ = softmax_fold(arrays, s, None, self.position[axis], self.fold_block)
                return xp.exp(s - m) / l
            case "RmsNormRow":
                axis, extent, x, eps = args
                xv = self.along(v(x, {**env, axis: extent}), axis, extent)
                return xv / xp.sqrt(arrays.reduce(xv * xv, self.position[axis], "sum") / extent + eps)
            case "LayerNormRow":
                axis, extent, x, eps = args
                xv = self.along(v(x, {**env, axis: extent}), axis, extent)
                mean, variance = welford(arrays, xv, self.position[axis], self.fold_block)
                return (xv - mean) / xp.sqrt(variance + eps)
            case "Scheduled":
                return v(args[0], env)
            case "Shifted":
                axis, delta, body = args
                return v(t.shifted(body, axis, delta), env)
        raise ValueError(f"no reference semantics for {head}")

    def _scores(self, key: str, n_keys: int, dim: str, n_dim: int, q: Term, k: Term, scale: Any, mask: Term,
                env: Mapping[str, int]) -> Any:  # fmt: skip
        """Attention's masked scores ``c·Σ_d q·k`` (soft-capped, ``cap·tanh(s/cap)``, then + mask)
        along ``key`` (``env`` holds it)."""
        scores = self._scaled_product(key, n_keys, dim, n_dim, q, k, scale, env)
        cap, mask = t.soft_capped(mask)
        if cap:
            scores = cap * self.xp.tanh(scores / cap)
        bias, causal = t.mask_bias(mask), t.mask_causal_axis(mask)
        if bias is not None:
            scores = scores + self.value(bias, env)
        if causal is not None:
            query_index = self.index(causal, env)
            key_index = self.index(t.ax(key), env)
            scores = self.xp.where(query_index < key_index, self.scalar(-np.inf), scores)
        return scores

    def _scaled_product(self, key: str, n_keys: int, dim: str, n_dim: int, q: Term, k: Term, scale: Any,
                        env: Mapping[str, int]) -> Any:  # fmt: skip
        """``c·Σ_d q·k`` along ``key`` (``env`` holds it): attention's scores before any cap or mask."""
        over_both = {**env, dim: n_dim}
        product = contract(self.arrays, self.value(q, over_both), self.value(k, over_both), self.position[dim], n_dim)
        return self.along(scale * product, key, n_keys)

    def _probabilities(self, key: str, n_keys: int, dim: str, n_dim: int, q: Term, k: Term, scale: float,
                       mask: Term, env: Mapping[str, int]) -> Any:  # fmt: skip
        """Attention's probabilities ``softmax_key(scores)`` (0 on a row without a live score)."""
        xp = self.xp
        scores = self._scores(key, n_keys, dim, n_dim, q, k, scale, mask, {**env, key: n_keys})
        m, l, _ = softmax_fold(self.arrays, scores, None, self.position[key], self.fold_block)
        live = l > 0
        return xp.where(live, xp.exp(scores - xp.where(live, m, 0.0)) / xp.where(live, l, 1.0), 0.0)

    def _score_gradient(self, args: tuple, env: Mapping[str, int]) -> Any:
        """``AttentionDs``: ``P·(Σ_e do·v − Σ_e do·o)`` with ``o = Σ_key P·v`` (``env`` holds the key axis);
        under a soft cap ``m`` times ``1 − tanh²(c·Σ_d q·k / m)``, the cap's slope."""
        key, n_keys, dim, n_dim, values, n_values, q, k, v, do, scale, mask = args
        arrays = self.arrays
        p = self._probabilities(key, n_keys, dim, n_dim, q, k, scale, mask, env)
        over_values = {**env, values: n_values}
        v_e, do_e = self.value(v, over_values), self.value(do, over_values)
        dp = contract(arrays, do_e, v_e, self.position[values], n_values)
        o = contract(arrays, p, v_e, self.position[key], n_keys)
        delta = contract(arrays, do_e, o, self.position[values], n_values)
        cap, _ = t.soft_capped(mask)
        if not cap:
            return p * (dp - delta)
        capped = self.xp.tanh(self._scaled_product(key, n_keys, dim, n_dim, q, k, scale, env) / cap)
        return p * (dp - delta) * (1.0 - capped * capped)

    def _flash(self, args: tuple, env: Mapping[str, int], splits: int = 1) -> Any:
        """Flash attention's value; with ``splits`` > 1 folded over that many chunks of the
        keys, whose partial states are then combined (:func:`split_fold`)."""
        key, n_keys, dim, n_dim, q, k, v, scale, mask = args
        over_keys = {**env, key: n_keys}
        scores = self._scores(key, n_keys, dim, n_dim, q, k, scale, mask, over_keys)
        values = self.value(v, over_keys)
        if splits > 1:
            return split_fold(self.arrays, scores, values, self.position[key], splits, self.fold_block)
        _, l, acc = softmax_fold(self.arrays, scores, values, self.position[key], self.fold_block)
        return normalised(self.xp, acc, l)


def axis_names(term: Term) -> set[str]:
    """Every axis name a term mentions, free or bound."""
    names: set[str] = set()
    for sub in t.subterms(term):
        if sub[0] == "Ax":
            names.add(sub[1])
        elif sub[0] in t.BINDERS:
            names.update(sub[i] for i in t.BINDERS[sub[0]])
    return names


def evaluate_with(
    arrays: Arrays, term: Term, inputs: Mapping[str, Any], axes: tuple[str, ...], extents: Mapping[str, int],
    fold_block: int | None,
) -> Any:  # fmt: skip
    """The value of ``term`` as an array over ``axes`` (in that order, shaped by their extents)."""
    names = sorted(axis_names(term) | set(axes))
    evaluator = TermEvaluator(arrays, inputs, names, fold_block)
    value = evaluator.value(term, {a: extents[a] for a in axes})
    stray = [n for n in names if n not in axes and value.shape[evaluator.position[n]] != 1]
    if stray:
        raise ValueError(f"term varies along axes {stray} that are not among the requested {axes}")
    target = [extents[n] if n in axes else 1 for n in names]
    order = [evaluator.position[a] for a in axes] + [evaluator.position[n] for n in names if n not in axes]
    return arrays.arrange(value, target, order, [extents[a] for a in axes])


def evaluate_term(
    term: Term, inputs: Mapping[str, np.ndarray], axes: tuple[str, ...], extents: Mapping[str, int]
) -> np.ndarray:
    """The value of ``term`` as an array over ``axes`` (in that order), in float64 NumPy,
    the fused forms streamed in blocks of ``FOLD_BLOCK`` keys."""
    arrays = NumpyArrays()
    with np.errstate(all="ignore"):
        value = evaluate_with(
            arrays, term, {k: np.asarray(a, dtype=np.float64) for k, a in inputs.items()}, axes, extents, FOLD_BLOCK
        )
    return np.asarray(value, dtype=np.float64)
