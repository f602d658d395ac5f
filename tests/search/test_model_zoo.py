"""Model families nobody here wrote, through the ``torch.compile`` backend on the CPU: tiny
transformers configs of the LMs, encoders and vision towers users bring (Qwen2, Qwen3, Mistral with
and without its sliding window, Gemma at head dim 256, Gemma 3's sliding and full layers, Phi-3,
Cohere's interleaved rotary embedding (and GPT-J's), Falcon, Mixtral's experts, DeepSeek-V3's latent
attention (its query and key heads assembled in place, head dims 48 and 32), Bloom's and MPT's ALiBi,
XGLM's clamped causal mask, GPT-Neo's causal and windowed masks from its own buffers (ImageGPT's too), GPT-OSS's attention sinks,
DiffLlama's two attentions sharing their softmax, Doge's dynamic mask, GPT-1's mask as a product with its band, BERT with a padding mask, BART, MBart building its decoder's ids, ModernBERT's local and global layers,
CLIP's vision tower, Swin's windows, T5's encoder with its relative position bias, Whisper's encoder).
Each runs like eager in bf16, and each of its attention layers derives one flash-attention kernel on
sm_90a, Gemma 2's soft-capped scores (``c·tanh(s/c)``; on its sliding layers under a window too), Bloom's ALiBi (a computed bias, under the
causal mask) and a sliding window (the causal mask, and the window the kernel's own key range)
included. timm's EVA-02, Swin, Swin V2 (cosine attention), BEiT and MaxViT classifiers run like eager too, on
flash kernels. Thirty of them also train
a step like eager, a flash backward an attention layer (those with dropout or stochastic depth with it
off; BERT's padded SDPA backward stays torch's, GPT-OSS's through its sinks runs unfused; Swin's writes dv alone, its dq and dk read the score
gradient its relative-position bias's gradient stores; DeepSeek-V3's backward through the slice writes
that assemble its query and key;
ModernBERT also through cuDNN's SDPA kernels, as a GPU's trace records them, given CPU implementations),
and four decode greedily with eager's tokens. On a GPU, XGLM, Mistral with a window, GPT-OSS, DiffLlama and Apertus
run like eager at width 1024."""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from typing import Any

import pytest

import cherenkov as ck

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("real_modules")

from cherenkov.search.dynamo import compile_regions  # noqa: E402
from test_dynamo import recorded_splits, searched_results  # noqa: E402

TOKENS = (2, 64)
DECODER = dict(num_hidden_layers=1, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=128, vocab_size=256)  # fmt: skip


def _token_ids() -> dict[str, Any]:
    return {"input_ids": torch.randint(0, 256, TOKENS)}


def _decoder(model: str, config: str, **overrides: Any) -> Callable[[], tuple[Any, dict[str, Any]]]:
    def build() -> tuple[Any, dict[str, Any]]:
        return getattr(transformers, model)(getattr(transformers, config)(**{**DECODER, **overrides})), _token_ids()

    return build


def _bert_padded() -> tuple[Any, dict[str, Any]]:
    config = transformers.BertConfig(num_hidden_layers=1, hidden_size=128, num_attention_heads=4,
                                     intermediate_size=128, vocab_size=256, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)  # no dropout: a training step is eager's  # fmt: skip
    mask = torch.cat([torch.ones(2, 48, dtype=torch.long), torch.zeros(2, 16, dtype=torch.long)], 1)
    return transformers.BertModel(config), {**_token_ids(), "attention_mask": mask}


def _clip_vision() -> tuple[Any, dict[str, Any]]:
    config = transformers.CLIPVisionConfig(num_hidden_layers=1, hidden_size=128, num_attention_heads=4,
                                           intermediate_size=128, image_size=64, patch_size=8)  # fmt: skip
    return transformers.CLIPVisionModel(config), {"pixel_values": torch.randn(2, 3, 64, 64)}


def _t5_encoder() -> tuple[Any, dict[str, Any]]:
    config = transformers.T5Config(num_layers=1, d_model=128, num_heads=4, d_kv=32, d_ff=128, vocab_size=256,
                                   dropout_rate=0.0)  # no dropout: a training step's gradients are then eager's
    return transformers.T5EncoderModel(config), _token_ids()


def _whisper_encoder() -> tuple[Any, dict[str, Any]]:
    config = transformers.WhisperConfig(encoder_layers=1, decoder_layers=1, d_model=128, encoder_attention_heads=4,
                                        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                                        num_mel_bins=16, max_source_positions=32, vocab_size=256, pad_token_id=0,
                                        bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)  # fmt: skip
    return transformers.WhisperModel(config).encoder, {"input_features": torch.randn(2, 16, 64)}


def _bart() -> tuple[Any, dict[str, Any]]:
    config = transformers.BartConfig(encoder_layers=1, decoder_layers=1, d_model=128, encoder_attention_heads=4,
                                     decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=256,
                                     dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)  # fmt: skip
    return transformers.BartModel(config), _token_ids()  # no dropout: a training step's gradients are then eager's


