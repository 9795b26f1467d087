"""A tiny random-weight Llama and a word-level tokenizer, saved to a folder SGLang can load with
nothing downloaded: ``python tiny_model.py DIR`` or ``make_tiny_llama(DIR)``."""

import sys

VOCAB = 1000


def make_tiny_llama(path, seed=0):
    import tokenizers
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                                   bos_token_id=1, eos_token_id=2, torch_dtype="float32")
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
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
    print(make_tiny_llama(sys.argv[1]))
