"""Proposers fed by the target's own features: EAGLE-3 heads and DeepSeek-style MTP layers.

Both draft modules take, at position t, the target's feature at t (EAGLE-3: the residual stream
entering three target layers, ``speculative/eagle3.py``; MTP: the target's final hidden state after its
final norm, ``speculative/mtp.py``) and the token at t + 1, and predict the token at t + 2. Their paged
caches are indexed by the target's block tables (``speculative/draft_batch.py``).

The loop, per sequence:

- ``execute``: the target's forward also yields the features of every row it computes (prefill
  chunks, decodes, verify rows; no host sync); they are kept per request, by position, until the
  token after each position is known.
- ``draft`` (after the scheduler allocated the verify step's blocks), one catch-up forward over
  every scheduled sequence: the positions whose K/V the target has committed since the head last
  saw them (a prefill chunk, the accepted rows of the last verify: rejected rows are dropped), with
  the following token as input. For a decoding sequence the last such row is position n - 2 with
  the newest token as input: its logits give draft 1. Then k - 1 steps of one row per sequence, each
  feeding the head its own output as the feature (MTP: the last MTP layer, recursively, as vLLM does
  for k > num_nextn_predict_layers).

Positions served by the prefix cache never pass through the head here: their draft K/V is the one
written when the cached block was computed (a block whose last position was never caught up, e.g.
its request ended right after, holds a stale row there: only the acceptance rate can suffer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenfab.engine.requests.sequence import Sequence
from tokenfab.engine.runner.model_runner import ModelRunner
from tokenfab.engine.runner.state_cache import recurrent_state_layers
from tokenfab.forward_batch import ForwardBatch
from tokenfab.loader.errors import ModelLoadError
from tokenfab.loader.model_loader import text_config
from tokenfab.models.deepseek_v4 import DeepseekV4ForCausalLM
from tokenfab.speculative.config import SpeculativeConfig
from tokenfab.speculative.draft_batch import TableRows, any_sampled, pick_drafts
from tokenfab.speculative.draft_cache import OwnCacheDraft
from tokenfab.speculative.dsv4_mtp import load_dsv4_mtp
from tokenfab.speculative.eagle3 import aux_layer_ids, load_eagle3, target_forward_with_aux
from tokenfab.speculative.mtp import load_mtp, num_mtp_layers
from tokenfab.speculative.qwen_mtp import load_qwen_mtp
from tokenfab.speculative.target import TargetEngine


@dataclass
class _Pending:
    start: int  # position of feats[0]; positions before it have the head's K/V
    feats: torch.Tensor  # [n, F] target features of positions start .. start + n - 1


class FeatureDraftProposer(OwnCacheDraft):
    """The shared draft loop; subclasses give the module, the target forward and the head step."""


    def __init__(self, engine: TargetEngine) -> None:
        self.engine = engine
        self.runner: ModelRunner | None = None
        self._pending: dict[str, _Pending] = {}

    # ---- subclass hooks
    def target_forward(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(the target's final hidden states [T, H], the features [T, F] the head reads)."""
        raise NotImplementedError

    def head_step(self, ids: torch.Tensor, feats: torch.Tensor,
                  batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden states for the logits, the feature the next draft step reads), both [T, *]."""
        raise NotImplementedError

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def to_target(self, tokens: torch.Tensor, q: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft-vocabulary ids (and q) in the target's vocabulary."""
        return tokens, q

    # ---- the engine's side (and the cache's: draft_cache.py)
    def execute(self, runner: ModelRunner, fb: ForwardBatch, seqs: list[Sequence],
                counts: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target's forward (eager: the features come out of it), keeping each row's feature."""
        hidden, feats = self.target_forward(fb)
        model = runner.model
        logits = model.compute_logits(hidden.index_select(0, fb.logits_indices))
        prompt = hidden.index_select(0, fb.prompt_indices) if fb.prompt_indices is not None else None
        row = 0
        for s, n in zip(seqs, counts):
            self._add(s.request_id, s.num_computed_tokens, feats[row : row + n])
            row += n
        return logits, prompt

    def _add(self, request_id: str, start: int, f: torch.Tensor) -> None:
        p = self._pending.get(request_id)
        if p is None or start < p.start or start > p.start + p.feats.shape[0]:
            # first rows, a recompute after preemption, or a gap served by the prefix cache
            self._pending[request_id] = _Pending(start, f)
        else:  # rows from ``start`` on replace what was kept (rejected verify rows)
            p.feats = torch.cat([p.feats[: start - p.start], f])

    @torch.inference_mode()
    def draft(self, seqs: list[Sequence], ks: list[int]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Catch up every sequence in ``seqs``; k_i drafts (target ids) for those with k_i > 0,
        and their q [k_i, V] when some request samples."""
        dev = self.engine.device
        want_q = any_sampled([s for s, k in zip(seqs, ks) if k])
        which, starts, counts, ids, feats = [], [], [], [], []
        last_row: dict[int, int] = {}  # drafting sequence -> its catch-up block's last row
        rows = 0
        for i, s in enumerate(seqs):
            p = self._pending.get(s.request_id)
            if p is None:
                continue
            upto = min(s.num_computed_tokens, s.num_tokens - 1, p.start + p.feats.shape[0])
            n = upto - p.start
            if n <= 0:
                continue
            which.append(i)
            starts.append(p.start)
            counts.append(n)
            ids += s.token_ids[p.start + 1 : upto + 1]
            feats.append(p.feats[:n])
            p.feats, p.start = p.feats[n:], upto
            rows += n
            if ks[i] and upto == s.num_tokens - 1:
                last_row[i] = rows - 1
        out: list[list[int]] = [[] for _ in seqs]
        qs: list[torch.Tensor | None] = [None] * len(seqs)
        drafting = [i for i in last_row]
        if which:
            table = TableRows(seqs, self.runner.block_size, dev)
            lr = [last_row[i] for i in drafting]
            batch = table.batch(which, starts, counts, torch.tensor(ids, dtype=torch.int64).to(dev), lr)
            hid, nxt = self.head_step(batch.input_ids, torch.cat(feats), batch)
            if drafting:
                self._loop(table, drafting, [ks[i] for i in drafting], seqs, hid.index_select(0, batch.logits_indices),
                           nxt.index_select(0, batch.logits_indices), want_q, out, qs)
        for i, s in enumerate(seqs):  # no features to draft from (never expected): harmless guesses
            if ks[i] and i not in last_row:
                out[i] = [s.token_ids[-1]] * ks[i]
                if want_q:
                    qs[i] = torch.zeros(ks[i], self.engine.vocab_size, device=dev).index_fill_(1, torch.tensor(
                        [s.token_ids[-1]], device=dev), 1.0)
        return out, qs

    def _loop(self, table: TableRows, live: list[int], ks: list[int], seqs: list[Sequence],
              hid: torch.Tensor, feat: torch.Tensor, want_q: bool, out: list[list[int]],
              qs: list[torch.Tensor | None]) -> None:
        dev = self.engine.device
        kk = dict(zip(live, ks))
        toks: dict[int, list[torch.Tensor]] = {i: [] for i in live}
        qrows: dict[int, list[torch.Tensor]] = {i: [] for i in live}
        ids = torch.empty(0, dtype=torch.int64, device=dev)  # the previous step's drafts (target ids)
        for j in range(max(ks)):
            if j:
                keep = [r for r, i in enumerate(live) if kk[i] > j]
                if len(keep) != len(live):
                    sel = torch.tensor(keep, device=dev)
                    ids, feat = ids.index_select(0, sel), feat.index_select(0, sel)
                    live = [live[r] for r in keep]
                batch = table.batch(live, [seqs[i].num_tokens - 2 + j for i in live], [1] * len(live), ids)
                hid, feat = self.head_step(ids, feat, batch)
            logits = self.head_logits(hid)
            drawn, q = pick_drafts(logits, [seqs[i] for i in live], [j] * len(live), want_q)
            ids, q = self.to_target(drawn, q)
            for r, i in enumerate(live):
                toks[i].append(ids[r])
                if q is not None:
                    qrows[i].append(q[r])
        flat = [t for i in toks for t in toks[i]]
        host = torch.stack(flat).tolist()  # the one host read
        at = 0
        for i in toks:
            out[i] = host[at : at + kk[i]]
            at += kk[i]
            if qrows[i]:
                qs[i] = torch.stack(qrows[i])

    def release(self, request_id: str) -> None:
        self._pending.pop(request_id, None)


class Eagle3Proposer(FeatureDraftProposer):
    def __init__(self, config: SpeculativeConfig, engine: TargetEngine) -> None:
        super().__init__(engine)
        if not config.model:
            raise ValueError('speculative_config.model is required for method "eagle3" (the head\'s folder)')
        try:
            self.module = self.head = load_eagle3(config.model, engine.model, engine.dtype, engine.device,
                                                  engine.max_model_len)
        except (ModelLoadError, OSError) as e:
            raise ValueError(f"speculative_config.model {config.model!r} is not a usable EAGLE-3 head: {e}") from None
        text = text_config(engine.config)
        if self.head.target_hidden_size != text.hidden_size:
            raise ValueError(f"the EAGLE-3 head expects target hidden size {self.head.target_hidden_size}, "
                             f"the target has {text.hidden_size}")
        if self.head.config.vocab_size != engine.vocab_size:
            raise ValueError(f"the EAGLE-3 head's vocabulary ({self.head.config.vocab_size}) is not the "
                             f"target's ({engine.vocab_size})")
        self.layer_ids = aux_layer_ids(text.num_hidden_layers, self.head.config)

    def target_forward(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        return target_forward_with_aux(self.engine.model, fb, self.layer_ids)

    def head_step(self, ids, feats, batch):
        return self.head.forward(ids, feats, batch)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head.compute_logits(hidden)

    def to_target(self, tokens, q):
        tokens = self.head.to_target_ids(tokens)
        if q is not None:
            q = self.head.draft_probs_in_target_vocab(q, self.engine.vocab_size)
        return tokens, q


class MtpProposer(FeatureDraftProposer):
    def __init__(self, config: SpeculativeConfig, engine: TargetEngine) -> None:
        super().__init__(engine)
        if config.model:
            raise ValueError('speculative_config.model must be empty for method "mtp": the MTP layer comes from '
                             "the target's checkpoint")
        if isinstance(engine.model, DeepseekV4ForCausalLM):  # mtp.{j}.* in DeepSeek's layout (dsv4_mtp.py)
            self._load_dsv4(config, engine)
            return
        weights = getattr(engine.model, "mtp_weights", None)
        qwen = any(k.startswith("mtp.") for k in weights or ())  # Qwen3-Next / Qwen3.5: mtp.* (qwen_mtp.py)
        if not weights or (not qwen and num_mtp_layers(engine.config) < 1):
            raise ValueError('speculative_config.method "mtp": the target checkpoint has no MTP layer '
                             "(num_nextn_predict_layers = 0, or no weights past num_hidden_layers / no mtp.* "
                             "tensors)")
        try:
            if qwen:
                self.module = self.layer = load_qwen_mtp(engine.model, engine.dtype, engine.device,
                                                         engine.max_model_len)
            else:
                self.module = self.layer = load_mtp(engine.model, dtype=engine.dtype, device=engine.device)
        except ModelLoadError as e:
            raise ValueError(f'speculative_config.method "mtp": {e}') from None

    def _load_dsv4(self, config: SpeculativeConfig, engine: TargetEngine) -> None:
        try:
            self.module = self.layer = load_dsv4_mtp(engine.model, str(engine.args.model), engine.dtype, engine.device)
        except ModelLoadError as e:
            raise ValueError(f'speculative_config.method "mtp": {e}') from None
        for m in recurrent_state_layers(self.layer):  # its ring also takes the rows of rejected drafts
            m.reserve_speculative_rows(config.num_speculative_tokens)

    def target_forward(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        own = getattr(self.layer, "target_forward", None)  # DeepSeek-V4: the features are the residual streams
        if own is not None:
            return own(self.engine.model, fb)
        hidden = self.engine.model(fb)
        return hidden, hidden

    def head_step(self, ids, feats, batch):
        n = self.layer.forward(ids, feats, batch)
        return n, n

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.layer.compute_logits(hidden)