def _mbart() -> tuple[Any, dict[str, Any]]:
    """MBart given input ids alone: it builds its decoder's from them, reading each row's last token that is
    no padding through an index computed from the ids (``ne(pad).sum(1) - 1``)."""
    config = transformers.MBartConfig(encoder_layers=1, decoder_layers=1, d_model=128, encoder_attention_heads=4,
                                      decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=256,
                                      max_position_embeddings=128, dropout=0.0, attention_dropout=0.0,
                                      activation_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
    return transformers.MBartModel(config), _token_ids()


def _swin() -> tuple[Any, dict[str, Any]]:
    # head dim 32 as Swin-T's (no backward plans head dim 16); no stochastic depth, whose random draws differ from eager's
    config = transformers.SwinConfig(image_size=64, patch_size=4, embed_dim=64, depths=[1, 1], num_heads=[2, 4],
                                     window_size=4, drop_path_rate=0.0)  # fmt: skip
    return transformers.SwinModel(config), {"pixel_values": torch.randn(2, 3, 64, 64)}


def _modernbert() -> tuple[Any, dict[str, Any]]:
    config = transformers.ModernBertConfig(num_hidden_layers=2, hidden_size=128, num_attention_heads=4,
                                           intermediate_size=128, vocab_size=256, pad_token_id=0,
                                           global_attn_every_n_layers=2, local_attention=16)  # fmt: skip
    return transformers.ModernBertModel(config), _token_ids()


FAMILIES: dict[str, tuple[Callable[[], tuple[Any, dict[str, Any]]], int]] = {
    # name: (model and inputs, flash-attention kernels its regions derive)
    "qwen2": (_decoder("Qwen2ForCausalLM", "Qwen2Config"), 1),
    "qwen3": (_decoder("Qwen3ForCausalLM", "Qwen3Config", head_dim=32), 1),
    "mistral": (_decoder("MistralForCausalLM", "MistralConfig", sliding_window=None), 1),
    # a window of 16 keys over 64 tokens: the causal mask, and the window the kernel's own key range (no stored edge)
    "mistral_window": (_decoder("MistralForCausalLM", "MistralConfig", sliding_window=16), 1),
    "gemma_d256": (_decoder("GemmaForCausalLM", "GemmaConfig", head_dim=256), 1),
    "gemma3_sliding_and_full": (_decoder("Gemma3ForCausalLM", "Gemma3TextConfig", head_dim=64, num_hidden_layers=2,
                                         sliding_window=16, layer_types=["sliding_attention", "full_attention"]), 2),
    "gemma2_softcap": (_decoder("Gemma2ForCausalLM", "Gemma2Config", head_dim=64), 1),
    # its sliding layer with a window of 16 keys over 64 tokens: the capped scores under the kernel's window
    "gemma2_window": (_decoder("Gemma2ForCausalLM", "Gemma2Config", head_dim=64, sliding_window=16), 1),
    "gemma_mqa": (_decoder("GemmaForCausalLM", "GemmaConfig", num_key_value_heads=1, head_dim=64), 1),  # Gemma 2B's MQA
    "falcon_mqa": (lambda: (transformers.FalconForCausalLM(transformers.FalconConfig(
        num_hidden_layers=1, hidden_size=128, num_attention_heads=4, vocab_size=256, multi_query=True,
        new_decoder_architecture=False)), _token_ids()), 1),  # Falcon-7B's one K/V head
    "gpt_bigcode_mqa": (lambda: (transformers.GPTBigCodeForCausalLM(transformers.GPTBigCodeConfig(
        n_layer=1, n_embd=128, n_head=4, vocab_size=256, n_positions=128, multi_query=True, bos_token_id=0,
        eos_token_id=0, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)), _token_ids()), 1),  # StarCoder's
    "phi3": (_decoder("Phi3ForCausalLM", "Phi3Config", pad_token_id=0, bos_token_id=1, eos_token_id=2), 1),
    "cohere_interleaved_rotary": (_decoder("CohereForCausalLM", "CohereConfig"), 1),
    "falcon": (_decoder("FalconForCausalLM", "FalconConfig", new_decoder_architecture=True, num_kv_heads=2), 1),
    "mixtral_moe": (_decoder("MixtralForCausalLM", "MixtralConfig", num_local_experts=4, num_experts_per_tok=2), 1),
    "deepseek_v3_mla": (_decoder("DeepseekV3ForCausalLM", "DeepseekV3Config", num_key_value_heads=4, kv_lora_rank=32,
                                 q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
                                 n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                 first_k_dense_replace=1, n_group=1, topk_group=1), 1),
    "gptj": (_decoder("GPTJForCausalLM", "GPTJConfig", n_layer=1, n_embd=128, n_head=4, rotary_dim=16,
                      n_positions=128), 1),
    # ALiBi's bias, rounded to bf16, stored in fp32 by an elementwise kernel; the causal tiles skipped
    "bloom_alibi": (_decoder("BloomForCausalLM", "BloomConfig", n_layer=1, n_head=4), 1),
    # MPT's ALiBi, a stored bias under its causal masked_fill (a finite minimum, a folded bool band)
    "mpt_alibi": (lambda: (transformers.MptForCausalLM(transformers.MptConfig(
        n_layers=1, d_model=128, n_heads=4, vocab_size=256, max_seq_len=128, expansion_ratio=1)), _token_ids()), 1),
    # XGLM's causal mask of finite minima, the masked scores clamped at bf16's lowest in fp32 and rounded back (no
    # dropout: a training step is eager's)
    "xglm_clamped_mask": (lambda: (transformers.XGLMForCausalLM(transformers.XGLMConfig(
        num_layers=1, d_model=128, attention_heads=4, ffn_dim=128, vocab_size=256, dropout=0.0,
        attention_dropout=0.0)), _token_ids()), 1),
    # GPT-Neo's causal and sliding-window masks: its own bool buffers (Dynamo's inputs, read as checked constants),
    # filling fp32 scores with a lifted finfo(float32).min
    "gpt_neo_buffer_masks": (lambda: (transformers.GPTNeoModel(transformers.GPTNeoConfig(
        num_layers=2, hidden_size=128, num_heads=4, vocab_size=256, max_position_embeddings=128, window_size=16,
        attention_types=[[["global", "local"], 1]], attention_dropout=0.0, embed_dropout=0.0, resid_dropout=0.0,
        bos_token_id=0, eos_token_id=0)), _token_ids()), 2),
    # ImageGPT's causal mask, its own bool buffer under transformers' additive one
    "imagegpt_buffer_mask": (lambda: (transformers.ImageGPTModel(transformers.ImageGPTConfig(
        n_layer=1, n_embd=128, n_head=4, vocab_size=257, n_positions=128, attn_pdrop=0.0, resid_pdrop=0.0,
        embd_pdrop=0.0)), _token_ids()), 1),
    # GPT-OSS's attention sinks (a learned logit a head, concatenated to the scores, softmaxed with them and
    # dropped) on a sliding and a full layer: flash attention times sigmoid(LSE - sink)
    "gpt_oss_sinks": (_decoder("GptOssForCausalLM", "GptOssConfig", num_hidden_layers=2, head_dim=32,
                               num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
                               layer_types=["sliding_attention", "full_attention"], attention_dropout=0.0), 2),
    # DiffLlama: two attentions sharing q, k and the mask, each v one K/V head repeated for all heads (so v reads one
    # head where k reads h // G), their outputs concatenated along the value dim; eagerly one softmax that two
    # products read: a flash kernel for each
    "diffllama_sdpa": (_decoder("DiffLlamaModel", "DiffLlamaConfig", attn_implementation="sdpa"), 2),
    "diffllama_eager": (_decoder("DiffLlamaModel", "DiffLlamaConfig", attn_implementation="eager"), 2),
    # Doge's dynamic mask: a bias per K/V head and key (from v) under its causal fill, read by the query heads at
    # h // G: stored per query head for the flash kernel
    "doge_dynamic_mask": (_decoder("DogeModel", "DogeConfig"), 1),
    # GPT-1: its scores times its causal buffer's 0/1 band plus −10⁴ where the band is 0 (w·b − 10⁴·(1 − b))
    "openai_gpt_band_product": (lambda: (transformers.OpenAIGPTModel(transformers.OpenAIGPTConfig(
        n_layer=1, n_embd=128, n_head=4, vocab_size=256, n_positions=128, attn_pdrop=0.0, resid_pdrop=0.0,
        embd_pdrop=0.0)), _token_ids()), 1),
    "bert_padded": (_bert_padded, 1),
    "bart": (_bart, 3),  # encoder, causal decoder and cross attention
    "mbart_shifted_ids": (_mbart, 3),
    "modernbert_local_and_global": (_modernbert, 2),
    "swin_windows": (_swin, 2),
    "clip_vision": (_clip_vision, 1),
    "t5_encoder": (_t5_encoder, 1),
    "whisper_encoder": (_whisper_encoder, 1),
}  # fmt: skip


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_model_family_runs_through_the_backend_like_eager_with_its_attention_fused(family: str) -> None:
    build, flash_kernels = FAMILIES[family]
    torch.manual_seed(0)
    model, inputs = build()
    model = model.to(torch.bfloat16).eval()
    inputs = {n: x.to(torch.bfloat16) if x.is_floating_point() else x for n, x in inputs.items()}
    with torch.no_grad():
        expected = model(**inputs)[0].float()
        with recorded_splits() as splits:
            compiled = torch.compile(model, backend=lambda gm, xs: compile_regions(gm, xs, fallback="eager"))
            got = compiled(**inputs)[0].float()
    error = float((got - expected).norm() / expected.norm())
    assert error < 2e-2, f"{family}: {error:.3g} from eager"
    derivations = [ck.derive(prepared.graph) for split in splits for region in split.compiled
                   for prepared in region.prepared.values()]  # fmt: skip
    kinds = collections.Counter(kernel.kind for d in derivations for kernel in d.kernels_for("sm_90a"))
    assert kinds["flash_attention"] == flash_kernels, f"{family}: {dict(kinds)}"
    if family in WINDOWED:  # the kernels' own windows, no bias tensor
        problems = {p.problem.out: p.problem for d in derivations for p in d.plans("sm_90a")}.values()
        assert sorted((p.window, p.window_ahead, p.bias is None) for p in problems) == WINDOWED[family], problems


WINDOWED = {"mistral_window": [(16, 0, True)], "gemma2_window": [(16, 0, True)],
            "gemma3_sliding_and_full": [(0, 0, True), (16, 0, True)],
            "modernbert_local_and_global": [(0, 0, True), (9, 8, True)],
            "gpt_neo_buffer_masks": [(0, 0, True), (16, 0, True)], "gpt_oss_sinks": [(0, 0, True), (16, 0, True)]}  # fmt: skip
"""Family: its attention layers' windows (keys, keys ahead), and whether each reads no bias tensor."""


CACHED = {"llama": [(80, 48, True)], "gemma2_softcap": [(80, 48, True)], "mistral_window": [(1, 15, True)],
          "gemma2_window": [(1, 15, True)], "gemma3_sliding_and_full": [(1, 15, True), (80, 48, True)],
          "gpt_bigcode_mqa": [(80, 48, True)], "xglm_clamped_mask": [(80, 48, True)],
          "bloom_alibi": [(80, 48, False)], "mpt_alibi": [(80, 48, False)]}  # fmt: skip
"""Family: its attention layers' (window, keys ahead, no bias tensor) for 16 new tokens after 48 cached ones (a
sliding window of 16 keeps 15 of them: the chunk's query ``i`` sees keys ``i ≤ j ≤ i + 15``; ALiBi's slopes are a
bias tensor beside the window)."""


@pytest.mark.parametrize("family", list(CACHED))
def test_a_chunk_after_cached_keys_is_flash_attention(family: str) -> None:
    """16 new tokens after 48 in the model's cache (a chunk of a long prompt, speculative decoding's drafts):
    transformers masks the chunk's scores causally against the last key (query i sees keys j ≤ i + 48). Like
    eager, with one flash kernel a layer: under that mask alone (Llama; Gemma 2's capped scores) a window over
    every key, 48 ahead, that the kernel bounds itself (rule ``keys-ahead-additive``, bias form ``-ahead``); under a
    sliding window's band too (Mistral's, Gemma 2's: its cache full, the window's lower edge ``j < i + 0`` folds to
    ``j < i``), a window about the query, one key behind and 15 ahead. Each was an unfused softmax before (Gemma 2's
    sliding one too: its capped scores had no form for the band), and the sliding ones then a stored bias. Gemma 3
    has both kinds of layer; GPT-BigCode's multi-query row is the axis the band reads; XGLM clamps its masked scores
    (rules ``*-finite-keys-ahead-clamped``); Bloom and MPT add ALiBi's slopes, which the kernel reads stored beside
    the window (rule ``keys-ahead-beside-bias``; no flash kernel before). Where the last query sees the
    last key the short-query schedules (the group's rows packed in a tile) plan it too."""
    derivations = _derived_after_cached_keys(family, 48)
    assert sum(k.kind == "flash_attention" for d in derivations for k in d.kernels_for("sm_90a")) == len(CACHED[family])
    problems = {p.problem for d in derivations for p in d.plans("sm_90a")}
    assert sorted((p.window, p.window_ahead, p.bias is None) for p in problems) == CACHED[family]
    assert {(p.seq_q, p.causal) for p in problems} == {(16, False)}  # a sliding cache holds the window's keys only
    if all(p.short_query_band and p.group_size > 1 for p in problems):  # packed GQA rows take that band
        assert any(p.schedule.pack_group for d in derivations for p in d.plans("sm_90a"))


DECODED = {"mpt_alibi": 1, "xglm_clamped_mask": 1, "gpt_oss_sinks": 2}
"""Family: its flash kernels decoding one token after its KV cache."""


@pytest.mark.parametrize("family", list(DECODED))
def test_a_token_decoded_after_cached_keys_is_flash_attention(family: str) -> None:
    """One new token after 63 cached ones: the causal mask aligned to the last key hides nothing. MPT's folds to
    ``where(false, m, s)`` (rule ``where-false``), XGLM's clamp of its scores at bf16's lowest stays without a mask
    (rule ``softmax-clamped-floor``), and GPT-OSS's sinks read the rows' log-sum-exp of a q without a query axis
    (its layout was refused); each decoded on an unfused softmax before. Like eager, flash kernels, packed GQA rows
    among their plans."""
    derivations = _derived_after_cached_keys(family, 63)
    assert sum(k.kind == "flash_attention" for d in derivations for k in d.kernels_for("sm_90a")) == DECODED[family]
    plans = [p for d in derivations for p in d.plans("sm_90a")]
    assert {(p.problem.seq_q, p.problem.window) for p in plans} == {(1, 0)}
    if all(p.problem.group_size > 1 for p in plans):
        assert any(getattr(p.schedule, "short_query", False) and p.schedule.pack_group for p in plans)


def _derived_after_cached_keys(family: str, cached: int) -> list:
    """The derivations of a family's regions for the tokens after its first ``cached`` (of 64) in its KV cache, the
    logits checked against eager's."""
    import copy

    build = _decoder("LlamaForCausalLM", "LlamaConfig") if family == "llama" else FAMILIES[family][0]
    torch.manual_seed(0)
    model, inputs = build()
    model = model.to(torch.bfloat16).eval()
    ids = inputs["input_ids"]
    with torch.no_grad():
        cache = model(input_ids=ids[:, :cached], use_cache=True).past_key_values
        expected = model(input_ids=ids[:, cached:], past_key_values=copy.deepcopy(cache), use_cache=True).logits
        with recorded_splits() as splits:
            compiled = torch.compile(model, backend=lambda gm, xs: compile_regions(gm, xs, fallback="eager"))
            got = compiled(input_ids=ids[:, cached:], past_key_values=cache, use_cache=True).logits
    assert float((got.float() - expected.float()).norm() / expected.float().norm()) < 2e-2
    return [ck.derive(prepared.graph) for split in splits for region in split.compiled
            for prepared in region.prepared.values()]  # fmt: skip


TRAINED = {"qwen2": (1, 1), "phi3": (1, 1), "clip_vision": (1, 1), "whisper_encoder": (1, 1), "gemma_d256": (1, 1),
           "gemma2_softcap": (1, 1), "bart": (3, 3), "bert_padded": (1, 0), "gemma_mqa": (1, 1),
           "bloom_alibi": (1, 1), "mpt_alibi": (1, 1), "mistral_window": (1, 1), "gemma3_sliding_and_full": (2, 2), "gemma2_window": (1, 1),
           "modernbert_local_and_global": (2, 2), "cohere_interleaved_rotary": (1, 1), "xglm_clamped_mask": (1, 1),
           "qwen3": (1, 1), "falcon_mqa": (1, 1), "mixtral_moe": (1, 1), "gptj": (1, 1), "gpt_bigcode_mqa": (1, 1),
           "t5_encoder": (1, 1), "swin_windows": (2, 2), "deepseek_v3_mla": (1, 1), "mbart_shifted_ids": (3, 3),
           "gpt_neo_buffer_masks": (2, 2), "imagegpt_buffer_mask": (1, 1), "gpt_oss_sinks": (2, 0),
           "openai_gpt_band_product": (1, 1)}  # fmt: skip
"""Family: the flash-attention forward and backward kernels its training regions derive (head dim 256's backward
holds dk, dv and dq in two head-dim parts; Gemma 2's soft cap: the backward recomputes the cap's tanh, whose detached
output tanh_backward reads, and derives the flash backward through the cap's chain rule; BERT's SDPA backward under its padding mask stays
torch's fused kernel in the backend; Bloom's and MPT's ALiBi, a bias the backward recomputes with the scores (Bloom
adds it in ``baddbmm``) and reads stored, trains on a flash backward; ModernBERT's rotary embedding, in fp32, hands the
kernels fp32 q and k and takes fp32 gradients back: each is rounded into a 16-bit copy, each gradient written in 16 bits
and widened; Cohere's interleaved one too, its grouped gradients reading the one copy of q; XGLM's clamp of its masked
scores has a gradient, torch's VJP of ``maximum`` selecting by two comparisons' masks, that moves only masked entries,
whose probability is 0; GPT-Neo's mask buffers are pinned in the forward and in the backward, which AOTAutograd hands
them as saved inputs, and its window's VJP, a where below the window, moves only entries of probability 0; GPT-OSS's
sinks: the backward recomputes the appended column and the row's max with its index, what max's gradient scatters
by, so the forward keeps its flash kernels; that scatter derives away, the row sum of a softmax's gradient being 0,
and the index stays in the backward's region; the backward through the sink is not a flash backward yet)."""


def _training_step_against_eager(family: str) -> tuple[float, list[Any]]:
    """One training step of a zoo family in bf16, eagerly and through the backend: the relative error of
    its gradients (every parameter's, together; one that eager leaves without a gradient, as CLIP's
    post-norm off the loss's path, is zero under ``torch.compile``, as it is under ``aot_eager``), and the
    backend's recorded splits."""
    build, _ = FAMILIES[family]
    torch.manual_seed(0)
    model, inputs = build()
    model = model.to(torch.bfloat16).train()
    inputs = {n: x.to(torch.bfloat16) if x.is_floating_point() else x for n, x in inputs.items()}

    def gradients(run: Callable[..., Any]) -> torch.Tensor:
        model.zero_grad()
        out = run(**inputs)[0].float()
        (out * torch.linspace(-1.0, 1.0, out.shape[-1])).sum().backward()  # a loss whose gradient is not ~0
        return torch.cat([torch.zeros(p.numel()) if p.grad is None else p.grad.float().flatten()
                          for p in model.parameters()])  # fmt: skip

    expected = gradients(model)
    with recorded_splits() as splits:
        got = gradients(torch.compile(model, backend=lambda gm, xs: compile_regions(gm, xs, fallback="eager")))
    return float((got - expected).norm() / expected.norm()), splits


def _derived_kinds(splits: list[Any]) -> collections.Counter:
    """The kinds of the kernels the regions of ``splits`` derive on sm_90a, counted."""
    return collections.Counter(kernel.kind for split in splits for region in split.compiled
                               for prepared in region.prepared.values()
                               for kernel in ck.derive(prepared.graph).kernels_for("sm_90a"))  # fmt: skip


@pytest.mark.parametrize("family", list(TRAINED))
def test_a_model_family_trains_through_the_backend_like_eager_with_a_flash_backward(family: str) -> None:
    """One training step's gradients like eager's within bf16 rounding, and each attention layer's backward a
    flash-attention backward on sm_90a."""
    error, splits = _training_step_against_eager(family)
    assert error < 2e-2, f"{family}: gradients {error:.3g} from eager"
    kinds = _derived_kinds(splits)
    assert (kinds["flash_attention"], kinds["flash_attention_backward"]) == TRAINED[family], dict(kinds)


def _math_attention(q: Any, k: Any, v: Any, bias: Any, scale: float | None) -> tuple[Any, Any, Any]:
    """Attention's probabilities, output (q's dtype) and rows' log-sum-exp (fp32, a unit axis last), in fp32."""
    scores = (q.float() @ k.float().transpose(-2, -1)) * (scale or q.shape[-1] ** -0.5)
    scores = scores if bias is None else scores + bias.float()
    lse = torch.logsumexp(scores, -1, keepdim=True)
    p = torch.exp(scores - lse)
    return p, (p @ v.float()).to(q.dtype), lse


def _cudnn_forward_on_cpu(q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False,
                          return_debug_mask=False, *, scale=None):  # fmt: skip
    _, out, lse = _math_attention(q, k, v, attn_bias, scale)
    out = out.transpose(1, 2).contiguous().transpose(1, 2)  # cuDNN's (B, S, H, D) memory order
    empty, zero = torch.empty(0), torch.zeros((), dtype=torch.int64)
    return out, lse, empty, empty, q.shape[-2], k.shape[-2], zero, zero.clone(), empty


def _cudnn_backward_on_cpu(grad_out, q, k, v, out, logsumexp, philox_seed, philox_offset, attn_bias, cum_seq_q,
                           cum_seq_k, max_q, max_k, dropout_p, is_causal, *, scale=None):  # fmt: skip
    p, _, _ = _math_attention(q, k, v, attn_bias, scale)
    do, scale = grad_out.float(), scale or q.shape[-1] ** -0.5
    dp = do @ v.float().transpose(-2, -1)
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))
    dq, dk, dv = ds @ k.float() * scale, ds.transpose(-2, -1) @ q.float() * scale, p.transpose(-2, -1) @ do
    return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype)


