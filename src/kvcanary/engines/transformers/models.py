"""Models and configurations for running transformers continuous batching without downloads.

:func:`tiny_arch` builds a small random-weight causal LM of one of the architectures in
:data:`ARCHS`, each with the attention implementation transformers 5.24's continuous batching runs
it with on a CPU: ``sdpa`` where the model supports it, ``eager`` otherwise (the CB manager then
switches to ``paged|eager``; Gemma2's logit softcapping and GPT-OSS's attention sinks are refused
or ignored by ``sdpa``). Hybrid architectures alternate sliding-window and full-attention layers,
so their CB cache has two layer groups.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

WINDOW = 12  # sliding-window width of the hybrid architectures: not a multiple of the page size


def tiny_model(seed: int = 0, layers: int = 4, kv_heads: int = 4, sliding_window: int | None = None,
               path: str | None = None, hidden: int = 128) -> Any:
    """A small Llama-architecture causal LM with random weights from a fixed seed (nothing is fetched).

    ``sliding_window`` gives a Mistral-style model whose layers all attend to a window (one sliding
    layer group); ``path`` loads a local checkpoint instead.
    """
    import transformers

    if path is not None:
        return transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True,
                                                                 attn_implementation="sdpa").eval()
    common: dict[str, Any] = dict(vocab_size=1000, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=1024)
    torch.manual_seed(seed)
    model: Any
    if sliding_window is None:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:
        model = transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=sliding_window, **common))
    model.config._attn_implementation = "sdpa"
    return model.eval()


def _common(layers: int) -> dict[str, Any]:
    # token ids inside the vocabulary (some configs default to a 256k vocabulary's ids)
    return dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _hybrid(layers: int) -> dict[str, Any]:
    return dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"] * (layers // 2))


def _llama(t: Any, layers: int) -> Any:
    return t.LlamaForCausalLM(t.LlamaConfig(**_common(layers)))


def _mistral(t: Any, layers: int) -> Any:  # every layer windowed: one sliding group, no full group
    return t.MistralForCausalLM(t.MistralConfig(sliding_window=WINDOW, **_common(layers)))


def _qwen2(t: Any, layers: int) -> Any:
    return t.Qwen2ForCausalLM(t.Qwen2Config(use_sliding_window=True, **_hybrid(layers), **_common(layers)))


def _gemma2(t: Any, layers: int) -> Any:
    return t.Gemma2ForCausalLM(t.Gemma2Config(query_pre_attn_scalar=16, **_hybrid(layers), **_common(layers)))


def _gemma3(t: Any, layers: int) -> Any:
    return t.Gemma3ForCausalLM(t.Gemma3TextConfig(query_pre_attn_scalar=16, **_hybrid(layers), **_common(layers)))


def _gpt_oss(t: Any, layers: int) -> Any:  # mixture of 4 tiny experts, attention sinks
    common = {**_common(layers), "intermediate_size": 64}
    return t.GptOssForCausalLM(t.GptOssConfig(num_local_experts=4, num_experts_per_tok=2,
                                              rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                              **_hybrid(layers), **common))


def _cohere2(t: Any, layers: int) -> Any:
    return t.Cohere2ForCausalLM(t.Cohere2Config(**_hybrid(layers), **_common(layers)))


# name: (builder, attention implementation, layer groups: "full", "sliding" or "hybrid" (alternating))
ARCHS: dict[str, tuple[Callable[[Any, int], Any], str, str]] = {
    "llama": (_llama, "sdpa", "full"),
    "mistral": (_mistral, "sdpa", "sliding"),
    "qwen2": (_qwen2, "sdpa", "hybrid"),
    "gemma2": (_gemma2, "eager", "hybrid"),
    "gemma3": (_gemma3, "sdpa", "hybrid"),
    "gpt_oss": (_gpt_oss, "eager", "hybrid"),
    "cohere2": (_cohere2, "sdpa", "hybrid"),
}


def full_layers(name: str, layers: int) -> int:
    """How many of the ``layers`` layers of architecture ``name`` attend to the whole sequence."""
    kind = ARCHS[name][2]
    return layers if kind == "full" else 0 if kind == "sliding" else layers // 2


def tiny_arch(name: str, seed: int = 0, layers: int = 2) -> Any:
    """A tiny random-weight causal LM of architecture ``name`` (a key of :data:`ARCHS`); nothing is fetched.

    Vocabulary 1000, hidden 64, 4 query heads and 2 KV heads of width 16, ``layers`` layers (even;
    hybrids alternate sliding window :data:`WINDOW` and full attention).
    """
    import transformers

    if name not in ARCHS:
        raise ValueError(f"architecture: expected one of {sorted(ARCHS)}, got {name!r}")
    if layers < 2 or layers % 2:
        raise ValueError(f"layers: expected an even number >= 2, got {layers}")
    build, attn, _ = ARCHS[name]
    torch.manual_seed(seed)
    model = build(transformers, layers)
    model.config._attn_implementation = attn
    return model.eval()


def cb_configs(max_new_tokens: int = 12, page_size: int = 8, num_blocks: int = 64, max_batch_tokens: int = 128,
               **cb: Any) -> tuple[Any, Any]:
    """Greedy generation and a small, CPU-friendly continuous-batching configuration."""
    import transformers

    gen = transformers.GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1)
    kw: dict[str, Any] = dict(page_size=page_size, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
                              max_requests_per_batch=16, seed=0, use_cuda_graph=False, use_async_batching=False,
                              auto_switch_to_flash=False)
    kw.update(cb)
    return gen, transformers.ContinuousBatchingConfig(**kw)
