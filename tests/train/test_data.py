"""tokenfab.train.data: record validation, assistant-only labels under real chat templates, packing.

The packing test is the issue's: the loss of a packed batch equals the token-weighted mean of the same
samples' losses run one at a time (fp32, tiny random Llama), with our own shift and with H7's ``packed_loss``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tokenfab.train.data import IGNORE_INDEX, DataError, load_records, pack, tokenize_record

PACK_RTOL = 1e-5  # fp32: the packed and one-at-a-time runs differ only by summation order


@pytest.fixture(scope="module")
def tok():
    from tokenfab.loader.bundled import bundled_model_path
    from tokenfab.loader.gguf import load_gguf_tokenizer

    return load_gguf_tokenizer(bundled_model_path())


def _write(tmp_path: Path, lines: list[str]) -> Path:
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}


# ----------------------------------------------------------------------------- loading and errors
def test_load_records_skips_blank_lines(tmp_path):
    p = _write(tmp_path, [json.dumps(CHAT), "", json.dumps({"prompt": "a", "completion": "b"})])
    recs = load_records(p)
    assert recs == [CHAT, {"prompt": "a", "completion": "b"}]


@pytest.mark.parametrize("line, needle", [
    ('{"messages": [', "invalid JSON"),
    ('[1, 2]', "must be a JSON object"),
    ('{"text": "x"}', "needs 'messages' or 'prompt' + 'completion'"),
    ('{"prompt": "x"}', "'completion' is missing"),
    ('{"prompt": "x", "completion": ""}', "'completion' is empty"),
    ('{"messages": []}', "non-empty list"),
    ('{"messages": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "y"}]}', "unknown role"),
    ('{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "  "}]}', "empty assistant"),
    ('{"messages": [{"role": "user", "content": "x"}]}', "no assistant turn"),
    ('{"messages": [{"role": "user"}, {"role": "assistant", "content": "y"}]}', "has no content"),
    ('{"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "y"}]}', "must be a string"),
])
def test_bad_records_name_file_and_line(tmp_path, line, needle):
    p = _write(tmp_path, [json.dumps(CHAT), line])
    with pytest.raises(DataError) as e:
        load_records(p)
    assert f"{p}:2:" in str(e.value) and needle in str(e.value)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_records(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="no records"):
        load_records(_write(tmp_path, [""]))


# ----------------------------------------------------------------------------- labels
def _trained_runs(tok, ids, labels) -> list[str]:
    """Decoded text of each contiguous run of trained tokens."""
    runs, cur = [], []
    for t, lab in zip(ids, labels):
        if lab != IGNORE_INDEX:
            assert lab == t  # labels are unshifted copies of the ids
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r) for r in runs]


def test_chat_labels_cover_every_assistant_turn_only(tok):
    rec = {"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
        {"role": "assistant", "content": "Rome, of course."},
    ]}
    ids, labels = tokenize_record(tok, rec, max_len=512)
    assert ids == tok.apply_chat_template(rec["messages"], tokenize=True, return_dict=True)["input_ids"]
    assert _trained_runs(tok, ids, labels) == ["Paris.<|im_end|>\n", "Rome, of course.<|im_end|>\n"]


TOOL_TEMPLATE = (  # a Qwen-like template that renders tool calls and tool results
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% for c in m.get('tool_calls', []) %}<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_tool_calls_trained_tool_results_not(tok):
    t = copy.copy(tok)
    t.chat_template = TOOL_TEMPLATE
    call = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}
    rec = {"messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "rain, 4C"},
        {"role": "assistant", "content": "It rains, 4C."},
    ]}
    ids, labels = tokenize_record(t, rec, max_len=512)
    runs = _trained_runs(t, ids, labels)
    assert len(runs) == 2
    assert '"name": "weather"' in runs[0] and "Oslo" in runs[0] and runs[0].endswith("<|im_end|>\n")
    assert runs[1] == "It rains, 4C.<|im_end|>\n"
    assert "rain, 4C" not in "".join(runs[:1])


def test_generation_marks_agree_with_prefix_rendering(tok):
    plain = copy.copy(tok)
    plain.chat_template = TOOL_TEMPLATE
    marked = copy.copy(tok)
    marked.chat_template = (  # the same text, with the assistant turns inside {% generation %} marks
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' %}{% generation %}"
        "{% if m['content'] %}{{ m['content'] }}{% endif %}"
        "{% for c in m.get('tool_calls', []) %}<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}"
        "<|im_end|>\n{% endgeneration %}"
        "{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    assert "{% generation %}" in marked.chat_template
    rec = {"messages": [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two three"},
                        {"role": "user", "content": "four"}, {"role": "assistant", "content": "five"}]}
    a = tokenize_record(plain, rec, 512)
    b = tokenize_record(marked, rec, 512)
    assert a == b
    assert _trained_runs(tok, *a) == ["two three<|im_end|>\n", "five<|im_end|>\n"]


def test_unstable_template_is_refused(tok):
    t = copy.copy(tok)  # drops every assistant turn but the last: prefixes do not render as prefixes
    t.chat_template = ("{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}<|im_start|>"
                       "{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
                       "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    rec = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                        {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]}
    with pytest.raises(DataError, match="prefix by prefix"):
        tokenize_record(t, rec, 512)


def test_prompt_completion_and_truncation(tok):
    rec = {"prompt": "The sky is", "completion": " blue."}
    ids, labels = tokenize_record(tok, rec, 512)
    assert ids[-1] == tok.eos_token_id
    assert tok.decode(ids) == "The sky is blue.<|im_end|>"
    assert _trained_runs(tok, ids, labels) == [" blue.<|im_end|>"]
    ids2, labels2 = tokenize_record(tok, rec, 3)
    assert ids2 == ids[:3] and labels2 == labels[:3]


# ----------------------------------------------------------------------------- packing
def _examples(n: int, seed: int, vocab: int = 96) -> list[tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(3, 17, (1,), generator=g))
        ids = torch.randint(0, vocab, (length,), generator=g).tolist()
        cut = int(torch.randint(1, length, (1,), generator=g))
        out.append((ids, [IGNORE_INDEX] * cut + ids[cut:]))
    return out


def test_pack_first_fit_layout():
    ex = [([1] * 5, [1] * 5), ([2] * 4, [2] * 4), ([3] * 3, [3] * 3), ([4] * 2, [IGNORE_INDEX, 4])]
    rows = pack(ex, max_tokens=8)
    # 5 -> row0 (3 left); 4 -> row1 (4 left); 3 -> row0 (0 left); 2 -> row1
    assert [r.input_ids[0].tolist() for r in rows] == [[1] * 5 + [3] * 3, [2] * 4 + [4] * 2]
    assert rows[0].position_ids[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert rows[1].cu_seqlens.tolist() == [0, 4, 6] and rows[1].cu_seqlens.dtype == torch.int32
    # the first label of every sample is masked: no shift can cross a sample boundary
    assert rows[0].labels[0].tolist() == [-100, 1, 1, 1, 1, -100, 3, 3]
    assert rows[1].labels[0].tolist() == [-100, 2, 2, 2, -100, 4]
    assert [r.num_loss_tokens for r in rows] == [6, 4]
    assert rows[0].input_ids.dtype == torch.long and rows[0].input_ids.shape == (1, 8)
    assert [len(r) for r in (r.cu_seqlens for r in pack(ex, 100, max_samples=3))] == [4, 2]


def test_pack_refuses_bad_examples():
    with pytest.raises(ValueError, match="more than max_tokens"):
        pack([([1] * 9, [1] * 9)], max_tokens=8)
    with pytest.raises(ValueError, match="labels"):
        pack([([1, 2], [1])], max_tokens=8)


def _tiny_llama(vocab: int = 96):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      rms_norm_eps=1e-6, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # larger than the default init, so a leak across samples shows in the loss
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


def _loss_sum(model, ids: torch.Tensor, pos: torch.Tensor, labels: torch.Tensor, mask=None) -> torch.Tensor:
    # use_cache=False matters: with a cache transformers does not derive the block-diagonal mask from position_ids
    logits = model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=False).logits[0, :-1]
    return F.cross_entropy(logits, labels[0, 1:], ignore_index=IGNORE_INDEX, reduction="sum")


def _alone_mean(model, examples) -> torch.Tensor:
    total, n = torch.zeros((), dtype=torch.float64), 0
    for ids, labels in examples:
        lab = torch.tensor([labels])
        total += _loss_sum(model, torch.tensor([ids]), torch.arange(len(ids))[None], lab).double()
        n += int((lab[0, 1:] != IGNORE_INDEX).sum())
    return total / n


@torch.no_grad()
def test_packed_loss_equals_samples_one_at_a_time():
    model = _tiny_llama()
    examples = _examples(12, seed=1)
    rows = pack(examples, max_tokens=40)
    assert len(rows) < len(examples) and any(r.num_samples > 2 for r in rows)
    total = sum(_loss_sum(model, r.input_ids, r.position_ids, r.labels).double() for r in rows)
    n = sum(r.num_loss_tokens for r in rows)
    expected = _alone_mean(model, examples)
    torch.testing.assert_close(total / n, expected, rtol=PACK_RTOL, atol=0)
    # the check can fail: one causal mask over the whole row lets samples see each other
    leaky = sum(_loss_sum(model, r.input_ids, r.position_ids, r.labels,
                          mask=torch.ones_like(r.input_ids)).double() for r in rows)
    assert abs(float(leaky / n - expected)) > 50 * PACK_RTOL * float(expected)


@pytest.mark.parametrize("kernels", [False, True])
@torch.no_grad()
def test_packed_loss_with_trainer_packed_loss(kernels):
    from tokenfab.train.model import apply_kernels, packed_loss

    model = _tiny_llama()
    if kernels:
        apply_kernels(model)
    examples = _examples(10, seed=2)
    rows = pack(examples, max_tokens=48)
    sums, counts = zip(*(packed_loss(model, r, kernels=kernels) for r in rows))
    assert list(counts) == [r.num_loss_tokens for r in rows]
    got = sum(s.double() for s in sums) / sum(counts)
    torch.testing.assert_close(got, _alone_mean(model, examples), rtol=PACK_RTOL, atol=0)