@pytest.fixture
def cudnn_sdpa_on_cpu(monkeypatch):
    """SDPA dispatched to cuDNN's kernels, as a GPU's trace records them (the log-sum-exp with a unit axis, and the
    philox seed and offset the backward takes back), given CPU implementations (math attention): the training
    graphs of a GPU, on the CPU."""
    library = torch.library.Library("aten", "IMPL")
    library.impl("_scaled_dot_product_cudnn_attention", _cudnn_forward_on_cpu, "CPU")
    library.impl("_scaled_dot_product_cudnn_attention_backward", _cudnn_backward_on_cpu, "CPU")

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros_like(attn_mask, dtype=q.dtype).masked_fill(~attn_mask, -math.inf)
        return torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, attn_mask, True, dropout_p, is_causal,
                                                                  scale=scale)[0]  # fmt: skip

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
    yield
    library._destroy()


def test_modernbert_trains_through_cudnn_sdpa_kernels_with_flash_kernels(cudnn_sdpa_on_cpu) -> None:
    """On a GPU, SDPA under ModernBERT's masks runs cuDNN's kernels, whose forward returns the philox state its
    backward takes back: both stayed torch's kernels (2026-12-06, H100). With that state made constant, the
    training step is eager's and both layers train on flash kernels."""
    error, splits = _training_step_against_eager("modernbert_local_and_global")
    assert error < 2e-2
    assert not [n for split in splits for n in split.module.graph.nodes if "cudnn" in str(n.target)]
    kinds = _derived_kinds(splits)
    assert (kinds["flash_attention"], kinds["flash_attention_backward"]) == (2, 2), dict(kinds)


