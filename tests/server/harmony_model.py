"""A tiny random-weight GPT-OSS model whose vocabulary is o200k Harmony (GPT-OSS's own), for the chat tests.

The weights come from transformers' `GptOssConfig` (2 layers, hidden 32, the real vocabulary size 201088 and
the real stop ids). The tokenizer is built from the offline ``o200k_base.tiktoken`` (`harmony_vocab.py`) plus
Harmony's special tokens at their ids: a byte-level BPE whose vocabulary is exactly o200k's, so decoding any id
is exact. It has no merge list (building o200k's ~200k merges takes long), so it encodes words that are not
whole vocabulary entries byte by byte; the GPT-OSS chat path never encodes text (Harmony renders token ids).
"""

from __future__ import annotations

import base64
from pathlib import Path

from tests.moe_tiny_models import tiny_moe_config
from tests.tiny_models import save_tiny_model

VOCAB_SIZE = 201088
EOS_IDS = [200002, 199999, 200012]  # <|return|>, <|endoftext|>, <|call|> (GPT-OSS's generation_config)


def _harmony_tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from tokenfab.server.reasoning.harmony_vocab import O200K_FILE, ensure_harmony_vocab, harmony_encoding

    byte_char = bytes_to_unicode()
    vocab: dict[str, int] = {}
    for line in (Path(ensure_harmony_vocab()) / O200K_FILE).read_bytes().splitlines():
        token, rank = line.split()
        vocab["".join(byte_char[b] for b in base64.b64decode(token))] = int(rank)
    enc = harmony_encoding()
    first_special = len(vocab)  # o200k's 199998 ranks are ids 0..199997; Harmony's specials follow
    specials = [enc.decode([i]) for i in range(first_special, VOCAB_SIZE)]
    vocab.update({name: first_special + i for i, name in enumerate(specials)})
    tok = Tokenizer(models.BPE(vocab, [], ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|return|>", pad_token="<|endoftext|>",
                                  bos_token="<|startoftext|>")


def save_tiny_gpt_oss(path: Path) -> Path:
    """Write the model folder (config, safetensors, tokenizer) to `path`; return it."""
    config = tiny_moe_config("gpt_oss", vocab_size=VOCAB_SIZE, hidden_size=32, num_attention_heads=2,
                             num_key_value_heads=1, head_dim=16, eos_token_id=EOS_IDS, pad_token_id=199999,
                             bos_token_id=199998)
    save_tiny_model(config, path)
    _harmony_tokenizer().save_pretrained(path)
    return path
