"""Modules nobody here wrote, as users bring them: transformers' Llama attention (its SDPA
and eager paths) and decoder layer, timm's ViT block, and nanoGPT's causal self-attention
(the forward of Karpathy's ``model.py``, which is not a package). Each builder returns the
module and its example inputs at a small size (CPU tests) or a real one (GPU tests and
``benchmarks/models.py``). Whole language models (:func:`gpt2_lm`, :func:`llama_lm`) are
built the same way for the ``torch.compile`` backend: random weights, eval mode."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RealModule:
    """One module and how to call it: ``module(*inputs)``; ``causal`` when its attention is."""

    name: str
    module: Any
    inputs: tuple[Any, ...]
    causal: bool


def first_output(inner: Any, call: Callable[..., Any]) -> Any:
    """A module calling ``call(inner, *args)`` and returning its first tensor (transformers'
    modules return tuples)."""
    import torch

    class FirstOutput(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, *args):
            out = call(self.inner, *args)
            return out[0] if isinstance(out, tuple) else out

    return FirstOutput().eval()


def llama_config(small: bool, implementation: str):
    from transformers import LlamaConfig

    dims = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=512)
    if not small:  # Llama-3-8B
        dims = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                    intermediate_size=14336)  # fmt: skip
    config = LlamaConfig(num_hidden_layers=1, **dims)
    config._attn_implementation = implementation
    return config


def _rope_inputs(config, batch: int, seq: int, dtype, device: str) -> tuple[Any, Any, Any]:
    import torch
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    x = torch.randn(batch, seq, config.hidden_size, dtype=dtype, device=device)
    cos, sin = LlamaRotaryEmbedding(config).to(device)(x, torch.arange(seq, device=device)[None])
    return x, cos.to(dtype), sin.to(dtype)


def llama_attention(implementation: str = "sdpa", small: bool = True, batch: int = 2, seq: int = 64,
                    dtype: Any = None, device: str = "cpu") -> RealModule:  # fmt: skip
    """``LlamaAttention`` called as the decoder layer calls it (no mask: the SDPA path is
    causal, the eager path is not)."""
    import torch
    from transformers.models.llama.modeling_llama import LlamaAttention

    dtype = dtype or torch.float32
    config = llama_config(small, implementation)
    attention = LlamaAttention(config, layer_idx=0).to(device, dtype).eval()
    module = first_output(attention, lambda m, x, cos, sin: m(x, (cos, sin), attention_mask=None))
    return RealModule(f"LlamaAttention[{implementation}]", module, _rope_inputs(config, batch, seq, dtype, device),
                      causal=implementation == "sdpa")  # fmt: skip


def llama_decoder_layer(small: bool = True, batch: int = 2, seq: int = 64, dtype: Any = None,
                        device: str = "cpu") -> RealModule:  # fmt: skip
    """``LlamaDecoderLayer`` (RMSNorm, attention, SwiGLU MLP, residuals) on the SDPA path."""
    import torch
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    dtype = dtype or torch.float32
    config = llama_config(small, "sdpa")
    layer = LlamaDecoderLayer(config, layer_idx=0).to(device, dtype).eval()
    module = first_output(layer, lambda m, x, cos, sin: m(x, position_embeddings=(cos, sin), attention_mask=None))
    return RealModule("LlamaDecoderLayer", module, _rope_inputs(config, batch, seq, dtype, device), causal=True)


def vit_block(small: bool = True, batch: int = 4, dtype: Any = None, device: str = "cpu") -> RealModule:
    """timm's ViT ``Block`` (ViT-B/16: width 768, 12 heads, 197 tokens)."""
    import torch
    from timm.models.vision_transformer import Block

    dtype = dtype or torch.float32
    width, heads, tokens = (128, 2, 17) if small else (768, 12, 197)
    block = Block(width, heads).to(device, dtype).eval()
    x = torch.randn(batch, tokens, width, dtype=dtype, device=device)
    return RealModule("timm ViT Block", block, (x,), causal=False)


