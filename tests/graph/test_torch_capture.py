"""``ck.from_torch``: PyTorch modules and functions captured with ``torch.export`` and
lowered to primitives evaluate like PyTorch, keep names and dtypes, specialise constant
``tril`` buffers into causal iota masks (so ``ck.derive`` finds causal flash attention),
and refuse what they cannot represent with a ``GraphError`` that says why."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
F = torch.nn.functional
A = torch.ops.aten

import cherenkov as ck  # noqa: E402
from cherenkov.graph.torch_capture import (  # noqa: E402
    BAKED_BUFFER_PREFIX,
    SDPA_BACKWARD_KERNELS,
    SDPA_KERNELS,
    sanitize_name,
    supported_ops,
)

TOL = 1e-5


# ----------------------------------------------------------------------------- helpers


def leaves(value: object) -> list:
    from torch.utils._pytree import tree_leaves

    return [v for v in tree_leaves(value) if isinstance(v, torch.Tensor)]


def assert_matches(got: np.ndarray, ref: object, tol: float = TOL) -> None:
    """Exact for bool/int results; relative Frobenius error on the finite part otherwise,
    with infinities and NaNs in the same places."""
    ref_t = ref.detach()
    expected = ref_t.double().numpy() if ref_t.dtype != torch.bool else ref_t.numpy()
    assert got.shape == expected.shape, f"shape {got.shape} != torch {expected.shape}"
    if ref_t.dtype == torch.bool or not ref_t.dtype.is_floating_point:
        np.testing.assert_array_equal(got.astype(expected.dtype), expected)
        return
    finite = np.isfinite(expected)
    np.testing.assert_array_equal(np.isfinite(got), finite)
    np.testing.assert_array_equal(got[~finite], expected[~finite])
    scale = max(float(np.linalg.norm(expected[finite])), 1e-30)
    error = float(np.linalg.norm(got[finite] - expected[finite])) / scale
    assert error <= tol, f"relative error {error:.3e} > {tol:.0e}"


def capture(fn: Callable, *examples: torch.Tensor, tol: float = TOL) -> ck.Graph:
    """Capture ``fn``; check primitives only, and that evaluating the graph on its example
    inputs reproduces ``fn``'s outputs."""
    g = ck.from_torch(fn, *examples)
    assert set(g.ops()) <= ck.PRIMITIVES
    with torch.no_grad():
        refs = leaves(fn(*examples))
    got = ck.evaluate(g, g.example_inputs())
    names = ["out"] if len(refs) == 1 else [f"out{i}" for i in range(len(refs))]
    assert sorted(got) == sorted(names)
    for name, ref in zip(names, refs):
        assert_matches(got[name], ref, tol)
    return g


def randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def positive(*shape: int, seed: int = 0) -> torch.Tensor:
    return randn(*shape, seed=seed).abs() + 0.5


# ----------------------------------------------------------------------------- modules


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention, the explicit (non-flash) branch; ``mask`` picks how the causal
    mask is spelled."""

    def __init__(self, n_embd: int, n_head: int, block_size: int, mask: str = "tril_buffer") -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.attn_dropout = nn.Dropout(0.1)
        self.resid_dropout = nn.Dropout(0.1)
        self.n_head, self.n_embd, self.mask = n_head, n_embd, mask
        if mask in ("tril_buffer", "sdpa_tril_mask"):
            tril = torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size)
            self.register_buffer("bias", tril)
        elif mask == "triu_bool_buffer":
            self.register_buffer("upper", torch.triu(torch.ones(block_size, block_size, dtype=torch.bool), 1))
        elif mask == "almost_tril_buffer":
            tril = torch.tril(torch.ones(block_size, block_size))
            tril[block_size - 1, 2] = 0.0  # one entry off: not a causal mask, nor a window
            self.register_buffer("bias", tril.view(1, 1, block_size, block_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.mask == "sdpa_tril_mask":
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias[:, :, :T, :T] != 0)
            return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        if self.mask in ("tril_buffer", "almost_tril_buffer"):
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        elif self.mask == "triu_bool_buffer":
            att = att.masked_fill(self.upper[:T, :T], float("-inf"))
        elif self.mask == "arange":
            pos = torch.arange(T, device=x.device)
            att = att.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
        elif self.mask == "tril_in_forward":
            att = att.masked_fill(torch.tril(torch.ones(T, T, device=x.device)) == 0, float("-inf"))
        elif self.mask == "additive_triu_in_place":
            att.add_(torch.full((T, T), float("-inf"), dtype=att.dtype, device=x.device).triu(1))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class SdpaSelfAttention(CausalSelfAttention):
    """nanoGPT's flash branch: ``F.scaled_dot_product_attention(..., is_causal=True)``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, width: int, approximate: str = "none") -> None:
        super().__init__()
        self.c_fc = nn.Linear(width, 4 * width)
        self.gelu = nn.GELU(approximate=approximate)
        self.c_proj = nn.Linear(4 * width, width)
        self.dropout = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class HandRMSNorm(nn.Module):
    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


