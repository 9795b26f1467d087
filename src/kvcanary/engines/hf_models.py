"""Models and configurations for running transformers continuous batching without downloads."""

from __future__ import annotations

from typing import Any

import torch


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
