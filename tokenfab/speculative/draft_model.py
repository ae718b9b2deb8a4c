"""Draft-model proposer: a smaller causal LM that shares the target's tokenizer drafts k tokens.

The draft runs through its own ``ModelRunner`` (the same loader, the same layers and kernels) over
its own paged KV cache, which is indexed by the TARGET's block tables (``speculative/draft_batch.py``). So
the draft cache holds K/V for exactly the tokens the target's does:

- every target forward (prefill chunks, decodes, verify rows) is followed by the draft's forward
  over the same ``ForwardBatch`` (``execute``): the draft writes K/V at the same slots; a prefix-cache
  hit reuses blocks whose draft K/V was written when the target wrote them; a preempted sequence is
  recomputed by both;
- before a verify step (``draft``), k draft steps of one row per sequence: the last real token at
  position n - 1, then each draft at the next position, all inside the blocks the scheduler has
  allocated for the k + 1 verify tokens. Their K/V is rewritten by the verify step's pass.

With the bundled model as its own draft (and batch-invariant kernels), every draft equals the
target's greedy token: acceptance 1.0 and k + 1 tokens per verify step.
"""

from __future__ import annotations

import time

import torch

from tokenfab.engine.requests.sequence import Sequence
from tokenfab.engine.runner.device_setup import maybe_pack_cpu_weights
from tokenfab.engine.runner.model_runner import ModelRunner
from tokenfab.forward_batch import ForwardBatch
from tokenfab.loader.errors import ModelLoadError
from tokenfab.loader.model_loader import load_model, text_config
from tokenfab.speculative.config import SpeculativeConfig
from tokenfab.speculative.draft_batch import TableRows, any_sampled, pick_drafts
from tokenfab.speculative.draft_cache import OwnCacheDraft
from tokenfab.speculative.target import TargetEngine


def check_vocab(target_tok, draft_tok, target_vocab: int, draft_vocab: int, where: str) -> None:
    """The draft must speak the target's token ids: the same tokenizer vocabulary when both have
    one, else the same vocabulary size. A ValueError otherwise."""
    if target_tok is not None and draft_tok is not None:
        tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
        if tv != dv:
            diff = len(set(tv.items()) ^ set(dv.items()))
            raise ValueError(f"speculative_config.model {where}: its tokenizer differs from the target's "
                             f"({len(dv)} vs {len(tv)} tokens, {diff} differing entries); a draft model must "
                             "share the target's tokenizer")
    elif draft_vocab != target_vocab:
        raise ValueError(f"speculative_config.model {where}: vocabulary size {draft_vocab} differs from the "
                         f"target's ({target_vocab}); a draft model must share the target's tokenizer")


class DraftModelProposer(OwnCacheDraft):
    def __init__(self, config: SpeculativeConfig, engine: TargetEngine) -> None:
        if not config.model:
            raise ValueError('speculative_config.model is required for method "draft_model" (the draft\'s path)')
        try:
            loaded = load_model(config.model, engine.dtype, engine.device, engine.max_model_len,
                                quantization=engine.args.quantization)
        except (ModelLoadError, OSError) as e:
            raise ValueError(f"speculative_config.model {config.model!r} cannot be loaded: {e}") from None
        self.vocab_size = text_config(loaded.config).vocab_size
        check_vocab(engine.tokenizer, loaded.tokenizer, engine.vocab_size, self.vocab_size, repr(config.model))
        self.target_vocab = engine.vocab_size
        self.module = self.model = loaded.model
        maybe_pack_cpu_weights(self.model, engine.device, engine.args.cpu_weight_packing)
        self.engine = engine
        self.runner: ModelRunner | None = None
        self.observe_seconds = 0.0

    def execute(self, runner: ModelRunner, fb: ForwardBatch, seqs: list[Sequence],
                counts: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target's forward, then the draft's over the same rows (K/V only)."""
        out = runner.execute_scoring(fb)
        t0 = time.perf_counter()
        self.model(fb)
        self.observe_seconds += time.perf_counter() - t0
        return out

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.model.compute_logits(hidden)
        v = self.target_vocab
        if logits.shape[1] > v:  # padded vocabulary rows: never drafted
            logits = logits[:, :v]
        elif logits.shape[1] < v:  # the target's padding rows: never drafted either
            logits = torch.nn.functional.pad(logits, (0, v - logits.shape[1]), value=float("-inf"))
        return logits

    @torch.inference_mode()
    def draft(self, seqs: list[Sequence], ks: list[int]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """k_i draft tokens per sequence (in target ids) and, when some request samples, the
        distribution q [k_i, V] each was drawn from."""
        out: list[list[int]] = [[] for _ in seqs]
        qs: list[torch.Tensor | None] = [None] * len(seqs)
        if not any(ks):
            return out, qs
        idx = [i for i, k in enumerate(ks) if k]
        got, got_q = self._draft([seqs[i] for i in idx], [ks[i] for i in idx])
        for i, d, q in zip(idx, got, got_q):
            out[i], qs[i] = d, q
        return out, qs

    def _draft(self, seqs: list[Sequence], ks: list[int]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        dev = self.engine.device
        rows = TableRows(seqs, self.runner.block_size, dev)
        want_q = any_sampled(seqs)
        live = list(range(len(seqs)))
        ids = torch.tensor([s.token_ids[-1] for s in seqs], dtype=torch.int64).to(dev)
        toks: list[list[torch.Tensor]] = [[] for _ in seqs]
        qs: list[list[torch.Tensor]] = [[] for _ in seqs]
        for j in range(max(ks)):
            keep = [i for i, w in enumerate(live) if ks[w] > j]
            if len(keep) != len(live):
                ids = ids.index_select(0, torch.tensor(keep, device=dev))
                live = [live[i] for i in keep]
            batch = rows.batch(live, [seqs[w].num_tokens - 1 + j for w in live], [1] * len(live), ids)
            logits = self._logits(self.model(batch))
            ids, q = pick_drafts(logits, [seqs[w] for w in live], [j] * len(live), want_q)
            for r, w in enumerate(live):
                toks[w].append(ids[r])
                if q is not None:
                    qs[w].append(q[r])
        host = torch.stack([t for ts in toks for t in ts]).tolist()  # the one host read
        out, at = [], 0
        for k in ks:
            out.append(host[at : at + k])
            at += k
        return out, [torch.stack(q) if q else None for q in qs]

    def release(self, request_id: str) -> None:
        pass
