"""Two-batch overlap (TBO): one micro-batch's collective runs while the other micro-batch computes.

SGLang's two-batch overlap, written on ``torch.distributed``'s ``async_op``. A step's sequences are
split in two micro-batches (whole sequences, about half the tokens each). The layer sequence is
written once, as generators with yield points (``DecoderModel.forward_stages`` /
``DecoderLayer.forward_stages`` in ``models/llama.py``): a stage ends right after a module call whose
last operation is a collective (the attention's o_proj all-reduce, the MLP's or the TP-split experts'
down-projection all-reduce, or a module with stages of its own). In an overlapped step that
collective is launched with ``async_op=True`` and the stage yields its ``Work`` handles; the
scheduler (``run_overlapped``) then runs the *other* micro-batch's next stage before it waits::

    A: attention ─► all-reduce(A) launched ······························· wait ─► MLP ─► ...
    B:                                  attention ─► all-reduce(B) launched ········ wait ─► ...

Outside an overlapped step the layers' ``forward`` runs: a generator-free copy of the same lines
(torch.compile's fullgraph tracing does not carry generators' return values), while the EP dispatch
and combine are written once, as generators that ``run_plain`` drains at once.

Which module calls end in their collective: modules declare ``ends_in_all_reduce`` (true when their
last op is a row-parallel linear with ``reduce_output``; ``LlamaAttention``, ``LlamaMLP``,
``GatedMLP``, a TP-split ``FusedMoE`` without shared experts). Other modules (expert-parallel
dispatch/combine, MLA) run their collectives synchronously inside the stage: correct, not overlapped.
A deferred call that issues more than one collective is an error (its first result would be read
before it arrived).

Every rank of a group must issue the same collectives in the same order: the split and the switch
depend only on the batch (the same on every TP rank) and on the configuration (the same flags on
every rank). Ranks that run different batches (attention data-parallel) would have to agree on the
switch and on each micro-batch's EP dispatch mode first: not done here.

Measured (``tokenfab bench comm --tbo``) only on CPU gloo ranks sharing two loaded cores, where it
is informational: the collective's gloo thread competes with the other micro-batch's compute for the
same cores, and loopback is not NVLink. The switch is off by default.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from tokenfab.distributed import parallel_state as ps
from tokenfab.forward_batch import ForwardBatch

# what a stage yields: the Work handles of the collectives it launched (empty: nothing pending)
Stages = Generator[list, None, Any]

# default switch point (tokens in the step): below it the split costs more than the overlap can save
# (two half-size launches of every kernel). From CPU gloo only (tokenfab bench comm --tbo, 2 ranks, a
# 4-layer H 512 Llama, 4 sequences; benchmarks/results/cpu_tbo_llama_tp2.json): plain/TBO 0.60-0.86 at
# 256 tokens, 0.96-1.04 at 1024, 1.21-1.67 at 2048 (three runs on a loaded shared machine).
# Informational; re-measure on the GPU interconnect before relying on it.
DEFAULT_MIN_TOKENS = 1024


@dataclass
class TBOConfig:
    enabled: bool = False
    min_tokens: int = DEFAULT_MIN_TOKENS


_config = TBOConfig()
_overlapping = False  # inside run_overlapped: module calls that end in a collective are deferred
# collectives launched asynchronously so far in this process (tests check that overlap really happened)
stats = {"overlapped_steps": 0, "deferred_collectives": 0}


def configure(enabled: bool, min_tokens: int | None = None) -> TBOConfig:
    """Switch TBO on or off for the following steps (every rank of the group, with the same values)."""
    global _config
    if min_tokens is not None and min_tokens < 2:
        raise ValueError(f"--tbo-min-tokens must be >= 2 (two micro-batches), got {min_tokens}")
    _config = TBOConfig(bool(enabled), DEFAULT_MIN_TOKENS if min_tokens is None else int(min_tokens))
    return _config


def configure_from_args(args: Any) -> TBOConfig:
    """From EngineArgs (``enable_two_batch_overlap``, ``tbo_min_tokens``); absent fields mean off."""
    return configure(bool(getattr(args, "enable_two_batch_overlap", False)), getattr(args, "tbo_min_tokens", None))


def get_config() -> TBOConfig:
    return _config


def wanted(batch: ForwardBatch) -> bool:
    """Whether this step runs as two overlapped micro-batches: on, a collective to hide (TP or EP
    > 1), at least ``min_tokens`` tokens and two sequences to split."""
    if not _config.enabled or _overlapping:
        return False
    if batch.input_ids.is_cuda and torch.cuda.is_current_stream_capturing():
        return False  # CUDA graph capture: the split reads index tensors on the host
    s = ps.get_parallel_state()
    return (s.tp_size > 1 or s.ep_size > 1) and batch.num_tokens >= _config.min_tokens and batch.num_seqs >= 2


def model_allows(model: Any) -> bool:
    """Whether ``model``'s layers may interleave two micro-batches: no module declares
    ``tbo_unsafe`` (state carried from one layer to the next within a batch, e.g. DSA layers reusing
    the previous layer's top-k indices: the other micro-batch's would be read), and no FP8 KV layer
    is still calibrating on its first batch (it would calibrate on one micro-batch only)."""
    static = model.__dict__.get("_tbo_static")
    if static is None:
        mods = list(model.modules())
        static = not any(getattr(m, "tbo_unsafe", False) for m in mods)
        model.__dict__["_tbo_static"] = static
        model.__dict__["_tbo_calibrating"] = [m for m in mods if hasattr(m, "kv_calibrate")]
    return static and not any(m.kv_calibrate for m in model.__dict__["_tbo_calibrating"])


# ---------------------------------------------------------------------------------------- split


def split_point(cu: list[int]) -> int:
    """The sequence index s (1 <= s < B) whose boundary cu[s] is nearest half the tokens (the first
    such on a tie): micro-batch A is sequences [0, s), B is [s, B)."""
    b, half = len(cu) - 1, cu[-1] / 2
    if b < 2:
        raise ValueError(f"two micro-batches need at least two sequences, got {b}")
    return min(range(1, b), key=lambda s: abs(cu[s] - half))


def _sub_batch(batch: ForwardBatch, lo: int, hi: int, cu: list[int], ctx: list[int],
               logits: torch.Tensor, prompt: torch.Tensor | None) -> ForwardBatch:
    """Sequences [lo, hi) of ``batch`` as a batch of their own (token rows cu[lo]:cu[hi]); its
    logits/prompt indices are the rows inside that range, relative to its first token."""
    t0, t1 = cu[lo], cu[hi]

    def rows(idx: torch.Tensor) -> torch.Tensor:  # sorted ascending (the runner builds them in order)
        a, b = torch.searchsorted(idx, torch.tensor([t0, t1], dtype=idx.dtype)).tolist()
        return idx[a:b] - t0

    dev = batch.logits_indices.device
    return ForwardBatch(
        input_ids=batch.input_ids[t0:t1],
        positions=batch.positions[t0:t1],
        slot_mapping=batch.slot_mapping[t0:t1],
        block_tables=batch.block_tables[lo:hi],
        cu_seqlens_q=batch.cu_seqlens_q[lo:hi + 1] - t0,
        context_lens=batch.context_lens[lo:hi],
        logits_indices=rows(logits).to(dev),
        max_query_len=max(cu[i + 1] - cu[i] for i in range(lo, hi)),
        max_context_len=max(ctx[lo:hi]),
        prompt_indices=None if prompt is None else rows(prompt).to(dev),
    )


def split_batch(batch: ForwardBatch) -> tuple[ForwardBatch, ForwardBatch]:
    """Two micro-batches of whole sequences, about half the tokens each, in order (A's tokens, then
    B's): their hidden states concatenated are the batch's rows, and A's logits rows followed by B's
    (offset by A's tokens) are ``batch.logits_indices`` (``merge_indices``).

    Reads the small index tensors on the host (cu_seqlens_q, context_lens, logits/prompt indices):
    free on CPU, one small device-to-host copy per overlapped step on a GPU."""
    cu = batch.cu_seqlens_q.tolist()
    ctx = batch.context_lens.tolist()
    logits = batch.logits_indices.cpu()
    prompt = None if batch.prompt_indices is None else batch.prompt_indices.cpu()
    s = split_point(cu)
    b = batch.num_seqs
    latest = ForwardBatch.latest
    try:
        return (_sub_batch(batch, 0, s, cu, ctx, logits, prompt), _sub_batch(batch, s, b, cu, ctx, logits, prompt))
    finally:
        ForwardBatch.latest = latest  # the micro-batches are views of the step's batch, not a new step


def merge_indices(a: ForwardBatch, b: ForwardBatch, num_tokens_a: int) -> torch.Tensor:
    """The step's logits indices from its micro-batches' (B's rows offset by A's tokens)."""
    return torch.cat((a.logits_indices, b.logits_indices + num_tokens_a))


# ---------------------------------------------------------------------------------------- stages


def overlapping() -> bool:
    """Whether an overlapped step is running (stages may launch their collectives and yield)."""
    return _overlapping


@contextlib.contextmanager
def deferred() -> Iterator[list]:
    """TP all-reduces and EP all-to-alls issued inside are launched with async_op=True; their Work
    handles collect in the yielded list (``parallel_state`` reads ``ParallelState.deferred``)."""
    s = ps.get_parallel_state()
    prev, works = s.deferred, []
    s.deferred = works
    try:
        yield works
    finally:
        s.deferred = prev
    stats["deferred_collectives"] += len(works)
    if len(works) > 1:
        for w in works:
            w.wait()
        raise RuntimeError(f"a deferred module call issued {len(works)} collectives; only its last may be deferred "
                           "(a deferred call must end in its only collective)")


_stages_of: dict[type, bool] = {}


def _has_stages(cls: type) -> bool:
    """Whether ``cls.forward_stages`` is its forward (a subclass that overrides ``forward`` but not
    ``forward_stages`` is called through its ``forward``)."""
    known = _stages_of.get(cls)
    if known is None:
        def owner(name: str) -> type | None:
            return next((k for k in cls.__mro__ if name in k.__dict__), None)

        st, fw = owner("forward_stages"), owner("forward")
        known = _stages_of[cls] = st is not None and fw is not None and issubclass(st, fw)
    return known


def call(module: Any, *args: Any) -> Stages:
    """Stages of one module call (``x = yield from call(m, ...)``). In an overlapped step: the
    module's own stages if it has ``forward_stages``, else, for a module that ``ends_in_all_reduce``,
    the call with its all-reduce launched asynchronously and its Work handles yielded (a yield point),
    else a plain call. Outside one: ``module.forward``, no yield."""
    if not _overlapping:
        return module.forward(*args)
    if _has_stages(type(module)):
        return (yield from module.forward_stages(*args))
    if getattr(module, "ends_in_all_reduce", False):
        return (yield from collective(module.forward, *args))
    return module.forward(*args)


def collective(fn: Any, *args: Any, **kwargs: Any) -> Stages:
    """``out = yield from collective(fn, ...)``: a yield point after ``fn``, whose last operation is
    its only collective (``tp_all_reduce``, ``ep_all_to_all``): in an overlapped step the collective
    is launched asynchronously and the stage ends; ``out`` is read only after its wait. Otherwise a
    plain call."""
    if not _overlapping:
        return fn(*args, **kwargs)
    with deferred() as works:
        out = fn(*args, **kwargs)
    yield works
    return out


def run_plain(stages: Stages) -> Any:
    """Drain one generator of stages at once, waiting on whatever a stage launched (plain path)."""
    try:
        while True:
            for w in next(stages):
                w.wait()
    except StopIteration as done:
        return done.value


def run_overlapped(first: Stages, second: Stages) -> tuple[Any, Any]:
    """Alternate two micro-batches' stages: run one's next stage (its collectives launched), then
    the other's, waiting on a micro-batch's pending collectives only just before its next stage.
    A micro-batch that finishes early lets the other run on alone. Returns both results."""
    global _overlapping
    gens = [first, second]
    pending: list[list] = [[], []]
    results: list[Any] = [None, None]
    live = [0, 1]
    prev, _overlapping = _overlapping, True
    try:
        while live:
            for i in list(live):
                for w in pending[i]:
                    w.wait()
                try:
                    pending[i] = next(gens[i])
                except StopIteration as done:
                    pending[i], results[i] = [], done.value
                    live.remove(i)
    finally:
        _overlapping = prev
        for p in pending:  # an error: leave no launched collective unwaited
            for w in p:
                with contextlib.suppress(Exception):
                    w.wait()
    return results[0], results[1]


def forward(model: Any, batch: ForwardBatch) -> torch.Tensor:
    """Hidden states [T, H] of ``batch`` through ``model.forward_stages(micro_batch)`` for its two
    micro-batches, overlapped; rows in the batch's order (A's tokens, then B's)."""
    a, b = split_batch(batch)
    stats["overlapped_steps"] += 1
    ha, hb = run_overlapped(model.forward_stages(a), model.forward_stages(b))
    return torch.cat((ha, hb))

