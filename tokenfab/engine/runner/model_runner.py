"""Turns a scheduled batch into one ForwardBatch, runs the model, returns logits.

Owns the KV cache memory: one tensor [num_layers, 2, num_blocks, block_size, Hkv, D] per cache
dtype whose per-layer slices are bound to the model's Attention modules; for models whose cache-owning
modules declare ``kv_cache_spec()`` instead (MLA), one tensor [num_layers, num_blocks, block_size,
*spec] per dtype whose slices are bound to ``module.kv_cache``. A layer's dtype is its
``kv_cache_dtype`` (set by ``quant.kv_fp8.configure_kv_cache`` from ``--kv-cache-dtype``), else the
model dtype; FP8 layers also get their scales bound (``quant.kv_fp8.bind_scales``).
Modules that keep per-sequence recurrent state (``recurrent_state_spec()``) get their state tensors,
one row per state slot, bound beside the paged cache (``runner/state_cache.py``).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tokenfab.engine.requests.sequence import Sequence
from tokenfab.engine.requests.state_snapshots import StateSnapshots
from tokenfab.engine.runner.state_cache import SnapshotRows, bind_state_caches, recurrent_state_layers
from tokenfab.forward_batch import ForwardBatch
from tokenfab.kernels.batch_invariant import batch_invariant_mode
from tokenfab.layers.attention import Attention
from tokenfab.quant.kv_fp8 import bind_scales, cache_dtype


def attention_layers(model: nn.Module) -> list[Attention]:
    return [m for m in model.modules() if isinstance(m, Attention)]


def latent_cache_layers(model: nn.Module) -> list[nn.Module]:
    """Modules that own one per-token cache entry of their own layout (MLA's latent + rope key):
    they declare ``kv_cache_spec() -> per-token shape`` and get ``module.kv_cache`` bound."""
    return [
        m for m in model.modules() if callable(getattr(m, "kv_cache_spec", None)) and not isinstance(m, Attention)
    ]


def paged_cache_layers(model: nn.Module) -> list[nn.Module]:
    """Modules whose caches have shapes of their own, per block (DeepSeek-V4: a token row and compressed
    entries at the layer's ratio): they declare ``paged_cache_shapes(block_size) -> {attribute: per-block
    shape}`` and get each attribute bound to a [num_blocks, *shape] tensor of the model dtype."""
    return [m for m in model.modules() if callable(getattr(m, "paged_cache_shapes", None))]


def paged_cache_bytes_per_block(model: nn.Module, dtype: torch.dtype, block_size: int) -> int:
    return sum(math.prod(s) * dtype.itemsize for m in paged_cache_layers(model)
               for s in m.paged_cache_shapes(block_size).values())


def kv_bytes_per_token(model: nn.Module, dtype: torch.dtype, block_size: int = 16) -> int:
    """Bytes of K and V (or of the latent cache entries) one token takes across all layers, each
    layer in its own cache dtype (``kv_cache_dtype``, else ``dtype``); per-block caches
    (``paged_cache_layers``) counted as their bytes per block / ``block_size``, rounded up."""
    def elem(m: nn.Module) -> int:
        return cache_dtype(m, dtype).itemsize

    latent = sum(math.prod(m.kv_cache_spec()) * elem(m) for m in latent_cache_layers(model))
    latent += -(-paged_cache_bytes_per_block(model, dtype, block_size) // block_size)
    return latent + sum(2 * a.num_kv_heads * a.head_dim * elem(a) for a in attention_layers(model))


def _by_dtype(modules: list[nn.Module], default: torch.dtype) -> dict[torch.dtype, list[nn.Module]]:
    """Modules grouped by cache dtype, the model dtype's group first."""
    groups: dict[torch.dtype, list[nn.Module]] = {default: []}
    for m in modules:
        groups.setdefault(cache_dtype(m, default), []).append(m)
    return {d: ms for d, ms in groups.items() if ms}


class ModelRunner:
    #: Run this runner's forwards batch-invariant (``kernels.batch_invariant``): each row's logits
    #: independent of the rest of the batch (speculative decoding's verify rows = its decode rows).
    #: Scoped to this runner's forwards, so another engine in the process keeps its own numerics;
    #: None: the caller's mode (``batch_invariant_mode`` around the call, else the default).
    batch_invariant: bool | None = None

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        dtype: torch.dtype,
        block_size: int,
        num_blocks: int,
        num_state_slots: int = 0,
    ) -> None:
        self.model = model
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        layers = attention_layers(model)
        latent = latent_cache_layers(model)
        #: one cache tensor per dtype (``kv_cache``: the first, the model dtype's when it has layers)
        self.kv_caches: dict[torch.dtype, torch.Tensor] = {}
        paged = paged_cache_layers(model)
        if paged:
            self._bind_paged_caches(paged)
            owners = paged
        elif latent and not layers:
            self._bind_latent_cache(latent)
            owners = latent
        else:
            shapes = {(a.num_kv_heads, a.head_dim) for a in layers}
            if len(shapes) != 1:
                raise NotImplementedError("layers with different KV shapes need per-layer caches")
            hkv, hd = shapes.pop()
            for cdtype, group in _by_dtype(layers, dtype).items():
                cache = torch.zeros(len(group), 2, num_blocks, block_size, hkv, hd, dtype=cdtype, device=device)
                self.kv_caches[cdtype] = cache
                for i, layer in enumerate(group):
                    layer.k_cache = cache[i, 0]
                    layer.v_cache = cache[i, 1]
            owners = layers
        self.kv_cache = next(iter(self.kv_caches.values()))
        #: float32 [n_fp8_layers, 2] (k, v) scales of the FP8 layers (None without any)
        self.kv_scales = bind_scales(owners, device)
        self._cache_owners = owners
        #: some FP8 layer still awaits its first-batch calibration: steps run eagerly until none does
        self.kv_calibrating = any(m.kv_calibrate for m in owners)
        #: hybrid cache: the recurrent-state tensors by (module path, name), rows = slots + 1 scratch row
        self.num_state_slots = num_state_slots
        self.state_caches: dict[tuple[str, str], torch.Tensor] = {}
        if recurrent_state_layers(model):
            if num_state_slots < 1:
                raise ValueError("this model keeps per-sequence recurrent state: the runner needs num_state_slots >= 1")
            self.state_caches = bind_state_caches(model, num_state_slots, device)
        #: hybrid prefix caching: state snapshot rows (``attach_state_snapshots``; None: off)
        self.state_snapshots: SnapshotRows | None = None

    def attach_state_snapshots(self, index: StateSnapshots) -> None:
        """Allocate the snapshot rows of hybrid prefix caching (their bytes are in the KV budget)."""
        self.state_snapshots = SnapshotRows(index, self.state_caches)

    def _bind_paged_caches(self, modules: list[nn.Module]) -> None:
        """Per-layer cache shapes (``paged_cache_layers``): one flat tensor of the model dtype, carved into
        each module's [num_blocks, *per-block shape] caches."""
        shapes = [(m, name, (self.num_blocks, *shape)) for m in modules
                  for name, shape in m.paged_cache_shapes(self.block_size).items()]
        flat = torch.zeros(sum(math.prod(s) for _, _, s in shapes), dtype=self.dtype, device=self.device)
        self.kv_caches[self.dtype] = flat
        at = 0
        for m, name, shape in shapes:
            setattr(m, name, flat[at : at + math.prod(shape)].view(shape))
            at += math.prod(shape)

    def _bind_latent_cache(self, modules: list[nn.Module]) -> None:
        """MLA: one tensor [num_layers, num_blocks, block_size, *per-token shape] per dtype, sliced per layer."""
        specs = {tuple(m.kv_cache_spec()) for m in modules}
        if len(specs) != 1:
            raise NotImplementedError("layers with different cache shapes need per-layer caches")
        spec = specs.pop()
        for cdtype, group in _by_dtype(modules, self.dtype).items():
            cache = torch.zeros(len(group), self.num_blocks, self.block_size, *spec, dtype=cdtype, device=self.device)
            self.kv_caches[cdtype] = cache
            for i, m in enumerate(group):
                m.kv_cache = cache[i]

    def prepare(
        self, seqs: list[Sequence], num_new_tokens: list[int], sample_mask: list[bool],
        prompt_rows: list[tuple[int, int]] | None = None,
    ) -> ForwardBatch:
        """Flatten the scheduled chunks into one batch (host lists -> one copy to device).

        ``prompt_rows``: per sequence, the (first, end) offsets inside its chunk whose hidden
        states are kept for prompt logprobs (``execute_scoring``); None: none anywhere.
        A sequence with k speculative drafts (``seq.spec_token_ids``, counted in its new tokens)
        gets them after its known tokens, and logits for its last k + 1 rows (the verify rows)."""
        if self.state_snapshots is not None:  # hybrid prefix caching: copies between slots and snapshots
            self.state_snapshots.before_forward(seqs, self.block_size)
        input_ids: list[int] = []
        positions: list[int] = []
        cu = [0]
        ctx_lens: list[int] = []
        max_blocks = 0
        for seq, n in zip(seqs, num_new_tokens):
            start = seq.num_computed_tokens
            input_ids += seq.token_ids[start : start + n]
            if start + n > seq.num_tokens:  # draft tokens to verify
                input_ids += seq.spec_token_ids[: start + n - seq.num_tokens]
            positions += range(start, start + n)
            cu.append(cu[-1] + n)
            ctx_lens.append(start + n)
            max_blocks = max(max_blocks, len(seq.block_table))
        tables = [s.block_table + [0] * (max_blocks - len(s.block_table)) for s in seqs]
        dev = self.device
        pos_t = torch.tensor(positions, dtype=torch.int64)
        tables_t = torch.tensor(tables, dtype=torch.int32).view(len(seqs), max_blocks)
        cu_t = torch.tensor(cu, dtype=torch.int32)
        bs = self.block_size
        if all(n == 1 for n in num_new_tokens):
            # decode: one token a sequence, so its slot is one lookup in its own table (at decode
            # batch sizes cheaper than the six small tensor ops below: ~0.1 ms a step on CPU)
            slots = torch.tensor([s.block_table[p // bs] * bs + p % bs for s, p in zip(seqs, positions)],
                                 dtype=torch.int64)
        else:
            q_lens = torch.tensor(num_new_tokens, dtype=torch.int64)
            seq_of_token = torch.repeat_interleave(torch.arange(len(seqs)), q_lens)
            block_of_token = tables_t[seq_of_token, pos_t // bs].long()
            slots = block_of_token * bs + pos_t % bs
        logits_idx = [r for i, s in enumerate(sample_mask) if s
                      for r in range(cu[i + 1] - 1 - len(seqs[i].spec_token_ids), cu[i + 1])]
        prompt_idx = None
        if prompt_rows is not None:
            rows = [r for i, (a, b) in enumerate(prompt_rows) for r in range(cu[i] + a, cu[i] + b)]
            if rows:
                prompt_idx = torch.tensor(rows, dtype=torch.int64).to(dev, non_blocking=True)
        return ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64).to(dev, non_blocking=True),
            positions=pos_t.to(dev, non_blocking=True),
            slot_mapping=slots.to(dev, non_blocking=True),
            block_tables=tables_t.to(dev, non_blocking=True),
            cu_seqlens_q=cu_t.to(dev, non_blocking=True),
            context_lens=torch.tensor(ctx_lens, dtype=torch.int32).to(dev, non_blocking=True),
            logits_indices=torch.tensor(logits_idx, dtype=torch.int64).to(dev, non_blocking=True),
            max_query_len=max(num_new_tokens),
            max_context_len=max(ctx_lens),
            prompt_indices=prompt_idx,
            state_slots=self._state_slots(seqs),
        )

    def _state_slots(self, seqs: list[Sequence]) -> torch.Tensor | None:
        """[B] int32 slots of the batch's sequences (None without recurrent state)."""
        if not self.state_caches:
            return None
        slots = [s.state_slot for s in seqs]
        if min(slots) < 0 or max(slots) >= self.num_state_slots:
            raise ValueError(f"a sequence without a valid state slot in a hybrid-cache batch: {slots}")
        return torch.tensor(slots, dtype=torch.int32).to(self.device, non_blocking=True)

    @torch.inference_mode()
    def execute_scoring(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [R, V] for batch.logits_indices and the hidden states [P, H] of
        batch.prompt_indices (None without them): the LM head runs on those rows later, in
        pieces, so a long prompt's logits never exist all at once."""
        if batch.prompt_indices is None:
            return self.execute(batch), None
        with batch_invariant_mode(self.batch_invariant):
            hidden = self.model(batch)
            logits = self.model.compute_logits(hidden.index_select(0, batch.logits_indices))
        return logits, hidden.index_select(0, batch.prompt_indices)

    @torch.inference_mode()
    def execute(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [R, V] float32 for the rows in batch.logits_indices."""
        if self.kv_calibrating:  # eager until every FP8 layer has calibrated (graphs hold no calibration)
            out = self.forward_logits(batch)
            self.kv_calibrating = any(m.kv_calibrate for m in self._cache_owners)
            return out
        if self.graphs is not None and batch.max_query_len == 1 and batch.prompt_indices is None:
            n = self.graphs.padded_size(batch.num_seqs)
            if n is not None and batch.logits_indices.shape[0] == batch.num_seqs:
                return self.graphs.replay(batch, n)
        return self.forward_logits(batch)

    def forward_logits(self, batch: ForwardBatch) -> torch.Tensor:
        with batch_invariant_mode(self.batch_invariant):
            hidden = self.model(batch)
            return self.model.compute_logits(hidden.index_select(0, batch.logits_indices))

    graphs: DecodeGraphs | None = None

    def capture_decode_graphs(self, max_batch: int, max_model_len: int) -> None:
        """Capture decode steps in CUDA graphs for a ladder of batch sizes up to max_batch (none for a model
        whose forward syncs with the host, ``supports_cuda_graphs = False``: its steps run eagerly)."""
        if not getattr(self.model, "supports_cuda_graphs", True):
            return
        self.graphs = DecodeGraphs(self, max_batch, max_model_len)
        self.graphs.capture()


def graph_batch_sizes(max_batch: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s <= max_batch]
    sizes += list(range(16, max_batch + 1, 16))
    if max_batch not in sizes:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    """Decode-only steps (one new token per sequence) replayed from CUDA graphs.

    A batch of B sequences is padded to the next captured size N: padding rows have slot
    -1 (store_kv skips them), a context of 1 and block table row 0, so they compute
    harmless values that are never read. ``max_context_len`` is fixed at capture to the
    model's context length: the decode kernel reads each row's length on the device, so
    one graph serves every context length. On CPU (tests) the same padded static batch
    runs eagerly, which checks the padding logic without a GPU.
    """

    def __init__(self, runner: ModelRunner, max_batch: int, max_model_len: int) -> None:
        self.runner = runner
        self.sizes = graph_batch_sizes(max_batch)
        self.max_model_len = max_model_len
        n, dev = self.sizes[-1], runner.device
        self.max_blocks = -(-max_model_len // runner.block_size)
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=dev)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.context_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.logits_indices = torch.arange(n, dtype=torch.int64, device=dev)
        # hybrid cache: padding rows use the scratch slot (the last row of the state tensors)
        self.state_slots = None
        if runner.state_caches:
            self.state_slots = torch.full((n,), runner.num_state_slots, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.use_cuda = dev.type == "cuda"

    def padded_size(self, b: int) -> int | None:
        for s in self.sizes:
            if s >= b:
                return s
        return None

    def static_batch(self, n: int) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.input_ids[:n], positions=self.positions[:n], slot_mapping=self.slot_mapping[:n],
            block_tables=self.block_tables[:n], cu_seqlens_q=self.cu_seqlens_q[: n + 1],
            context_lens=self.context_lens[:n], logits_indices=self.logits_indices[:n],
            max_query_len=1, max_context_len=self.max_model_len,
            state_slots=None if self.state_slots is None else self.state_slots[:n],
        )

    @torch.inference_mode()
    def capture(self) -> None:
        if not self.use_cuda:
            return
        # FP8 KV layers awaiting their first-batch calibration must not calibrate on the dummy capture
        # batch, nor record the calibration into the graphs (the graphs read the scale tensors, which
        # the first real batch, a prefill run eagerly, sets in place)
        pending = [m for m in self.runner.model.modules() if getattr(m, "kv_calibrate", False)]
        for m in pending:
            m.kv_calibrate = False
        try:
            self._capture()
        finally:
            for m in pending:
                m.kv_calibrate = True

    def _capture(self) -> None:
        pool = None
        for n in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory pool
            batch = self.static_batch(n)
            for _ in range(2):  # warm up: Triton autotuning / compilation happens outside capture
                self.runner.forward_logits(batch)
            torch.cuda.synchronize(self.runner.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[n] = self.runner.forward_logits(batch)
            pool = graph.pool() if pool is None else pool
            self.graphs[n] = graph
        torch.cuda.synchronize(self.runner.device)

    def replay(self, batch: ForwardBatch, n: int) -> torch.Tensor:
        b = batch.num_seqs
        self.input_ids[:b].copy_(batch.input_ids)
        self.positions[:b].copy_(batch.positions)
        self.slot_mapping[:b].copy_(batch.slot_mapping)
        self.slot_mapping[b:n].fill_(-1)
        w = batch.block_tables.shape[1]
        self.block_tables[:b, :w].copy_(batch.block_tables)
        self.context_lens[:b].copy_(batch.context_lens)
        self.context_lens[b:n].fill_(1)
        self.block_tables[b:n].zero_()
        if self.state_slots is not None:
            self.state_slots[:b].copy_(batch.state_slots)
            self.state_slots[b:n].fill_(self.runner.num_state_slots)
        if self.use_cuda:
            self.graphs[n].replay()
            return self.outputs[n][:b]
        return self.runner.forward_logits(self.static_batch(n))[:b]