def _cuda_math_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """SDPA as CUDA's math backend traces it for 16-bit operands: q, k and v upcast to fp32, q and k each
    scaled by the square root of the scale, a bool mask made additive by ``where`` over two scalar tensors,
    ``_safe_softmax``, the output rounded back."""
    root = math.sqrt(scale or q.shape[-1] ** -0.5)
    scores = (q.float() * root) @ (k.float() * root).transpose(-2, -1)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            attn_mask = torch.where(attn_mask, torch.scalar_tensor(0.0, dtype=q.dtype),
                                    torch.scalar_tensor(-math.inf, dtype=q.dtype))  # fmt: skip
        scores = scores + attn_mask
    return (torch.ops.aten._safe_softmax(scores, -1) @ v.float()).to(q.dtype)


def test_modernbert_under_a_mask_that_hides_nothing_derives_its_flash_forwards(monkeypatch) -> None:
    """transformers 5.17 (the GPU machine's) builds ModernBERT's global mask under Dynamo as ``q_idx >= 0``
    expanded over the keys, all true, and CUDA ran that layer through the math backend (2026-12-06, H100):
    its region read the folded, all-zero additive mask as a bias tensor and derived no flash kernel. Folded
    as a band without edges, adding it is nothing, and both layers' forwards are flash kernels."""
    from transformers import masking_utils

    monkeypatch.setattr(masking_utils, "_ignore_bidirectional_mask_sdpa", lambda *args, **kwargs: False)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", _cuda_math_sdpa)
    build, _ = FAMILIES["modernbert_local_and_global"]
    torch.manual_seed(0)
    model, inputs = build()
    model = model.to(torch.bfloat16).eval()
    with torch.no_grad():
        expected = model(**inputs)[0].float()
        with recorded_splits() as splits:
            got = torch.compile(model, backend=lambda gm, xs: compile_regions(gm, xs, fallback="eager"))(**inputs)[0]
    assert float((got.float() - expected).norm() / expected.norm()) < 2e-2
    graphs = [prepared.graph for split in splits for region in split.compiled for prepared in region.prepared.values()]
    assert not [name for g in graphs for name, spec in g.summary()["inputs"].items() if len(spec["shape"]) == 4
                and spec["shape"][-2:] == spec["shape"][-1:] * 2]  # no T x T mask read  # fmt: skip
    kinds = collections.Counter(kernel.kind for g in graphs for kernel in ck.derive(g).kernels_for("sm_90a"))
    assert kinds["flash_attention"] == 2, dict(kinds)


