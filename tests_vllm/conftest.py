"""vLLM's CPU build under the canary: a tiny random-weight Llama saved to a temporary folder (nothing
is downloaded), engines run in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) unless a test says not."""

import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    import torch
    import transformers

    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)
