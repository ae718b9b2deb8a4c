"""Speculative decoding over recurrent state (hybrid cache): rejected drafts taken back out of the state.

A verify forward feeds a sequence's last real token and its k drafts (k + 1 rows) through every layer. For
attention that only writes K/V rows, and the rows of rejected drafts are overwritten later. A recurrent layer
(Gated DeltaNet: a conv window and the delta-rule state) instead folds all k + 1 rows into its one state, and a
rejected draft cannot be subtracted out again. When m < k drafts are accepted, the state must be the one after
the first m + 1 rows only.

The design (``docs/hybrid-cache.md``, "Speculative decoding"): *snapshot, capture and replay*.

- Before the verify forward (``before_forward``) the states of the verifying sequences' slots are copied aside
  (every state tensor: conv and SSM), and a forward pre-hook on each recurrent layer keeps that layer's input
  rows for those sequences. The forward then runs unchanged, over the whole k + 1 rows.
- After acceptance (``after_accept``), a sequence that kept every draft keeps its state as is. For one that
  rejected some, the slot is restored from the copy and each recurrent layer is run again, alone, over the
  captured inputs of the accepted rows only (its output discarded): the layers' inputs at accepted positions
  are exactly those of the verify forward (causality), so each layer's state ends where plain decoding of the
  accepted tokens would leave it. The replay touches only the recurrent layers (no attention, no MLP), once
  per verify step for all rejecting sequences together.

This works for every proposer, not only MTP. A sequence whose forward was retried alone after a failure
(``runner/isolation.py``) is recomputed from position 0: its captured rows then start at 0 and the replay
starts from a fresh state, so no copy is needed for it; the last capture of a step wins.

Cost: one state copy per verifying sequence and step (device to device), the captured inputs (k + 1 rows of
hidden size per recurrent layer and verifying sequence), and on rejection one restore plus a replay of the
recurrent layers over m + 1 rows. vLLM instead keeps the state after each verified position (its spec-decode
state slots) and selects the accepted one, which needs kernels that write per-position states; ours reuse the
existing kernels unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tokenfab.engine.requests.sequence import Sequence
from tokenfab.engine.runner.state_cache import recurrent_state_layers
from tokenfab.forward_batch import ForwardBatch


def supports_rollback(model: nn.Module) -> bool:
    """Whether every recurrent-state layer of ``model`` can be tapped and replayed as ``forward(x, batch)``
    (Gated DeltaNet can; DeepSeek-V4's compressor rings cannot yet)."""
    return all(hasattr(m, "input_tap") for m in recurrent_state_layers(model))


@dataclass
class _Verify:
    """One verifying sequence of this step: where its rows were and what was kept of them."""

    seq: Sequence
    slot: int
    start: int  # position of its first row in the forward (0 after an isolated retry)
    rows: int  # its rows in the forward (k + 1, or its whole context after a retry)
    k: int  # drafts verified
    inputs: list[torch.Tensor]  # per recurrent layer: its input rows [rows, H]
    saved: dict[tuple[str, str], torch.Tensor] | None  # the slot's states before the forward (start > 0)


class RecurrentStateRollback:
    """Snapshot, capture and replay (module docstring) for one model and its bound state tensors."""

    def __init__(self, model: nn.Module, state_caches: dict[tuple[str, str], torch.Tensor]) -> None:
        self.layers = recurrent_state_layers(model)
        if not supports_rollback(model):
            raise ValueError(
                "speculative decoding needs every recurrent-state layer to take an input tap "
                "(speculative/state_rollback.py)"
            )
        self.state_caches = state_caches
        self._rows: torch.Tensor | None = None  # the rows to capture in the running forward
        self._batch: ForwardBatch | None = None
        self._captured: list[torch.Tensor | None] = [None] * len(self.layers)
        self._verifying: dict[str, _Verify] = {}
        self.replayed = 0  # sequence-steps whose state was rolled back (tests, stats)
        self._index = {id(m): i for i, m in enumerate(self.layers)}
        for m in self.layers:
            m.input_tap = self._tap

    def _tap(self, module: nn.Module, x: torch.Tensor, batch: ForwardBatch) -> None:
        if self._rows is not None and batch is self._batch:
            self._captured[self._index[id(module)]] = x.index_select(0, self._rows)

    def close(self) -> None:
        for m in self.layers:
            m.input_tap = None

    # ---- around the verify forward
    def before_forward(self, fb: ForwardBatch, seqs: list[Sequence], counts: list[int]) -> list[tuple]:
        """Copy aside the slots of the sequences that verify drafts in ``fb`` and arm the capture. Returns
        the plan ``after_forward`` needs (empty: nothing verifies, nothing armed)."""
        plan, rows, at = [], [], 0
        for s, n in zip(seqs, counts):
            k = len(s.spec_token_ids)
            if k and s.state_slot >= 0:
                plan.append((s, s.num_computed_tokens, n, k, len(rows)))
                rows.extend(range(at, at + n))
            at += n
        if not plan:
            return []
        dev = fb.input_ids.device
        slots = torch.tensor([s.state_slot for s, start, *_ in plan if start > 0], dtype=torch.long).to(dev)
        saved = {key: t.index_select(0, slots) for key, t in self.state_caches.items()} if slots.numel() else {}
        j = 0
        for i, (s, start, n, k, off) in enumerate(plan):
            mine = None
            if start > 0:
                mine = {key: t[j : j + 1] for key, t in saved.items()}
                j += 1
            plan[i] = (s, start, n, k, off, mine)
        self._rows = torch.tensor(rows, dtype=torch.long).to(dev)
        self._batch = fb
        self._captured = [None] * len(self.layers)
        return plan

    def after_forward(self, plan: list[tuple], ok: bool) -> None:
        """Keep each verifying sequence's captured rows (``ok``: the forward succeeded); disarm."""
        captured, self._rows, self._batch = self._captured, None, None
        self._captured = [None] * len(self.layers)
        if not ok or not plan:
            return
        if any(c is None for c in captured):
            raise RuntimeError(
                "a recurrent layer's input was not captured in a verify forward "
                "(layer called without the step's ForwardBatch?)"
            )
        for s, start, n, k, off, saved in plan:
            inputs = [c[off : off + n] for c in captured]  # type: ignore[index]
            self._verifying[s.request_id] = _Verify(s, s.state_slot, start, n, k, inputs, saved)

    # ---- after acceptance
    def after_accept(self, seqs: list[Sequence], emitted: list[int]) -> None:
        """``emitted[i]`` tokens came out of ``seqs[i]``'s verify (its accepted drafts and the target's
        token): its state must hold the rows up to the last accepted draft. Restores and replays every
        sequence that rejected a draft, all together; forgets this step's captures."""
        todo: list[tuple[_Verify, int]] = []
        for s, e in zip(seqs, emitted):
            v = self._verifying.pop(s.request_id, None)
            if v is None or e <= 0 or e >= v.k + 1 or s.state_slot != v.slot:
                continue  # all drafts kept (the state is right), failed, or its slot is gone
            todo.append((v, v.rows - (v.k + 1) + e))
        self._verifying.clear()
        if todo:
            self._replay(todo)

    @torch.inference_mode()
    def _replay(self, todo: list[tuple[_Verify, int]]) -> None:
        dev = next(iter(self.state_caches.values())).device
        restore = [v for v, _ in todo if v.saved is not None]
        if restore:
            slots = torch.tensor([v.slot for v in restore], dtype=torch.long).to(dev)
            for key, t in self.state_caches.items():
                t.index_copy_(0, slots, torch.cat([v.saved[key] for v in restore]))  # type: ignore[index]
        positions, cu = [], [0]
        for v, n in todo:
            positions.extend(range(v.start, v.start + n))
            cu.append(cu[-1] + n)
        ctx = [v.start + n for v, n in todo]
        batch = ForwardBatch(
            input_ids=torch.zeros(cu[-1], dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64).to(dev),
            slot_mapping=torch.full((cu[-1],), -1, dtype=torch.int64, device=dev),
            block_tables=torch.zeros(len(todo), 1, dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32).to(dev),
            context_lens=torch.tensor(ctx, dtype=torch.int32).to(dev),
            logits_indices=torch.tensor(cu[1:], dtype=torch.int64).to(dev) - 1,
            max_query_len=max(n for _, n in todo),
            max_context_len=max(ctx),
            state_slots=torch.tensor([v.slot for v, _ in todo], dtype=torch.int32).to(dev),
        )
        for i, layer in enumerate(self.layers):
            x = torch.cat([v.inputs[i][:n] for v, n in todo])
            layer.forward(x, batch)  # the state update is what counts; the output is dropped
        self.replayed += len(todo)

    def release(self, request_id: str) -> None:
        self._verifying.pop(request_id, None)