def test_modernbert_trains_through_cuda_math_sdpa_with_flash_kernels(monkeypatch) -> None:
    """A training step through CUDA's math SDPA (its spelling on the CPU), under transformers 5.17's
    all-true global mask: the forward saves q and kᵀ scaled in fp32, the backward reads them and
    differentiates the safe softmax from its output. Each fp32 operand is rounded into a 16-bit copy
    with its head dim last, dv, dq and dk read the same copies, and both layers train on flash kernels."""
    from transformers import masking_utils

    monkeypatch.setattr(masking_utils, "_ignore_bidirectional_mask_sdpa", lambda *args, **kwargs: False)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", _cuda_math_sdpa)
    error, splits = _training_step_against_eager("modernbert_local_and_global")
    assert error < 2e-2
    kinds = _derived_kinds(splits)
    assert (kinds["flash_attention"], kinds["flash_attention_backward"]) == (2, 2), dict(kinds)


@pytest.mark.parametrize("family", ["qwen2", "gemma3_sliding_and_full", "falcon", "deepseek_v3_mla"])
def test_a_model_family_generates_eager_tokens_through_the_backend(family: str) -> None:
    """Greedy decoding with transformers' default (growing) cache: every step a new signature of the regions,
    the same 8 tokens as eager. (Falcon's and DeepSeek's decoding graphs, traced with symbolic sizes, fail the
    backend's own trace; such a graph runs through the fallback, as the log says: they raised before.)"""
    build, _ = FAMILIES[family]
    torch.manual_seed(0)
    model, inputs = build()
    model = model.to(torch.bfloat16).eval()
    prompt = inputs["input_ids"][:1, :16]
    with torch.no_grad():
        expected = model.generate(prompt, max_new_tokens=8, do_sample=False)
        torch._dynamo.reset()
        model.forward = torch.compile(model.forward, backend=lambda gm, xs: compile_regions(gm, xs, fallback="eager"))
        got = model.generate(prompt, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, expected), (expected[0, 16:].tolist(), got[0, 16:].tolist())


