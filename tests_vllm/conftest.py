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
    save_word_tokenizer(path, cfg.vocab_size)
    return str(path)


def save_word_tokenizer(path, vocab_size):
    """A word-level tokenizer whose words are ``t0 .. t{vocab_size - 1}``, so the OpenAI-compatible
    server can take text prompts with nothing downloaded."""
    import tokenizers
    import transformers

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.decoder = tokenizers.decoders.WordPiece(prefix="##")  # words joined by spaces
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1",
                                                eos_token="t2")
    fast.save_pretrained(path)
