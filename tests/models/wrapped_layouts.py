"""Tiny checkpoints in two published layouts built on DeepSeek-V3 (issue 29).

- ``write_kimi_k25``: Kimi K2.5 as moonshotai ships it: a ``kimi_k25`` vision-language wrapper config
  (``architectures: KimiK25ForConditionalGeneration``) whose ``text_config`` is the DeepSeek-V3 text model
  (``model_type: kimi_k2``, which transformers 5.24 reads as ``deepseek_v3``), the ``quantization_config``
  inside ``text_config`` when the experts are compressed-tensors W4A16, the text weights under
  ``language_model.model.*`` / ``language_model.lm_head.*`` and a (tiny, random) vision tower and projector
  under ``vision_tower.*`` / ``mm_projector.*`` in the original checkpoint's names.
- ``write_gigachat3``: GigaChat3 (Lightning / Ultra) as ai-sage ships it: a plain DeepSeek-V3 checkpoint
  (``model_type: deepseek_v3``, ``DeepseekV3ForCausalLM``; transformers 5.24 has no GigaChat module) with
  ``num_nextn_predict_layers: 1`` and its MTP layer stored as decoder layer ``num_hidden_layers``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

# a 2-block vision tower in the original checkpoint's names (transformers renames norm0/norm1, fc0/fc1 on load)
_VISION = {"hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 2, "num_hidden_layers": 2,
           "patch_size": 14, "pos_emb_height": 4, "pos_emb_width": 4, "pos_emb_time": 2,
           "merge_kernel_size": [2, 2]}


def _vision_tensors(text_hidden: int) -> dict[str, torch.Tensor]:
    h, i = _VISION["hidden_size"], _VISION["intermediate_size"]
    g = torch.Generator().manual_seed(7)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    out = {"vision_tower.patch_embed.proj.weight": r(h, 3, 14, 14), "vision_tower.patch_embed.proj.bias": r(h),
           "vision_tower.patch_embed.pos_emb.weight": r(4, 4, h),
           "vision_tower.encoder.final_layernorm.weight": torch.ones(h),
           "vision_tower.encoder.final_layernorm.bias": torch.zeros(h)}
    for b in range(_VISION["num_hidden_layers"]):
        p = f"vision_tower.encoder.blocks.{b}."
        for n in ("norm0", "norm1"):
            out[p + n + ".weight"], out[p + n + ".bias"] = torch.ones(h), torch.zeros(h)
        out[p + "wqkv.weight"], out[p + "wqkv.bias"] = r(3 * h, h), r(3 * h)
        out[p + "wo.weight"], out[p + "wo.bias"] = r(h, h), r(h)
        out[p + "mlp.fc0.weight"], out[p + "mlp.fc0.bias"] = r(i, h), r(i)
        out[p + "mlp.fc1.weight"], out[p + "mlp.fc1.bias"] = r(h, i), r(h)
    merged = h * 4
    out["mm_projector.pre_norm.weight"], out["mm_projector.pre_norm.bias"] = torch.ones(h), torch.zeros(h)
    out["mm_projector.proj.0.weight"], out["mm_projector.proj.0.bias"] = r(merged, merged), r(merged)
    out["mm_projector.proj.2.weight"], out["mm_projector.proj.2.bias"] = r(text_hidden, merged), r(text_hidden)
    return out


def write_kimi_k25(src: Path, dst: Path, vision: bool = True) -> Path:
    """Wrap the DeepSeek-V3 checkpoint at ``src`` (plain or compressed-tensors INT4) as Kimi K2.5 at ``dst``."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, dst / f.name)
    text = json.loads((src / "config.json").read_text())
    for key in ("architectures", "transformers_version", "dtype", "torch_dtype"):
        text.pop(key, None)
    text["model_type"] = "kimi_k2"  # as shipped; transformers maps it to deepseek_v3
    qc = text.get("quantization_config")
    if qc is not None:  # the vision tower and projector stay unquantized
        qc["ignore"] = list(qc.get("ignore", [])) + ["re:.*vision_tower.*", "re:.*mm_projector.*"]
    cfg = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
           "text_config": text, "tie_word_embeddings": False, "projection_hidden_size": _VISION["hidden_size"],
           "media_placeholder_token_id": 163605}
    if vision:
        cfg["vision_config"] = dict(_VISION)
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    tensors = {"language_model." + k: v for k, v in load_file(str(src / "model.safetensors")).items()}
    if vision:
        tensors.update(_vision_tensors(text["hidden_size"]))
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