TIMM = {
    # name: (timm model and its overrides, flash-attention kernels its regions derive)
    "eva02_rope": (("eva02_tiny_patch14_224", dict(img_size=56, depth=2)), 2),
    "swin_windows": (("swin_tiny_patch4_window7_224", dict(img_size=56, depths=(1, 1, 1, 1))), 4),
    # cosine attention: q and k normalised (F.normalize), the scores times a learned scale a head, plus a bias
    "swinv2_cosine": (("swinv2_tiny_window8_256", dict(img_size=64, depths=(1, 1, 1, 1))), 4),
    # BEiT's relative-position bias a head, handed to SDPA as its attn_mask
    "beit_relative_bias": (("beit_base_patch16_224", dict(img_size=64, depth=2)), 2),
    # MaxViT's block (local window) and grid (dilated) attentions, each with its relative-position bias
    "maxvit_block_grid": (("maxvit_nano_rw_256", dict(img_size=128, depths=(1, 1, 1, 1))), 8),
    # Hiera's mask-unit attention over (B, units, heads, N, d): batch and units read as one batch axis (k and v,
    # read with each token's unit inside its position, stored in that order first); torch's default init, as timm
    # zeroes the head
    "hiera_mask_units": (("hiera_tiny_224", dict(img_size=64, stages=(1, 1, 1, 1), weight_init="skip")), 4),
}