class SwiGLU(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(width, hidden, bias=False)
        self.w2 = nn.Linear(hidden, width, bias=False)
        self.w3 = nn.Linear(width, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """nanoGPT's transformer block: LayerNorm, attention, residual, LayerNorm, MLP, residual."""

    def __init__(self, width: int, heads: int, block_size: int, attention: type = CausalSelfAttention) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = attention(width, heads, block_size)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = MLP(width, approximate="tanh")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def seeded(module: nn.Module, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    for p in module.parameters():
        nn.init.normal_(p, std=0.2)
    return module.eval()


def flash_problems(g: ck.Graph) -> list:
    d = ck.derive(g)
    assert d.found("flash_attention"), [k.kind for k in d.kernels]
    plans = d.plans("sm_90")
    assert plans, "flash attention was found but no schedule fits sm_90"
    return [p.problem for p in plans]


# ----------------------------------------------------------------------------- nanoGPT attention

MASK_SPELLINGS = (
    "tril_buffer",
    "triu_bool_buffer",
    "arange",
    "tril_in_forward",
    "additive_triu_in_place",
    "sdpa_tril_mask",
)


@pytest.mark.parametrize("mask", MASK_SPELLINGS)
def test_nanogpt_attention_matches_torch_and_derives_causal_flash_attention(mask: str) -> None:
    module = seeded(CausalSelfAttention(32, 4, 16, mask))
    g = capture(module, randn(2, 8, 32))
    assert list(g.inputs) == ["x", "c_attn_weight", "c_attn_bias", "c_proj_weight", "c_proj_bias"]
    assert g.ops()["max_reduce"] == 1, "one softmax row maximum: no extra fully-masked-row guard"
    assert g.ops()["iota"] >= 1 and g.ops()["less_than"] >= 1, "the causal mask is an iota comparison"

    # bf16 at head dim 64: the plans exist and every one of them is causal
    bf16 = seeded(CausalSelfAttention(128, 2, 32, mask)).to(torch.bfloat16)
    problems = flash_problems(ck.from_torch(bf16, randn(2, 16, 128, dtype=torch.bfloat16)))
    assert all(p.causal and p.seq_q == p.seq_kv == 16 and p.head_dim == 64 for p in problems)


def test_nanogpt_example_inputs_are_the_examples_and_current_parameters() -> None:
    module = seeded(CausalSelfAttention(32, 4, 16))
    x = randn(2, 8, 32)
    g = ck.from_torch(module, x)
    examples = g.example_inputs()
    assert "bias" not in examples and "bias" not in g.inputs, "the tril buffer is specialised, not an input"
    np.testing.assert_array_equal(examples["x"], x.numpy())
    np.testing.assert_array_equal(examples["c_attn_weight"], module.c_attn.weight.detach().numpy())
    assert g.inputs["c_proj_bias"].shape == (32,) and g.inputs["x"].dtype == "fp32"
    x.zero_()
    assert np.any(g.example_inputs()["x"] != 0.0), "the examples are copies, not views of the tensors"


def test_a_buffer_that_is_not_exactly_tril_stays_an_input_and_is_not_causal() -> None:
    module = seeded(CausalSelfAttention(32, 4, 8, "almost_tril_buffer"))
    g = capture(module, randn(2, 8, 32))
    assert "bias" in g.inputs and g.inputs["bias"].shape == (1, 1, 8, 8)
    np.testing.assert_array_equal(g.example_inputs()["bias"], module.bias.numpy())
    d = ck.derive(g)
    assert not any(k.kind == "flash_attention" and "Causal" in str(k.core) for k in d.kernels)


def test_nanogpt_sdpa_branch_derives_causal_flash_attention() -> None:
    sdpa = seeded(SdpaSelfAttention(128, 2, 16)).to(torch.bfloat16)
    problems = flash_problems(ck.from_torch(sdpa, randn(2, 16, 128, dtype=torch.bfloat16)))
    assert all(p.causal for p in problems)


# ----------------------------------------------------------------------------- models


MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "mlp_gelu": (lambda: MLP(16), (2, 5, 16)),
    "mlp_gelu_tanh": (lambda: MLP(16, approximate="tanh"), (2, 5, 16)),
    "hand_rms_norm": (lambda: HandRMSNorm(16), (3, 16)),
    "rms_norm": (lambda: nn.RMSNorm(16, eps=1e-5), (3, 4, 16)),
    "rms_norm_default_eps": (lambda: nn.RMSNorm(16), (3, 16)),
    "layer_norm": (lambda: nn.LayerNorm(16), (3, 4, 16)),
    "layer_norm_2d": (lambda: nn.LayerNorm((4, 16)), (3, 4, 16)),
    "swiglu": (lambda: SwiGLU(16, 24), (2, 3, 16)),
    "block": (lambda: Block(32, 4, 8), (2, 8, 32)),
    "block_sdpa": (lambda: Block(32, 4, 8, SdpaSelfAttention), (2, 8, 32)),
    "sequential": (lambda: nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4), nn.Tanh()), (5, 16)),
}


@pytest.mark.parametrize("model", MODELS)
def test_models_evaluate_like_torch(model: str) -> None:
    make, shape = MODELS[model]
    capture(seeded(make()), randn(*shape))


def test_sdpa_function_with_is_causal_matches_torch_and_derives_causal_flash() -> None:
    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    q, k, v = (randn(2, 4, 16, 64, seed=s) for s in range(3))
    g = capture(attend, q, k, v)
    assert list(g.inputs) == ["q", "k", "v"]
    bf = [t.to(torch.bfloat16) for t in (q, k, v)]
    problems = flash_problems(ck.from_torch(attend, *bf))
    assert all(p.causal and p.group_size == 1 for p in problems)