def nanogpt_attention(small: bool = True, batch: int = 2, dtype: Any = None, device: str = "cpu",
                      dims: tuple[int, int, int] | None = None) -> RealModule:  # fmt: skip
    """nanoGPT's ``CausalSelfAttention`` (GPT-2 small: d 768, 12 heads, T 1024; ``dims``
    overrides width, heads and tokens), its manual path: a ``tril`` buffer,
    ``masked_fill``, softmax, ``@ v``."""
    import torch
    from torch import nn
    from torch.nn import functional

    width, heads, tokens = dims or ((128, 2, 64) if small else (768, 12, 1024))

    class CausalSelfAttention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c_attn, self.c_proj, self.n_head = nn.Linear(width, 3 * width), nn.Linear(width, width), heads
            self.register_buffer("bias", torch.tril(torch.ones(tokens, tokens)).view(1, 1, tokens, tokens))

        def forward(self, x):
            b, t, c = x.size()
            q, k, v = self.c_attn(x).split(c, dim=2)
            q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = functional.softmax(att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf")), dim=-1)
            return self.c_proj((att @ v).transpose(1, 2).contiguous().view(b, t, c))

    dtype = dtype or torch.float32
    module = CausalSelfAttention().to(device, dtype).eval()
    x = torch.randn(batch, tokens, width, dtype=dtype, device=device)
    return RealModule("nanoGPT CausalSelfAttention", module, (x,), causal=True)


BUILDERS: dict[str, Callable[..., RealModule]] = {
    "llama_attention_sdpa": lambda **kw: llama_attention("sdpa", **kw),
    "llama_attention_eager": lambda **kw: llama_attention("eager", **kw),
    "llama_decoder_layer": llama_decoder_layer,
    "vit_block": vit_block,
    "nanogpt_attention": nanogpt_attention,
}


# ------------------------------------------------------------------ whole models


def gpt2_lm(small: bool = True, dtype: Any = None, device: str = "cpu", layers: int | None = None) -> Any:
    """transformers' ``GPT2LMHeadModel`` (SDPA attention, as it ships): GPT-2 small (12 layers,
    d 768, 12 heads, vocab 50257) or a 2-layer d-64 model with a 128-token vocabulary."""
    import torch
    import transformers

    dims = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=128)
    if not small:
        dims = dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257)
    if layers is not None:
        dims["n_layer"] = layers
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_positions=1024, attn_implementation="sdpa", **dims)
    return transformers.GPT2LMHeadModel(config).eval().to(device=device, dtype=dtype or torch.float32)


def gpt2_blocks(layers: int = 2, implementation: str = "sdpa", batch: int = 2, seq: int = 64, dtype: Any = None,
                device: str = "cpu") -> RealModule:  # fmt: skip
    """The transformer blocks, final norm and LM head of a ``GPT2LMHeadModel`` (width 128, 2 heads
    of 64, vocabulary 128) called on token embeddings: a whole model's layers with a float input."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_positions=1024, n_layer=layers, n_embd=128, n_head=2, vocab_size=128,
                                     attn_implementation=implementation)  # fmt: skip
    model = transformers.GPT2LMHeadModel(config).eval().to(device=device, dtype=dtype or torch.float32)

    class Blocks(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, x):
            for block in self.model.transformer.h:
                out = block(x)
                x = out[0] if isinstance(out, tuple) else out
            return self.model.lm_head(self.model.transformer.ln_f(x))

    x = torch.randn(batch, seq, 128, dtype=dtype or torch.float32, device=device)
    return RealModule(f"GPT2Blocks[{layers}, {implementation}]", Blocks().eval(), (x,), causal=True)


def llama_lm(small: bool = True, dtype: Any = None, device: str = "cpu") -> Any:
    """transformers' ``LlamaForCausalLM``: 4 layers, hidden 2048, 16 query / 4 KV heads of 128,
    SwiGLU 5632, vocab 32000 (the PyTorch-integration issue's model), or 2 layers of hidden 64
    (4 / 2 heads of 16) with a 256-token vocabulary."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    dims = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                intermediate_size=128, vocab_size=256)  # fmt: skip
    if not small:
        dims = dict(num_hidden_layers=4, hidden_size=2048, num_attention_heads=16, num_key_value_heads=4,
                    head_dim=128, intermediate_size=5632, vocab_size=32000)  # fmt: skip
    torch.manual_seed(0)
    config = LlamaConfig(max_position_embeddings=2048, attn_implementation="sdpa", **dims)
    return LlamaForCausalLM(config).eval().to(device=device, dtype=dtype or torch.float32)