@pytest.mark.parametrize("family", list(TIMM))
def test_a_timm_model_runs_through_the_backend_like_eager(family: str) -> None:
    """timm's EVA-02 (2-D rotary embedding), Swin, Swin V2, BEiT, MaxViT and Hiera classifiers, bf16, like eager,
    each attention a flash kernel."""
    timm = pytest.importorskip("timm")
    (name, overrides), flash_kernels = TIMM[family]
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=10, **overrides).to(torch.bfloat16).eval()
    size = overrides["img_size"]
    x = torch.randn(2, 3, size, size, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = model(x).float()
        with recorded_splits() as splits:
            got = torch.compile(model, backend=lambda gm, xs: compile_regions(gm, xs, fallback="eager"))(x).float()
    error = float((got - expected).norm() / expected.norm())
    assert error < 2e-2, f"{family}: {error:.3g} from eager"
    assert splits and any(split.compiled for split in splits), f"{family}: nothing lowered"
    kinds = _derived_kinds(splits)
    assert kinds["flash_attention"] == flash_kernels, f"{family}: {dict(kinds)}"



WIDE = {
    # name: a 2-layer LM of width 1024 (16 heads of 64), bf16, on CUDA
    "xglm": lambda: transformers.XGLMForCausalLM(transformers.XGLMConfig(
        num_layers=2, d_model=1024, attention_heads=16, ffn_dim=4096, vocab_size=1024, dropout=0.0)),
    # a window of 128 keys over 512 tokens: the kernel skips the tiles past the diagonal and below the window
    "mistral_window": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(
        num_hidden_layers=2, hidden_size=1024, num_attention_heads=16, num_key_value_heads=4,
        intermediate_size=2048, vocab_size=1024, sliding_window=128)),
    # Gemma 2's soft-capped scores, its sliding layer (the first) with a window of 128 keys
    "gemma2_window": lambda: transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        num_hidden_layers=2, hidden_size=1024, num_attention_heads=16, num_key_value_heads=8, head_dim=64,
        intermediate_size=2048, vocab_size=1024, sliding_window=128)),
    # GPT-Neo's masks from its own bool buffers, its local layer (the second) a window of 128 keys
    "gpt_neo": lambda: transformers.GPTNeoForCausalLM(transformers.GPTNeoConfig(
        num_layers=2, hidden_size=1024, num_heads=16, vocab_size=1024, max_position_embeddings=1024, window_size=128,
        attention_types=[[["global", "local"], 1]], intermediate_size=2048, bos_token_id=0, eos_token_id=0)),
    # GPT-OSS's attention sinks, its first layer's window of 128 keys (head dim 64; every token to both experts: a
    # top-k choice flipped by bf16 rounding moves eager's own logits 8 % from fp32's at random weights)
    "gpt_oss": lambda: transformers.GptOssForCausalLM(transformers.GptOssConfig(
        num_hidden_layers=2, hidden_size=1024, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
        intermediate_size=1024, num_local_experts=2, num_experts_per_tok=2, vocab_size=1024, sliding_window=128,
        layer_types=["sliding_attention", "full_attention"])),
    # DiffLlama's two attentions sharing their softmax, each v one K/V head read for every head (head stride 0)
    "diffllama": lambda: transformers.DiffLlamaForCausalLM(transformers.DiffLlamaConfig(
        num_hidden_layers=2, hidden_size=1024, num_attention_heads=16, num_key_value_heads=4,
        intermediate_size=2048, vocab_size=1024)),
    # xIELU's softplus and expm1 in the MLP
    "apertus": lambda: transformers.ApertusForCausalLM(transformers.ApertusConfig(
        num_hidden_layers=2, hidden_size=1024, num_attention_heads=16, num_key_value_heads=4,
        intermediate_size=2048, vocab_size=1024)),
}  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("family", list(WIDE))
def test_gpu_a_family_at_width_1024_runs_through_the_backend_like_eager(family: str, tmp_path) -> None:
    """XGLM (its clamped causal mask), Mistral with a window of 128 keys, Gemma 2 (its soft cap, and the window of
    its sliding layer), GPT-Neo (its masks from its own buffers), GPT-OSS (its attention sinks), DiffLlama (two attentions a layer, v read at head stride 0) and Apertus (its xIELU
    activation) at width 1024, B 2, T 512, through
    ``torch.compile(backend="cherenkov")`` on the GPU: eager's logits within bf16 tolerance, and a flash kernel
    launched for each attention of the two layers, the windows the kernels' own (no bias tensor)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    import functools

    from cherenkov.search.database import TuningDatabase
    from cherenkov.search.dynamo import cherenkov_backend

    torch.manual_seed(0)
    model = WIDE[family]().eval().to("cuda", torch.bfloat16)
    ids = torch.randint(0, 1024, (2, 512), device="cuda")
    with torch.no_grad(), TuningDatabase(tmp_path / "tuning.sqlite") as db, recorded_splits() as splits:
        expected = model(input_ids=ids).logits.float()
        backend = functools.partial(cherenkov_backend, options={"budget_s": 45.0, "database": db})
        got = torch.compile(model, backend=backend, dynamic=False)(input_ids=ids).logits.float()
    error = float((got - expected).norm() / expected.norm())
    assert error < 2e-2, f"{family}: {error:.3g} from eager"
    results = searched_results(splits)
    kinds = [k.kind for result in results for k in result.launched]
    flash = 4 if family == "diffllama" else 2  # DiffLlama: two attentions a layer
    assert kinds.count("flash_attention") == flash, kinds
    problems = [result.kernels[k.output].plan.problem for result in results for k in result.launched
                if k.kind == "flash_attention"]  # fmt: skip
    windows = {"mistral_window": [128, 128], "gemma2_window": [0, 128], "gpt_neo": [0, 128], "gpt_oss": [0, 128]}.get(family, [0] * flash)
    assert sorted(p.window for p in problems) == windows and all(p.bias is None for p in problems), problems
