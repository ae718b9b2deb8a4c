"""Kimi K2/K2.5's tokenizer layout (tiktoken.model + tokenizer_config.json + remote-code class) loaded
without remote code, checked against the ``tiktoken`` package encoding the same file with the pattern
exactly as Kimi's tokenization_kimi.py writes it."""

from __future__ import annotations

import base64
import json
from collections import Counter
from pathlib import Path

import pytest

from tokenfab.loader.errors import ModelLoadError
from tokenfab.loader.tiktoken_tokenizer import NUM_RESERVED_SPECIAL_TOKENS, load_tiktoken_tokenizer

# tokenization_kimi.py's pat_str, as written there (the reference the restated pattern must match)
KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

CORPUS = (
    "The quick brown fox jumps over the lazy dog. I'm sure they'll say it's fine, we've done it. "
    "HelloWorld CamelCase JSONParser 12345 67 890\n\n  indented\tline\r\n"
    "你好世界，今天天气很好。我们一起学习机器学习。人工智能的世界很大。"
    "Mixed中文and English文本 ümlaut café naïve 🚀 emoji!!! ... ---"
) * 3

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure THEY'LL say it's fine; we've done it.",
    "HelloWorld JSONParser camelCaseName",
    "1234567 89 0.5",
    "你好世界，今天天气很好。",
    "Mixed中文and English文本",
    "  indented\n\n\tline\r\n  ",
    "café naïve ümlaut 🚀 ✓",
    "<|im_user|>user<|im_middle|>hi<|im_end|>",
    "",
]

SPECIAL = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>", 6: "[UNK]",
           7: "[PAD]", 9: "<|im_system|>", 10: "<|im_middle|>"}

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif message['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
    "{{ message['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)


def train_bpe(corpus: str, merges: int) -> dict[bytes, int]:
    """A byte-level BPE: the 256 bytes, then the most frequent adjacent pair merged, ``merges`` times."""
    ranks = {bytes([b]): b for b in range(256)}
    words = [[bytes([b]) for b in w.encode()] for w in corpus.split(" ") if w]
    for _ in range(merges):
        pairs = Counter((a, b) for w in words for a, b in zip(w, w[1:]))
        if not pairs:
            break
        (a, b), _count = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        ranks[a + b] = len(ranks)
        for w in words:
            i = 0
            while i < len(w) - 1:
                if w[i] == a and w[i + 1] == b:
                    w[i : i + 2] = [a + b]
                i += 1
    return ranks


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("kimi")
    ranks = train_bpe(CORPUS, 300)
    (folder / "tiktoken.model").write_text(
        "".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in sorted(ranks.items(), key=lambda kv: kv[1])))
    base = len(ranks)
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "added_tokens_decoder": {str(base + i): {"content": t, "special": True} for i, t in SPECIAL.items()},
        "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]", "unk_token": "[UNK]",
        "additional_special_tokens": ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>",
                                      "<|im_middle|>"],
        "chat_template": CHAT_TEMPLATE, "model_max_length": 262144,
    }))
    sentinel = folder / "REMOTE_CODE_RAN"
    (folder / "tokenization_kimi.py").write_text(f"open({str(sentinel)!r}, 'w').close()\n")
    return folder


@pytest.fixture(scope="module")
def reference(kimi_dir):
    tiktoken = pytest.importorskip("tiktoken")  # the reference (a dev dependency), not needed by the loader
    text = (kimi_dir / "tiktoken.model").read_text().split()
    ranks = {base64.b64decode(text[i]): int(text[i + 1]) for i in range(0, len(text), 2)}
    base = len(ranks)
    specials = {SPECIAL.get(i, f"<|reserved_token_{base + i}|>"): base + i for i in range(NUM_RESERVED_SPECIAL_TOKENS)}
    return tiktoken.Encoding(name="kimi-test", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks, special_tokens=specials)


def test_encode_equals_tiktoken(kimi_dir, reference):
    tok = load_tiktoken_tokenizer(kimi_dir)
    assert not (kimi_dir / "REMOTE_CODE_RAN").exists()
    for text in TEXTS + [CORPUS]:
        assert tok.encode(text, add_special_tokens=False) == reference.encode(text, allowed_special="all"), text


def test_round_trip_and_special_tokens(kimi_dir):
    tok = load_tiktoken_tokenizer(kimi_dir)
    base = len((kimi_dir / "tiktoken.model").read_text().splitlines())
    assert len(tok) == base + NUM_RESERVED_SPECIAL_TOKENS
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    assert tok.convert_tokens_to_ids("<|im_end|>") == base + 2
    assert tok.convert_tokens_to_ids(f"<|reserved_token_{base + 5}|>") == base + 5
    assert tok.eos_token == "[EOS]" and tok.eos_token_id == base + 1 and tok.bos_token_id == base
    assert tok.pad_token_id == base + 7
    ids = tok.encode("<|im_user|>hi<|im_end|>", add_special_tokens=False)
    assert ids[0] == base + 3 and ids[-1] == base + 2
    assert tok.decode(ids, skip_special_tokens=True) == "hi"


def test_chat_template_applies(kimi_dir, reference):
    tok = load_tiktoken_tokenizer(kimi_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好, I'm here"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>user<|im_middle|>"
                    "你好, I'm here<|im_end|><|im_assistant|>assistant<|im_middle|>")
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert list(ids) == reference.encode(text, allowed_special="all")


def test_model_loader_hook(kimi_dir):
    from tokenfab.loader.model_loader import _hf_tokenizer

    tok = _hf_tokenizer(kimi_dir)
    assert tok is not None and tok.encode("hello world", add_special_tokens=False)
    assert not (kimi_dir / "REMOTE_CODE_RAN").exists()


@pytest.mark.parametrize("lines,message", [
    ("QQ== 0\n!!notbase64 1\n", "line 2"),
    ("QQ== 0\nQQ== 1\n", "appears twice"),
    ("QQ== 0\nQg== 5\n", "ranks must be 0..n-1"),
    ("QQ==\n", "line 1"),
])
def test_malformed_tiktoken_file(tmp_path, lines, message):
    (tmp_path / "tiktoken.model").write_text(lines)
    with pytest.raises(ModelLoadError, match=message):
        load_tiktoken_tokenizer(tmp_path)


def test_bad_tokenizer_config(kimi_dir, tmp_path):
    (tmp_path / "tiktoken.model").write_bytes((kimi_dir / "tiktoken.model").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {"3": {"content": "x"}}}))
    with pytest.raises(ModelLoadError, match="outside the special range"):
        load_tiktoken_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{oops")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_tiktoken_tokenizer(tmp_path)
