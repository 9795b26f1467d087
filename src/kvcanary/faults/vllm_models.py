"""Tiny random-weight models of the architectures vLLM's CPU build runs, saved to a local folder
(nothing is downloaded), for the vLLM runs of the selftest, the tests and the clean fuzz.

Each architecture brings the attention kind that makes it interesting to the canary:

- ``llama``, ``qwen3``: full attention on every layer (one KV cache group);
- ``mistral``: a sliding window on every layer (one group, vLLM's sliding-window manager frees the
  blocks that fall below the window and hands them out again);
- ``gemma2``, ``gemma3``, ``gpt_oss``: sliding-window and full layers mixed (several KV cache groups
  under vLLM's hybrid KV cache manager; GPT-OSS adds attention sinks and experts);
- ``qwen3_next``: linear-attention (gated delta net) layers beside full attention: a KV cache group
  of recurrent state, which is not per-token KV (vLLM's CPU kernels for it need bf16 and fixed
  head sizes, so it is outside the fuzz's draw).
"""

from __future__ import annotations

from typing import Any

ARCHS = ("llama", "qwen3", "mistral", "gemma2", "gemma3", "gpt_oss")
STATE_ARCHS = ("qwen3_next",)  # with a recurrent-state KV cache group
# architectures whose layers read only a window of the sequence (on some or all layers)
WINDOWED = frozenset({"mistral", "gemma2", "gemma3", "gpt_oss"})


def config(arch: str, layers: int = 2, head_dim: int = 32, heads: int = 4, kv_heads: int = 2, window: int = 32,
           vocab: int = 512) -> Any:
    """The transformers config of a tiny ``arch`` model.

    Parameters
    ----------
    layers : decoder layers (mixed architectures alternate sliding and full layers, sliding first)
    head_dim : per-head size (80 and 112 select vLLM's ``vec16`` CPU kernels, 32 and 64 ``vec``)
    heads, kv_heads : query and KV heads
    window : the sliding window in tokens, where the architecture has one
    """
    import transformers

    if arch not in ARCHS + STATE_ARCHS:
        raise ValueError(f"arch: expected one of {ARCHS + STATE_ARCHS}, got {arch!r}")
    hidden = heads * head_dim
    common: dict[str, Any] = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=2048)
    mixed = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if arch == "llama":
        return transformers.LlamaConfig(**common, head_dim=head_dim)
    if arch == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=head_dim, tie_word_embeddings=False)
    if arch == "mistral":
        return transformers.MistralConfig(**common, head_dim=head_dim, sliding_window=window)
    if arch == "gemma2":
        return transformers.Gemma2Config(**common, head_dim=head_dim, sliding_window=window, layer_types=mixed,
                                         attn_logit_softcapping=None, final_logit_softcapping=None)
    if arch == "gemma3":
        return transformers.Gemma3TextConfig(**common, head_dim=head_dim, sliding_window=window, layer_types=mixed)
    if arch == "qwen3_next":  # the sizes vLLM's CPU gated-delta-net kernels take
        return transformers.Qwen3NextConfig(**{**common, "hidden_size": 256}, head_dim=64, linear_num_value_heads=2,
                                            linear_num_key_heads=2, linear_key_head_dim=128, linear_value_head_dim=128,
                                            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                            shared_expert_intermediate_size=64,
                                            layer_types=["linear_attention" if i % 2 == 0 else "full_attention"
                                                         for i in range(layers)])
    return transformers.GptOssConfig(**common, head_dim=head_dim, sliding_window=window, layer_types=mixed,
                                     num_local_experts=4, num_experts_per_tok=2)


def save(path: str, arch: str = "llama", seed: int = 0, **kw: Any) -> str:
    """Save a tiny ``arch`` model with random weights from ``seed`` to ``path`` (keywords: :func:`config`);
    returns ``path``."""
    import torch
    import transformers

    cfg = config(arch, **kw)
    bar = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()  # no "Writing model shards" bar on stderr
    try:
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            # Gemma3's text config maps to no causal-LM class of its own in the auto tables
            model: Any = (transformers.Gemma3ForCausalLM(cfg) if arch == "gemma3"
                          else transformers.AutoModelForCausalLM.from_config(cfg))
            model.save_pretrained(path)
    finally:
        if bar:
            transformers.utils.logging.enable_progress_bar()
    return path
