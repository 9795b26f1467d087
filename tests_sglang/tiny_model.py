"""A tiny random-weight Llama (or Gemma2, whose even layers attend through a sliding window) and a
word-level tokenizer, saved to a folder SGLang can load with nothing downloaded:
``python tiny_model.py DIR [llama|gemma2]``, ``make_tiny_llama(DIR)`` or ``make_tiny_model(DIR, "gemma2")``."""

import sys

VOCAB = 1000


def make_tiny_llama(path, seed=0):
    return make_tiny_model(path, "llama", seed)


def make_tiny_model(path, arch="llama", seed=0, sliding_window=8):
    import tokenizers
    import torch
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0)
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    elif arch == "gemma2":
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
            **common, sliding_window=sliding_window, hidden_act="gelu_pytorch_tanh"))  # SGLang reads hidden_act
    else:
        raise ValueError(f"unknown arch {arch!r}: llama or gemma2")
    model.save_pretrained(path)
    # words t0 .. t999, one token each; the decoder joins them with spaces
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.decoder = tokenizers.decoders.WordPiece(prefix="##")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1",
                                                eos_token="t2")
    fast.save_pretrained(path)
    return str(path)


if __name__ == "__main__":
    print(make_tiny_model(sys.argv[1], *sys.argv[2:3]))