def test_gqa_via_enable_gqa_and_repeat_interleave_derive_grouped_flash_attention() -> None:
    def gqa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, scale=0.1, enable_gqa=True)

    def repeated(q, k, v):
        k, v = (t.repeat_interleave(q.size(1) // t.size(1), dim=1) for t in (k, v))
        return F.scaled_dot_product_attention(q, k, v)

    def expanded(q, k, v):
        b, hkv, s, d = k.shape
        k, v = (t[:, :, None].expand(b, hkv, 2, s, d).reshape(b, 2 * hkv, s, d) for t in (k, v))
        return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(d), dim=-1) @ v

    for fn in (gqa, repeated, expanded):
        q, k, v = randn(2, 4, 8, 64), randn(2, 2, 12, 64, seed=1), randn(2, 2, 12, 64, seed=2)
        capture(fn, q, k, v)
        problems = flash_problems(ck.from_torch(fn, *(t.to(torch.bfloat16) for t in (q, k, v))))
        assert all(p.group_size == 2 and not p.causal for p in problems), fn.__name__


# ----------------------------------------------------------------------------- the causal band


class Banded(nn.Module):
    """A module with a ``tril`` buffer used in ``use`` (``window``: a sliding window's, ``tril(0) − tril(−window)``)."""

    def __init__(self, use: Callable, block: int = 8, dtype: torch.dtype = torch.float32,
                 window: int | None = None) -> None:  # fmt: skip
        super().__init__()
        self.use = use
        band = torch.tril(torch.ones(block, block, dtype=dtype))
        if window is not None:
            band = band - torch.tril(torch.ones(block, block, dtype=dtype), -window)
        self.register_buffer("bias", band.view(1, 1, block, block))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.use(self, x)


NEG = float("-inf")
BAND_USES = {
    "eq_zero": lambda m, x: F.softmax(x.masked_fill(m.bias[:, :, :4, :4] == 0, NEG), -1),
    "offset_slice": lambda m, x: F.softmax(x[..., :6].masked_fill(m.bias[:, :, 2:6, :6] == 0, NEG), -1),
    "col_offset": lambda m, x: x * m.bias[0, 0, 1:5, 3:7],
    "transposed": lambda m, x: x * m.bias[:, :, :4, :4].transpose(-2, -1),
    "permuted": lambda m, x: x + m.bias[:, :, :4, :4].permute(1, 0, 3, 2) * 2,
    "bool_not": lambda m, x: x.masked_fill(~m.bias[:, :, :4, :4].bool(), 0.0),
    "ne_and_eq_one": lambda m, x: torch.where(m.bias[:, :, :4, :4] != 0, x, -x) + (m.bias[:, :, :4, :4] == 1),
    "numeric": lambda m, x: x * m.bias[..., :4, :4] + m.bias[..., 4:, 4:],
    "view_select": lambda m, x: x - m.bias.view(8, 8)[:4, :4] - m.bias.squeeze(0)[0, 2:6, 2:6],
    "whole": lambda m, x: (x.sum() * m.bias).unsqueeze(-1),
    "stepped": lambda m, x: x.masked_fill(m.bias[:, :, ::2, 1::2] == 0, 0.0) + m.bias[0, 0, 1:6:3, :4].sum(0),
    "as_sdpa_mask": lambda m, x: F.scaled_dot_product_attention(x, x * 0.5, x, attn_mask=m.bias[:, :, :4, :4].bool()),
}


@pytest.mark.parametrize("use", BAND_USES)
def test_tril_buffer_specialisation_matches_torch_everywhere(use: str) -> None:
    module = Banded(BAND_USES[use]).eval()
    g = capture(module, randn(2, 3, 4, 8) if use == "offset_slice" else randn(2, 3, 4, 4))
    assert "bias" not in g.inputs


@pytest.mark.parametrize("use", BAND_USES)
@pytest.mark.parametrize("window", [2, 3])
def test_a_sliding_window_buffer_is_specialised_and_matches_torch_everywhere(use: str, window: int) -> None:
    """A window's band (keys ``i − window < j <= i``) follows the same slices, views, transposes and
    comparisons as a ``tril`` buffer, and lowers to two iota comparisons: never an input."""
    module = Banded(BAND_USES[use], window=window).eval()
    g = capture(module, randn(2, 3, 4, 8) if use == "offset_slice" else randn(2, 3, 4, 4))
    assert "bias" not in g.inputs


@pytest.mark.parametrize("dtype", [torch.bool, torch.int64, torch.float16])
def test_tril_buffers_of_any_dtype_are_specialised(dtype: torch.dtype) -> None:
    module = Banded(lambda m, x: x.masked_fill(m.bias[:, :, :4, :4] == 0, -1e4), dtype=dtype)
    g = capture(module, randn(1, 2, 4, 4))
    assert "bias" not in g.inputs


class UniformMask(nn.Module):
    """A mask buffer ``name`` of one value everywhere (transformers 5.17's bidirectional mask: all true,
    or its additive form, all zeros) used in ``use``."""

    def __init__(self, value: float | bool, use: Callable, name: str) -> None:
        super().__init__()
        self.use, self.name = use, name
        self.register_buffer(name, torch.full((1, 1, 4, 4), value, dtype=torch.bool if value is True else None))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.use(getattr(self, self.name), x)


@pytest.mark.parametrize("value, use, ops", [
    (0.0, lambda mask, x: x * 2.0 + mask, 0),  # adding it is nothing: no add
    (0.0, lambda mask, x: mask + x * 2.0, 0),
    (True, lambda mask, x: F.softmax(x.masked_fill(~mask, NEG), -1), None),
    (0.0, lambda mask, x: x.to(torch.float16) + mask, None),  # an fp32 sum of fp16 x: a cast, kept
])  # fmt: skip
def test_a_uniform_mask_the_backend_bakes_is_a_band_without_edges(value: float | bool, use: Callable,
                                                                   ops: int | None) -> None:  # fmt: skip
    """A constant the Dynamo backend folded and bakes into a region (named so) may hold one value; a
    module's own float buffer of one value (a zeroed KV cache) may change, and stays an input."""
    baked = capture(UniformMask(value, use, f"{BAKED_BUFFER_PREFIX}0").eval(), randn(2, 3, 4, 4))
    assert f"{BAKED_BUFFER_PREFIX}0" not in baked.inputs
    if ops is not None:
        assert baked.summary()["ops"].get("add", 0) == ops
    if value is not True:  # (a bool buffer can be no graph input)
        assert "mask" in capture(UniformMask(value, use, "mask").eval(), randn(2, 3, 4, 4)).inputs


def assembled_in_place(nope: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's query: an empty tensor, each part written into a slice of it."""
    q = nope.new_empty(*nope.shape[:-1], nope.shape[-1] + rope.shape[-1])
    q[..., : nope.shape[-1]] = nope
    q[..., nope.shape[-1] :] = rope
    return q * 2.0


# ----------------------------------------------------------------------------- op coverage


@dataclass(frozen=True)
class Case:
    fn: Callable
    inputs: tuple[Callable[[], torch.Tensor], ...]
    tol: float = TOL


def x46() -> torch.Tensor:
    return randn(4, 6)


def y46() -> torch.Tensor:
    return randn(4, 6, seed=1)


def p46() -> torch.Tensor:
    return positive(4, 6)


def SMOOTH_ACTIVATIONS(w: torch.Tensor) -> tuple[torch.Tensor, ...]:  # noqa: N802 - a table of functions
    """The activations built on ``e^x − 1`` and ``ln(1 + x)``."""
    return (torch.expm1(w), torch.log1p(w.abs()), F.softplus(w), F.softplus(w, beta=2.0, threshold=5.0), F.mish(w),
            F.elu(w), F.elu(w, alpha=0.5), F.selu(w), F.celu(w, alpha=2.0), F.logsigmoid(w))  # fmt: skip


W, B6 = randn(6, 6, seed=7), randn(6, seed=8)

CASES: dict[str, Case] = {
    # arithmetic
    "add_sub_alpha": Case(
        lambda x, y: (x + y, torch.add(x, y, alpha=2), x - 1, torch.sub(x, y, alpha=3), 2 - x), (x46, y46)
    ),
    "rsub_tensor": Case(lambda x, y: torch.rsub(x, y, alpha=0.5), (x46, y46)),
    "mul_div": Case(lambda x, y: (x * y, x * 3, x / 3, x / (y.abs() + 1), 1 / (y.abs() + 1)), (x46, y46)),
    "int_div": Case(lambda x: torch.arange(6) / 4 + x, (x46,)),
    "neg_exp_log": Case(lambda x, p: (-x, x.exp(), p.log(), torch.exp2(x), torch.log2(p)), (x46, p46)),
    "sqrt_rsqrt_reciprocal": Case(lambda p: (p.sqrt(), p.rsqrt(), p.reciprocal(), torch.square(p)), (p46,)),
    "pow": Case(lambda x, p: (x**2, x**3, p**0.5, p**-1, p**2.5, p**-0.5, 2**x), (x46, p46)),
    "trig_abs_erf": Case(lambda x: (x.sin(), x.cos(), x.abs(), torch.erf(x)), (x46,)),
    "remainder": Case(lambda x, y: (torch.remainder(x, 0.7), torch.remainder(x, y.abs() + 0.5)), (x46, y46)),
    "diff_cumsum": Case(lambda x: (torch.diff(x, dim=-1), torch.diff(x, dim=0, prepend=x[:1] - 1),
                                   torch.cumsum(x, -1), torch.cumsum(x, 0),
                                   (torch.diff(torch.arange(6).view(1, 6) % 4, prepend=torch.full((1, 1), -1)) != 1)
                                   .cumsum(-1) + x),  # transformers' packed-sequence numbering
                        (x46,)),
    "floor_divide": Case(lambda x, y: (torch.div(x, 0.7, rounding_mode="floor"), x // (y.abs() + 0.5),
                                       torch.div(x * 8, -3, rounding_mode="floor"),
                                       torch.div(torch.arange(24).view(4, 6), 5, rounding_mode="floor") + x),
                         (x46, y46)),
    "max_min_elementwise": Case(
        lambda x, y: (torch.maximum(x, y), torch.minimum(x, y), torch.max(x, y), torch.min(x, y)), (x46, y46)
    ),
    "clamp": Case(
        lambda x, y: (
            x.clamp(-0.5, 0.5),
            x.clamp(min=0.1),
            torch.clamp_min(x, 0.1),
            torch.clamp_max(x, 0.2),
            x.clamp(y),
        ),
        (x46, y46),
    ),
    # activations
    "activations": Case(
        lambda x: (F.relu(x), torch.sigmoid(x), torch.tanh(x), F.silu(x), F.hardtanh(x), F.leaky_relu(x, 0.2)),
        (x46,),
    ),
    "gelu": Case(lambda x: (F.gelu(x), F.gelu(x, approximate="tanh")), (x46,)),
    "smooth_activations": Case(lambda x: SMOOTH_ACTIVATIONS(x * 8), (x46,)),
    "hard_activations": Case(lambda x: (F.hardswish(x * 4), F.hardsigmoid(x * 4), F.relu6(x * 8)), (x46,)),
    "dropout_eval": Case(lambda x: F.dropout(x, 0.5, training=False) + A.native_dropout(x, 0.3, False)[0], (x46,)),
    # comparisons, logic, selection
    "compare_scalar": Case(lambda x: (x < 0, x > 0.1, x <= 0.2, x >= -0.1, x == 0.5, x != 0.5), (x46,)),
    "compare_tensor": Case(lambda x, y: (x < y, x > y, x <= y, x >= y, x == y, x != y, x == x.clone()), (x46, y46)),
    "logic": Case(
        lambda x, y: (
            ~(x > 0),
            (x > 0) & (y > 0),
            (x > 0) | (y > 0),
            torch.logical_not(x),
            torch.logical_and(x > 0, y),
            torch.logical_or(x > 0.5, y > 0.5),
            torch.bitwise_and(x > 0, y < 0),
            torch.bitwise_or(x > 0, y < 0),
            torch.any(x > 1, dim=-1),
            torch.all(x > -1.5, dim=0, keepdim=True),
            torch.any(x > 0),
        ),
        (x46, y46),
    ),
    "where": Case(
        lambda x, y: (
            torch.where(x > 0, x, y),
            torch.where(x > 0, x, 0.0),
            torch.where(x > 0, 1.0, y),
            torch.where(x > 0, 2.0, -1.0),
        ),
        (x46, y46),
    ),
    "masked_fill": Case(lambda x, y: (x.masked_fill(y > 0, -1e9), x.masked_fill(y > 0, torch.tensor(3.0))), (x46, y46)),
    "in_place": Case(lambda x, y: x.clone().masked_fill_(y > 0, 0.5).mul_(2).add_(y).relu_(), (x46, y46)),
    # linear algebra
    "matmul_family": Case(
        lambda x: (
            x @ W,
            torch.mm(x, W),
            torch.bmm(x[None], W[None]),
            F.linear(x, W, B6),
            F.linear(x, W),
            torch.addmm(B6, x, W),
            torch.addmm(B6, x, W, beta=0.5, alpha=2.0),
            torch.baddbmm(x[None], x[None], W[None], beta=0.0),
            x @ B6,
        ),
        (x46,),
    ),
    # softmax
    "softmax_family": Case(
        lambda x: (
            F.softmax(x, -1),
            F.softmax(x, dim=0),
            torch.softmax(x, -1, dtype=torch.float32),
            A._softmax(x, -1, False),
            F.log_softmax(x, -1),
            A._log_softmax(x, 0, False),
            A._safe_softmax(x.masked_fill(torch.arange(4)[:, None] == 2, NEG), -1),
        ),
        (x46,),
    ),
    # writes into fresh tensors, functionalised: DeepSeek-V3's query assembled in slices; copies over empties
    "slice_scatter": Case(lambda x, y: (assembled_in_place(x, y), A.slice_scatter(x, y * 3, -1, 1, 3)),
                          (lambda: randn(4, 6), lambda: randn(4, 2, seed=1))),
    "copy_into_empty": Case(
        lambda x, y: (
            x.new_empty(x.shape).copy_(y) + x,
            torch.empty(4, 6).copy_(x),
            torch.empty_like(x).copy_(y * 2),
            torch.empty_strided((4, 6), (6, 1)).copy_(x),
            x.new_empty_strided((4, 6), (6, 1)).copy_(y),
            A.copy(x, y * 2),  # what the writes above are once functionalised
        ),
        (x46, lambda: randn(6, seed=1)),
    ),
    # a slice's gradient, as a training graph's backward calls it (rotate_half in RoPE)
    "slice_backward": Case(
        lambda g: (
            A.slice_backward(g, [4, 9], 1, 2, 8, 1),
            A.slice_backward(g[:2], [5, 6], 0, 3, 9223372036854775807, 1),
            A.slice_backward(g, [4, 10], -1, -8, -2, 1),
            # stepped: positions 1, 3, ..., 11 of 12; 0, 3, ..., 15 of 17; rows 2 and 6 of 7
            A.slice_backward(g, [4, 12], 1, 1, 9223372036854775807, 2),
            A.slice_backward(g, [4, 17], -1, 0, 9223372036854775807, 3),
            A.slice_backward(g[:2], [7, 6], 0, 2, 7, 4),
        ),
        (lambda: randn(4, 6, seed=4),),
    ),
    # activations' and a layer norm's gradients, as a training graph's backward calls them
    "activation_backward": Case(
        lambda g, x: (
            A.tanh_backward(g, torch.tanh(x)),
            A.sigmoid_backward(g, torch.sigmoid(x)),
            A.threshold_backward(g, x, 0.0),
            A.gelu_backward(g, x),
            A.gelu_backward(g, x, approximate="tanh"),
            A.silu_backward(g, x),
        ),
        (lambda: randn(4, 6, seed=3), x46),
    ),
    "layer_norm_backward": Case(
        lambda g, x, w, b: (
            *A.native_layer_norm_backward(g, x, [6], *A.native_layer_norm(x, [6], w, b, 1e-5)[1:], w, b,
                                          [True, True, True]),  # fmt: skip
            A.native_layer_norm_backward(g, x, [4, 6], *A.native_layer_norm(x, [4, 6], None, None, 1e-5)[1:],
                                         None, None, [True, False, False])[0],  # fmt: skip
        ),
        (lambda: randn(3, 4, 6, seed=3), lambda: randn(3, 4, 6, seed=4), lambda: randn(6, seed=5),
         lambda: randn(6, seed=6)),  # fmt: skip
    ),
    # a written-out softmax's gradient, as a training graph's backward (AOTAutograd) calls it
    "softmax_backward": Case(
        lambda g, x: (
            A._softmax_backward_data(g, F.softmax(x, -1), -1, torch.float32),
            A._softmax_backward_data(g, F.softmax(x, 0), 0, torch.float32),
        ),
        (lambda: randn(4, 6, seed=3), x46),
    ),
    "sdpa_variants": Case(
        lambda q, k, v: (
            F.scaled_dot_product_attention(q, k, v),
            F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3),
            F.scaled_dot_product_attention(q, k, v, attn_mask=k[0, 0, None, :, 0] > -1.0),
            F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(5, 7).tril(2)),
            F.scaled_dot_product_attention(q, k[:, :2], v[:, :2], is_causal=True, enable_gqa=True),
            F.scaled_dot_product_attention(q, k[:, :2], v[:, :2], attn_mask=q[0, 0, :, :1] > -2, enable_gqa=True),
            # rows 0 and 1 see no key: torch gives them zeros
            F.scaled_dot_product_attention(q, k, v, attn_mask=torch.arange(7)[None, :] < torch.arange(5)[:, None] - 1),
            F.scaled_dot_product_attention(q, k, v, attn_mask=torch.full((5, 7), NEG).triu(-1)),
        ),
        (lambda: randn(2, 4, 5, 8), lambda: randn(2, 4, 7, 8, seed=1), lambda: randn(2, 4, 7, 8, seed=2)),
    ),
    # what an ATen-level trace (the Dynamo backend's make_fx) records for SDPA on the CPU
    "sdpa_cpu_kernel": Case(
        lambda q, k, v: (
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)[0],
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, scale=0.3)[0],
        ),
        (lambda: randn(2, 4, 5, 8), lambda: randn(2, 4, 7, 8, seed=1), lambda: randn(2, 4, 7, 8, seed=2)),
    ),
    # normalisation
    "norms": Case(
        lambda x: (
            F.layer_norm(x, (6,), B6, -B6),
            F.layer_norm(x, (6,)),
            F.rms_norm(x, (6,), B6, eps=1e-5),
            F.rms_norm(x, (4, 6)),
            A.native_layer_norm(x, [6], B6, B6 * 0.5, 1e-5),
            A.native_layer_norm(x, [4, 6], None, None, 1e-3),
        ),
        (x46,),
    ),
    # reductions
    "reductions": Case(
        lambda x: (
            x.sum(),
            x.sum(-1),
            x.sum((0, 1), keepdim=True),
            x.mean(),
            x.mean(0, keepdim=True),
            x.amax(-1),
            x.amax((0, 1)),
            x.amin(0, keepdim=True),
            x.max(),
            x.min(),
            x.max(dim=-1).values,
            x.min(dim=0, keepdim=True).values,
            x.var(-1),
            x.var(0, unbiased=False),
            x.var(-1, correction=0, keepdim=True),
            x.std(-1),
            (x > 0).sum(-1),
            x.sum(-1, dtype=torch.float32),
            F.normalize(x, dim=-1),  # linalg_vector_norm's 2-norm, clamped below
            torch.linalg.vector_norm(x, 1, dim=0, keepdim=True),
            torch.linalg.vector_norm(x, float("inf"), dim=-1),
            torch.linalg.vector_norm(x, -float("inf")),
            torch.linalg.vector_norm(x, 3.0, dim=(0, 1)),
        ),
        (x46,),
    ),
    # max.dim's indices (ties: the first), and a scatter by them, as max.dim's gradient is a training graph's
    "argmax_and_its_scatter": Case(
        lambda x, y: (
            x.max(dim=-1).indices,
            x.min(dim=0, keepdim=True).indices,
            x.clamp(max=0.5).max(dim=-1).indices,  # rows with tied maxima
            torch.zeros_like(x).scatter(-1, x.max(dim=-1, keepdim=True).indices, y[:, :1]),
            x.scatter(0, x.min(dim=0, keepdim=True).indices, 2.5),
            A.scatter(y, 1, y.max(dim=1, keepdim=True).indices, x[:, :1]),
        ),
        (lambda: randn(4, 6, seed=2) * 2, y46),
    ),
    # views
    "views": Case(
        lambda x: (
            x.view(2, 12),
            x.view(-1),
            x.reshape(3, 8),
            A._unsafe_view(x, [24]),
            x.permute(1, 0),
            x.transpose(0, 1),
            x.t(),
            x.swapaxes(0, 1),
            x.swapdims(1, 0),
            x.expand(3, 4, 6),
            x[:, None].expand(-1, 2, -1),
            x.unsqueeze(0).unsqueeze(-1),
            x[None, :, None].squeeze(),
            x[None].squeeze(0),
            x[None, :, None].squeeze((0, 2)),
            x.t().contiguous(),
            x.clone(),
            x.detach(),
            A.alias(x),
            x.flatten(),
            x[None].flatten(1),
            x.roll(2, 1),
            x.roll((-1, 3), (0, -1)),
            x.roll(5),
            x.roll(6, 1),  # a whole turn
            x.unflatten(-1, (2, 3)),
            B6.t(),
        ),
        (x46,),
    ),
    "slicing": Case(
        lambda x: (
            x[1:3],
            x[:, -2:],
            x[..., 1:5],
            x[2],
            x[:, 3],
            x[-1, -1],
            x.narrow(1, 1, 2),
            x.select(0, -2),
            x[:, 2:100],
            x[:, ::2],
            x[:, 1::4],
            x[1:, -5:100:3],
            x[::3, 1:],
            x[::2, ::2][:, 1:],
        ),
        (x46,),
    ),
    "splitting": Case(
        lambda x: (
            *x.split(2, dim=1),
            *x.split([1, 3]),
            *x.chunk(3, dim=1),
            *x.chunk(3, dim=0),
            *x.unbind(0),
            *x.unbind(-1)[:2],
        ),
        (x46,),
    ),
    "joining": Case(
        lambda x, y: (
            torch.cat([x, y], -1),
            torch.cat([x, y, x], 0),
            torch.concat([x, y.half()], 1),
            torch.concatenate([y, x], 0),
            torch.stack([x, y]),
            torch.stack([x, y], dim=-1),
            torch.cat([x]),
        ),
        (x46, y46),
    ),
    "repeats_and_pads": Case(
        lambda x: (
            x.repeat_interleave(2, dim=0),
            x.repeat_interleave(3),
            x.repeat(2, 1),
            x.repeat(2, 1, 3),
            F.pad(x, (1, 2)),
            F.pad(x, (1, 0, -1, 2), value=3.0),
            A.constant_pad_nd(x, [0, 1, 2, 0], -1.0),
        ),
        (x46,),
    ),
    # dtypes and constants
    "casts": Case(
        lambda x: (
            x.to(torch.bfloat16),
            x.half(),
            x.half().float(),
            A._to_copy(x, dtype=torch.float16),
            x.type_as(x.to(torch.bfloat16)),
            (x > 0).float(),
            (x * 4).to(torch.int32),
            x.bool(),
        ),
        (x46,),
    ),
    "bf16_inputs": Case(
        lambda x, y: (x * y + 1, F.softmax(x, -1), x.float() @ y.float().t()),
        (lambda: randn(4, 6, dtype=torch.bfloat16), lambda: randn(4, 6, seed=1, dtype=torch.bfloat16)),
        tol=1e-2,
    ),
    "constants": Case(
        lambda x: (
            x + torch.full((6,), 2.5),
            x * torch.ones(4, 1),
            x + torch.zeros(6, dtype=torch.bfloat16),
            torch.full_like(x, -1.0) + torch.ones_like(x) + torch.zeros_like(x),
            x.new_full((6,), 3.0) * x,
            x.new_ones(1, 6) + x.new_zeros(4, 1),
            x + A.scalar_tensor(2.0),
            x + torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]),
            x + B6,
            torch.ones(2, 3),
        ),
        (x46,),
    ),
    "tril_triu": Case(
        lambda x: (
            x * torch.tril(torch.ones(4, 6), diagonal=1),
            x * torch.triu(torch.ones(4, 6), diagonal=-1),
            x.masked_fill(torch.triu(torch.ones(4, 6, dtype=torch.bool), 2), 0.0),
            x.tril(-1) + x.triu(2),
            torch.ones(4, 6).tril() == 0,
        ),
        (x46,),
    ),
    "arange": Case(
        lambda x: (
            x + torch.arange(6),
            x * torch.arange(1, 7),
            torch.arange(0, 12, 2) + x,
            torch.arange(0.0, 1.5, 0.25, dtype=torch.float32) * x,
            torch.arange(4)[:, None] >= torch.arange(6)[None, :],
            torch.arange(2, 8)[None] < torch.arange(3, 7)[:, None] + 2,
        ),
        (x46,),
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_ops_evaluate_like_torch(case: str) -> None:
    spec = CASES[case]
    capture(spec.fn, *(make() for make in spec.inputs), tol=spec.tol)


def _ran_ops(fn: Callable, *examples: torch.Tensor) -> set[str]:
    """The ATen ops (``aten.name`` and ``aten.name.overload``) torch.export records for ``fn``."""
    module = fn if isinstance(fn, nn.Module) else type("Wrap", (nn.Module,), {"forward": lambda self, *a: fn(*a)})()
    program = torch.export.export(module, examples, strict=False)
    ran = set()
    for node in program.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op == "call_function" and schema is not None:
            base = schema.name.removeprefix("aten::")
            ran |= {f"aten.{base}", f"aten.{base}.{node.target._overloadname}"}
    return ran


def test_every_supported_op_is_exercised_by_a_test() -> None:
    ran: set[str] = set()
    for spec in CASES.values():
        ran |= _ran_ops(spec.fn, *(make() for make in spec.inputs))
    for make, shape in MODELS.values():
        ran |= _ran_ops(make().eval(), randn(*shape))
    for mask in MASK_SPELLINGS:
        ran |= _ran_ops(CausalSelfAttention(32, 4, 16, mask).eval(), randn(2, 8, 32))
    ran |= _ran_ops(_sdpa_cpu_backward(True), *_sdpa_backward_examples(torch.float32))
    # SDPA's CUDA kernels trace only on CUDA tensors: their lowering is the CPU kernel's (tested
    # above), and the backend's GPU tests run them
    cuda_only = {f"aten.{name}" for name in (*SDPA_KERNELS, *SDPA_BACKWARD_KERNELS) if "_for_cpu" not in name}
    missing = set(supported_ops()) - ran - cuda_only
    assert not missing, f"supported ops without a test: {sorted(missing)}"


def test_smooth_activations_keep_their_relative_precision_from_1e_6_to_30() -> None:
    """``expm1``, ``log1p`` and the activations built on them (softplus past and below its threshold, mish, ELU,
    SELU, CELU, log-sigmoid) match torch in float64 to 1e-8 of each value (and 1e-14 absolute: mish(−30) is
    −2.8e-12, its tanh of 9e-14 taken as 1 − 2/(e^{2x} + 1)), on values of either sign from 1e-6 to 30 in
    magnitude. Near 0 both branches are checked: the Taylor series taken there (where, in the kernels' fp32,
    ``e^x − 1`` and ``ln(1 + x)`` would lose the value to cancellation) and the closed forms past it."""
    magnitudes = torch.logspace(-6, math.log10(30.0), 24)
    w = (magnitudes * torch.tensor([1.0, -1.0]).repeat(12)).view(4, 6)
    g = ck.from_torch(SMOOTH_ACTIVATIONS, w)
    got = ck.evaluate(g, g.example_inputs())
    for i, ref in enumerate(SMOOTH_ACTIVATIONS(w.double())):
        np.testing.assert_allclose(got[f"out{i}"], ref.numpy(), rtol=1e-8, atol=1e-14, err_msg=f"output {i}")


# ----------------------------------------------------------------------------- stepped slices


def rotate_interleaved(x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
    """The interleaved rotary embedding of Cohere, GPT-J and CodeGen: each pair ``(x[2i], x[2i+1])``
    rotated by ``sin`` and ``cos``."""
    return torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).flatten(-2) * sin + x * cos


def assert_float64_like_torch(fn: Callable, *examples: torch.Tensor) -> ck.Graph:
    """Capture ``fn`` (primitives only) and check that the graph's float64 values are ``fn``'s on
    the examples in float64, to 1e-12."""
    g = ck.from_torch(fn, *examples)
    assert set(g.ops()) <= ck.PRIMITIVES
    with torch.no_grad():
        refs = leaves(fn(*(x.double() for x in examples)))
    got = ck.evaluate(g, g.example_inputs())
    names = ["out"] if len(refs) == 1 else [f"out{i}" for i in range(len(refs))]
    for name, ref in zip(names, refs):
        assert_matches(got[name], ref, tol=1e-12)
    return g


def test_stepped_slices_and_an_interleaved_rotary_embedding_evaluate_like_torch() -> None:
    """``x[..., ::2]``, ``x[..., 1::2]`` and ``x[:, 1:7:3]`` on axes no multiple of the step (9 and
    5: the unit slice under the step is padded past the end), and the interleaved rotary embedding
    built from them, lower to views (and the rotary's arithmetic) and match torch in float64."""

    def stepped(x: torch.Tensor, y: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> tuple:
        return x[..., ::2], x[..., 1::2], x[:, 1:7:3], x[-1, :, -7::4], rotate_interleaved(y, sin, cos)

    g = assert_float64_like_torch(stepped, randn(2, 5, 9), randn(2, 5, 8, seed=1), randn(5, 8, seed=2),
                                  randn(5, 8, seed=3))  # fmt: skip
    assert set(g.ops()) <= {"input", "reshape", "slice", "pad", "expand", "cat", "neg", "mul", "add"}


def test_a_stepped_slice_gradient_evaluates_like_torch_autograd() -> None:
    """The backward graph of an interleaved rotary embedding and a stepped slice (``make_fx`` of
    ``torch.func.vjp``: ``slice_backward`` with steps 2 and 3, one cut past the axis end) matches
    ``torch.autograd.grad`` in float64."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def outputs(x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rotate_interleaved(x, sin, cos), x[:, 1:7:3]

    def gradient(x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor, g0: torch.Tensor, g1: torch.Tensor):
        return torch.func.vjp(lambda x: outputs(x, sin, cos), x)[1]((g0, g1))[0]

    examples = [randn(2, 5, 8), randn(5, 8, seed=1), randn(5, 8, seed=2), randn(2, 5, 8, seed=3),
                randn(2, 2, 8, seed=4)]  # fmt: skip
    traced = make_fx(gradient)(*examples)
    steps = [n.args[5] for n in traced.graph.nodes if n.target is A.slice_backward.default]
    assert sorted(steps) == [2, 2, 3]
    g = ck.from_torch(traced, *examples)
    assert set(g.ops()) <= ck.PRIMITIVES
    x, sin, cos, g0, g1 = (e.double().requires_grad_(e is examples[0]) for e in examples)
    (expected,) = torch.autograd.grad(outputs(x, sin, cos), x, (g0, g1))
    assert_matches(ck.evaluate(g, g.example_inputs())["out"], expected, tol=1e-12)


# ----------------------------------------------------------------------------- names


def test_sanitize_name() -> None:
    assert sanitize_name("x.1") == "x_1"
    assert sanitize_name("attn.c_attn.weight".replace(".", "_")) == "attn_c_attn_weight"
    assert sanitize_name("0.weight") == "_0_weight"
    assert sanitize_name("a b-c") == "a_b_c"
    assert sanitize_name("") == "_"
    taken = {"w"}
    assert sanitize_name("w", taken) == "w_2" and sanitize_name("w", taken) == "w_3"
    long = sanitize_name("p" * 100)
    assert len(long) <= 64 and long != sanitize_name("p" * 99)


class Named(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict({"block-1": nn.Linear(4, 4)})
        self.weight = nn.Parameter(torch.full((4,), 0.5))
        self.register_buffer("scale 1", torch.linspace(1, 2, 4))
        self.register_buffer("unused", torch.zeros(3, dtype=torch.int64))
        self.seq = nn.Sequential(nn.Linear(4, 4))

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.blocks["block-1"](x) * getattr(self, "scale 1") + self.seq(x) * self.weight + weight


def test_input_names_are_sanitised_unique_and_ordered() -> None:
    g = capture(Named().eval(), randn(2, 4), randn(4, seed=1))
    assert list(g.inputs) == [
        "x",
        "weight",
        "weight_2",
        "blocks_block_1_weight",
        "blocks_block_1_bias",
        "seq_0_weight",
        "seq_0_bias",
        "scale_1",
    ]
    assert all(ck.graph.shape.check_identifier("t", n) for n in g.inputs)


def test_function_arguments_and_closure_constants_are_named() -> None:
    table = randn(6, 3, seed=3)

    def project(tokens, scale):
        return (tokens @ table) * scale

    g = capture(project, randn(4, 6), randn(3, seed=1))
    assert list(g.inputs)[:2] == ["tokens", "scale"] and len(g.inputs) == 3
    assert g.name == "project"
    g = capture(lambda *parts: parts[0] + parts[1], randn(3), randn(3, seed=1))
    assert list(g.inputs) == ["parts_0", "parts_1"]


def test_several_outputs_and_fp16_inputs() -> None:
    halves = randn(3, dtype=torch.float16), randn(3, seed=1, dtype=torch.float16)
    g = capture(lambda a, b: (a + b, a * b), *halves, tol=1e-3)  # torch rounds each op to fp16
    assert list(g.outputs) == ["out0", "out1"] and g.inputs["a"].dtype == "fp16"
    assert g.outputs["out0"].dtype == "fp16"


# ----------------------------------------------------------------------------- errors


class Cumulative(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.cumprod(0)


def test_unsupported_op_names_the_op_its_line_and_what_is_supported() -> None:
    def running_total(x):
        return torch.cumprod(x, 0) * 2

    with pytest.raises(ck.GraphError) as error:
        ck.from_torch(running_total, randn(4))
    message = str(error.value)
    assert "aten.cumprod" in message and "test_torch_capture.py" in message and "running_total" in message
    assert "aten.softmax" in message and "aten.scaled_dot_product_attention" in message
    # in a module, the exact line of forward
    with pytest.raises(ck.GraphError, match=r"aten\.cumprod\.default at .*test_torch_capture.py:\d+ in forward"):
        ck.from_torch(Cumulative(), randn(4))


@pytest.mark.parametrize(
    "fn, examples, words",
    [
        (lambda x: x * 2, (torch.ones(3, dtype=torch.float64),), ("argument 'x'", "torch.float64", "fp32")),
        (lambda x: x.double() * 2, (torch.ones(3),), ("float64",)),
        (lambda x: x + 1, (torch.ones(3, dtype=torch.int64),), ("int64", "backend=\"cherenkov\"")),
        (lambda x: x * 2, (3.0,), ("example argument 0", "tensors only")),
        (lambda x: F.dropout(x, 0.5, training=True), (torch.ones(3),), ("dropout", "eval")),
        (
            lambda q: F.scaled_dot_product_attention(q, q, q, dropout_p=0.1),
            (torch.ones(1, 2, 3, 4),),
            ("dropout_p", "eval mode"),
        ),
        (lambda x: torch.zeros(2, 3).scatter(1, torch.arange(2).expand(2, 2), x), (torch.ones(2, 2),),
         ("scatter", "(2, 2)", "one index a slice")),
        (lambda x: x[:, 3:1] + 1, (torch.ones(2, 4),), ("slice [3:1]", "empty")),
        (lambda x: torch.div(x, 2, rounding_mode="trunc"), (torch.ones(2),), ("rounding_mode",)),
        (lambda x: torch.diff(x, n=2), (torch.ones(4),), ("diff with n=2", "valid: n=1")),
        (lambda x: torch.cos(x) if x.sum() > 0 else x, (torch.ones(2),), ("torch.export",)),
        (lambda x: torch.linalg.vector_norm(x, 0), (torch.ones(2, 3),), ("linalg_vector_norm", "ord=0", "(2, 3)")),
    ],
    ids=[
        "fp64_input",
        "fp64_cast",
        "int_input",
        "scalar_example",
        "train_dropout",
        "sdpa_dropout",
        "scatter_of_two",
        "empty_slice",
        "trunc_div",
        "second_diff",
        "data_dependent",
        "zero_norm",
    ],
)
def test_capture_errors_say_what_is_wrong(fn: Callable, examples: tuple, words: tuple[str, ...]) -> None:
    with pytest.raises(ck.GraphError) as error:
        ck.from_torch(fn, *examples)
    for word in words:
        assert word in str(error.value), (word, str(error.value))


class Counting(nn.Module):
    def __init__(self, mutate: bool) -> None:
        super().__init__()
        self.mutate = mutate
        self.register_buffer("counts", torch.arange(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mutate:
            self.counts.add_(1)
            return x * 2
        return x * self.counts


@pytest.mark.parametrize("mutate, words", [(False, ("buffer 'counts'", "torch.int64")), (True, ("mutates",))])
def test_integer_buffers_and_mutation_are_refused(mutate: bool, words: tuple[str, ...]) -> None:
    with pytest.raises(ck.GraphError) as error:
        ck.from_torch(Counting(mutate), randn(4))
    for word in words:
        assert word in str(error.value)


def test_unused_integer_buffers_are_not_inputs() -> None:
    g = ck.from_torch(Named().eval(), randn(2, 4), randn(4, seed=1))
    assert "unused" not in g.inputs


def _sdpa_cpu_backward(causal: bool) -> Callable:
    """SDPA's CPU backward kernel as a function of (grad_out, q, k, v, out, lse), scale 0.2."""

    def gradients(grad_out, q, k, v, out, lse):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, causal, scale=0.2
        )

    return gradients


def _sdpa_backward_examples(dtype: torch.dtype, causal: bool = True) -> list[torch.Tensor]:
    """Inputs of :func:`_sdpa_cpu_backward`: the forward kernel's own output and log-sum-exp."""
    q, k, v, grad_out = (randn(2, 4, 24, 32, seed=s, dtype=dtype) for s in range(4))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=0.2)
    return [grad_out, q, k, v, out, lse]


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_backward_kernel_is_the_attention_gradient_and_derives_the_flash_backward(causal: bool) -> None:
    """A training graph's SDPA backward (what AOTAutograd records) lowers to the attention's
    vector-Jacobian product, recomputed from q, k and v: it matches torch's backward kernel (which
    reads the forward's output and log-sum-exp), and the derivation fuses it into a flash backward."""
    gradients = _sdpa_cpu_backward(causal)
    g = capture(gradients, *_sdpa_backward_examples(torch.float32, causal), tol=1e-5)
    read = {i for node in g.nodes for i in node.inputs}
    assert g.is_gradient and g.inputs["out"].id not in read and g.inputs["lse"].id not in read  # recomputed
    derivation = ck.derive(ck.from_torch(gradients, *_sdpa_backward_examples(torch.bfloat16, causal)))
    plans = derivation.plans("sm_90")
    assert plans and {p.kind for p in plans} == {"flash_attention_backward"}
    assert all(p.problem.attention.causal == causal and p.problem.roles == ("dq", "dk", "dv") for p in plans)
    # the forward's output and log-sum-exp are saved inputs: half the schedules read them instead of recomputing
    assert set(derivation.graph.saved) == {"out", "lse"}
    saved = [p for p in plans if p.schedule.saved_statistics]
    assert saved and len(saved) * 2 == len(plans)
    assert {(p.problem.saved.o, p.problem.saved.lse) for p in saved} == {("out", "lse")}