# ------------------------------------------------------------------ GigaChat3

# DeepSeek-V3 shape as GigaChat3 configures it (MLA, sigmoid grouped routing with shared experts, one MTP layer)
GIGACHAT3 = dict(num_hidden_layers=3, first_k_dense_replace=1, num_nextn_predict_layers=1)


def write_gigachat3(path: Path, **overrides: Any) -> tuple[Any, Any, dict[str, torch.Tensor]]:
    """A tiny GigaChat3 at ``path``: transformers' DeepseekV3ForCausalLM (random, fp32) + its MTP layer at index
    ``num_hidden_layers`` (DeepSeek's published per-expert layout, a second shard); returns
    (hf model, hf MTP layer, MTP extras) for the references of tests/speculative/test_mtp.py."""
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    from tests.models.test_deepseek import DEEPSEEK_COMMON, save_tiny_deepseek
    from tests.speculative.test_mtp import write_mtp_layer

    kw = {**GIGACHAT3, **overrides}
    hf = save_tiny_deepseek(path, **kw)
    n = kw["num_hidden_layers"]
    config = transformers.DeepseekV3Config(**{**DEEPSEEK_COMMON, **kw})
    layer, extras = write_mtp_layer(path, DeepseekV3DecoderLayer, config, n)
    return hf, layer, extras


# a word-level vocabulary whose pieces concatenate (Fuse decoder) into GigaChat3's tool-call text
FORCED_PIECES = ["function call", "<|role_sep|>", "\n", '{"name": "add", "arguments": ', '{"a": 1, "b": 2}', "}"]
FORCED_TEXT = "".join(FORCED_PIECES)
GIGACHAT_TEMPLATE = ("{% for m in messages %}{{ m.role }} {{ m.content }} {% endfor %}"
                     "{# tools are called as: function call<|role_sep|> then a JSON object #}assistant")


def write_forced_gigachat3(path: Path) -> Path:
    """A GigaChat3-layout checkpoint (DeepSeek-V3 + MTP layer) whose greedy output after any prompt is
    ``FORCED_TEXT`` then EOS: every layer's output projections are zero, so the final hidden state is the
    last token's one-hot embedding, and ``lm_head`` maps each token to its successor in ``FORCED_PIECES``
    (any other token to the first piece, the last piece to ``</s>``). Its tokenizer is word-level over those
    pieces with a chat template that names GigaChat3's call marker (so the gigachat3 tool parser is picked)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>", *FORCED_PIECES]
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.Fuse()
    hidden = 64
    write_gigachat3(path, vocab_size=len(words), bos_token_id=1, eos_token_id=2, hidden_size=hidden)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "chat_template": GIGACHAT_TEMPLATE}))
    first = vocab[FORCED_PIECES[0]]
    succ = {i: first for i in range(len(words))}
    for a, b in zip(FORCED_PIECES, [*FORCED_PIECES[1:], "</s>"]):
        succ[vocab[a]] = vocab[b]
    tensors = load_file(str(path / "model.safetensors"))
    for name in tensors:
        if "o_proj" in name or "down_proj" in name:
            tensors[name] = torch.zeros_like(tensors[name])
    embed = torch.zeros(len(words), hidden)
    embed[torch.arange(len(words)), torch.arange(len(words))] = 1.0
    head = torch.zeros(len(words), hidden)
    for i, j in succ.items():
        head[j, i] = 1.0
    tensors["model.embed_tokens.weight"], tensors["lm_head.weight"] = embed, head
    tensors["model.norm.weight"] = torch.ones(hidden)
    save_file(tensors, str(path / "model.safetensors"))
    return path