def test_the_cuda_flash_kernels_causal_flag_is_aligned_to_the_last_key() -> None:
    """FlashAttention-2's CUDA kernel (``_scaled_dot_product_flash_attention``, which PyTorch's ``causal_lower_right``
    calls for a chunk after cached keys) masks ``is_causal`` against the last key: 4 queries after 5 cached keys see
    keys ``j ≤ i + 5``, and the derivation gives flash attention over that band (the kernels' window, 5 ahead). The
    CPU kernel's flag, as SDPA's, is aligned to the first key. (Traced on the CPU: torch.export needs only the op's
    shapes; the GPU test runs the kernel.)"""
    q, k, v = randn(1, 2, 4, 16), randn(1, 2, 9, 16, seed=1), randn(1, 2, 9, 16, seed=2)
    references = {
        torch.ops.aten._scaled_dot_product_flash_attention: torch.ones(4, 9, dtype=torch.bool).tril(5),
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: torch.ones(4, 9, dtype=torch.bool).tril(0),
    }
    for kernel, mask in references.items():
        g = ck.from_torch(lambda q, k, v, kernel=kernel: kernel(q, k, v, 0.0, True)[0], q, k, v)
        expected = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
        assert_matches(ck.evaluate(g, g.example_inputs())["out"], expected, tol=1e-12)
    bf16 = [x.to(torch.bfloat16) for x in (q, k, v)]
    derived = ck.derive(ck.from_torch(lambda q, k, v: torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, True)[0], *bf16))  # fmt: skip
    assert {(p.problem.window, p.problem.window_ahead, p.problem.causal) for p in derived.plans("sm_90a")} == {
        (13, 5, False)}


def test_sdpa_backward_kernels_lower_without_dropout_or_packed_sequences() -> None:
    """``lowers_node`` on cuDNN backward calls: a dense attention's sequence offsets are empty
    tensors (lowered, with a bias too: the Dynamo split decides on masks); non-empty offsets
    (packed sequences) or dropout keep it ATen."""
    from torch.fx import Graph

    from cherenkov.graph.torch_capture import lowers_node

    def call(offsets: torch.Tensor, bias: bool = False, dropout: float = 0.0):
        graph = Graph()
        tensors = {name: graph.placeholder(name) for name in ("do", "q", "k", "v", "o", "lse", "seed", "off", "cum")}
        tensors["cum"].meta["val"] = offsets
        return graph.call_function(torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default, (
            tensors["do"], tensors["q"], tensors["k"], tensors["v"], tensors["o"], tensors["lse"], tensors["seed"],
            tensors["off"], tensors["q"] if bias else None, tensors["cum"], tensors["cum"], 64, 64, dropout, True))

    empty = torch.empty(0, dtype=torch.int32)
    assert lowers_node(call(empty))
    assert not lowers_node(call(torch.tensor([0, 64, 128], dtype=torch.int32)))
    assert lowers_node(call(empty, bias=True)) and not lowers_node(call(empty, dropout=0.1))


def test_a_batched_product_of_a_transposed_operand_transposed_back_is_taken_unmerged() -> None:
    """A backward's ``bmm`` over batch·heads reads a transposed operand's transpose (dq = dS·k with
    ``k`` the forward's ``kᵀ`` transposed again): the capture takes the product of the unmerged
    tensors, as for the forward's products, so the contraction sums over one axis of 4-D operands."""

    def product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        kt = b.reshape(8, 7, 5).transpose(1, 2)
        return torch.bmm(a.reshape(8, 6, 7), kt.transpose(1, 2)).view(2, 4, 6, 5)

    g = capture(product, randn(2, 4, 6, 7), randn(2, 4, 7, 5, seed=1))
    (reduction,) = [node for node in g.nodes if node.op == "sum_reduce"]
    assert len(g.node(reduction.inputs[0]).shape) == 5, "batch, heads, rows, columns and the summed axis"
