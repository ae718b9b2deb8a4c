"""``tokenfab plan``: capacity planning on paper. For each tensor/expert/data-parallel layout of a model
on N GPUs: memory per rank (weights, KV, activations), the concurrent sequences at a context, and a
roofline bound on prefill and decode throughput including communication time.

Layouts (vLLM / SGLang conventions): ``TPt`` shards attention heads, dense MLPs, shared experts and the
vocabulary over t ranks (KV heads replicated when t exceeds them; MLA's latent cache is replicated
on every TP rank); ``DPd`` runs d replicas of that group; ``EP`` (``--enable-expert-parallel``) puts
whole routed experts on the t*d ranks (ceil((E + redundant) / (t*d)) each), tokens travel by
all-to-all, and with d > 1 this is DeepSeek's attention-DP + EP layout (each rank holds only its own
requests' cache). Without EP, each replica holds every expert sharded t ways. A layout the engine
refuses (``planner/servable.py`` asks the engine's own rules: DP replicas beyond one node, quantized
experts split by TP, TP > 1 under attention-DP + EP, EPLB's redundant experts under attention-DP + EP,
experts not dividing over the EP ranks) is listed as excluded with the engine's message, never proposed.

The model per step (one replica of t ranks, N tokens; every figure per rank):
  compute  = sum over weights of 2 * N * values (routed experts: N * top_k / E of the pool, balanced)
             + attention (2 * 2 * heads * dim * keys per token; MLA absorbed in decode, expanded in prefill;
             DSA: min(keys, index_topk) keys + the indexer's score over all keys), at the matrix peak of
             each GEMM's format (FP8 peak for W8A8 formats, else bf16);
  memory   = the rank's weights (an expert only when some token picks it: 1 - (1 - k/E)^tokens of its
             pool) + the KV read (decode) or written (prefill);
  comm     = ring all-reduce of N * hidden activations after attention and after each dense MLP (and the
             vocab-parallel embedding), 2 (t-1)/t of the bytes on the slowest link; the logits' all-gather;
             under EP per MoE layer a dispatch and a combine of each token to the other ranks holding one of
             its top-k experts (expected distinct ranks; FP8 dispatch for W8A8 models), the intra-node part
             over NVLink and the rest over the NICs, plus the TP group's all-gather;
  step     = max(compute / peak, memory / HBM bandwidth) + comm  (no overlap assumed).
Decode runs min(--max-num-seqs, what the KV holds) sequences per replica at the given context; prefill
runs --prefill-tokens tokens per replica of sequences that long (average causal key count C/2).
These are upper bounds (vendor peaks, perfect balance), for comparing layouts, not for promising SLAs.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from tokenfab.planner.hardware import GpuSpec, Interconnect, PlanInputError
from tokenfab.planner.quant_bytes import QuantScheme, online_scheme, parse_quantization
from tokenfab.planner.servable import engine_refusal, quantized_experts
from tokenfab.planner.spec_types import ModelSpec, Weight

DTYPE_BYTES = {"bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2, "float32": 4, "fp32": 4}
KV_DTYPE_BYTES = {"fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
GIB = 1 << 30


@dataclass(frozen=True)
class PlanRequest:
    gpus: int
    gpu: GpuSpec
    interconnect: Interconnect
    context: int = 8192
    dtype: str | None = None          # None: the config's dtype
    kv_cache_dtype: str = "auto"
    quantization: str | None = None   # "fp8" / "fp8-block": online FP8 of a 16-bit checkpoint (experts stay 16-bit)
    max_num_seqs: int = 256           # decode batch cap per replica
    prefill_tokens: int = 8192        # tokens per prefill step per replica
    gpu_memory_utilization: float = 0.9
    redundant_experts: int = 0
    gpu_hour_price: float | None = None

    def validate(self) -> None:
        for name in ("gpus", "context", "max_num_seqs", "prefill_tokens"):
            if getattr(self, name) < 1:
                raise PlanInputError(f"--{name.replace('_', '-')} must be >= 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise PlanInputError("--gpu-memory-utilization must be in (0, 1]")
        if self.redundant_experts < 0 or (self.gpu_hour_price is not None and self.gpu_hour_price < 0):
            raise PlanInputError("--redundant-experts and --gpu-hour-price must be >= 0")


@dataclass(frozen=True)
class Layout:
    tp: int
    dp: int
    ep: bool

    @property
    def ep_size(self) -> int:
        return self.tp * self.dp if self.ep else 1

    @property
    def name(self) -> str:
        return f"TP{self.tp}" + (f" DP{self.dp}" if self.dp > 1 else "") + (f" EP{self.ep_size}" if self.ep else "")


@dataclass
class LayoutPlan:
    layout: str
    tp: int
    dp: int
    ep: int
    fits: bool
    reason: str = ""
    weights_gib: float = 0.0
    activation_gib: float = 0.0
    kv_gib: float = 0.0                 # per rank, what is left for the cache
    kv_bytes_per_token: float = 0.0     # per rank, all layers
    max_concurrent_seqs: int = 0        # whole cluster, at the context
    decode_batch: int = 0               # per replica
    decode_tokens_per_s: float = 0.0    # whole cluster
    decode_tokens_per_s_per_seq: float = 0.0
    decode_step_ms: float = 0.0
    decode_comm_ms: float = 0.0
    decode_bound: str = ""
    decode_comm_bytes_per_token: float = 0.0  # sent per rank per token of its replica's batch
    prefill_tokens_per_s: float = 0.0
    prefill_step_ms: float = 0.0
    prefill_comm_ms: float = 0.0
    prefill_comm_bytes_per_token: float = 0.0
    cost_per_1m_output_tokens: float | None = None
    cost_per_1m_input_tokens: float | None = None


@dataclass
class Plan:
    model: dict
    hardware: dict
    layouts: list[LayoutPlan] = field(default_factory=list)
    excluded: list[LayoutPlan] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"model": self.model, "hardware": self.hardware, "layouts": [asdict(p) for p in self.layouts],
                "excluded": [{"layout": p.layout, "reason": p.reason} for p in self.excluded]}


def _shard(w: Weight, lay: Layout, spec: ModelSpec, redundant: int) -> tuple[int, int, int]:
    """(rows, cols, copies) of ``w`` on one rank of ``lay``."""
    t = lay.tp
    if w.kind == "vocab":
        return math.ceil(w.rows / (64 * t)) * 64, w.cols, 1
    if w.kind in ("col", "head"):
        return math.ceil(w.rows / t), w.cols, 1
    if w.kind == "row":
        return w.rows, math.ceil(w.cols / t), 1
    if w.kind == "kv":
        kv = spec.attention.num_kv_heads
        return w.rows // kv * math.ceil(kv / t), w.cols, 1
    if w.kind == "rep":
        return w.rows, w.cols, 1
    if lay.ep:
        return w.rows, w.cols, math.ceil((w.experts + redundant) / lay.ep_size)
    if w.kind == "ecol":
        return math.ceil(w.rows / t), w.cols, w.experts
    if w.kind == "erow":
        return w.rows, math.ceil(w.cols / t), w.experts
    return w.rows, w.cols, w.experts  # erep


def _divisibility(spec: ModelSpec, lay: Layout) -> str:
    a, t = spec.attention, lay.tp
    if a.num_heads % t:
        return f"{a.num_heads} attention heads do not divide by TP {t}"
    if a.kind == "gqa" and a.num_kv_heads % t and t % a.num_kv_heads:
        return f"{a.num_kv_heads} KV heads and TP {t}: neither divides the other"
    for inter in spec.intermediate_sizes:
        if inter % t and not (lay.ep and inter == _moe_inter(spec)):
            return f"MLP intermediate size {inter} does not divide by TP {t}"
    return ""


def _moe_inter(spec: ModelSpec) -> int:
    return next((w.cols for w in spec.weights if w.kind == "erow"), 0)


def _attn_flops(spec: ModelSpec, tp: int, keys: float, prefill: bool) -> float:
    """Attention FLOPs of one token against ``keys`` keys, one rank, all layers (projections excluded)."""
    a = spec.attention
    h = a.num_heads / tp
    if a.kind == "gqa":
        per = 4 * h * a.head_dim * keys
    else:
        rope, r = a.qk_rope_head_dim, a.kv_lora_rank
        k = min(keys, a.index_topk) if a.kind == "dsa" else keys
        per = h * (2 * (a.head_dim + a.v_head_dim) if prefill else 2 * (r + rope) + 2 * r) * k
        if a.kind == "dsa":
            per += 2 * a.index_n_heads * a.index_head_dim * keys
    return per * spec.num_layers


def _cache_values(spec: ModelSpec, tp: int) -> int:
    a = spec.attention
    if a.kind == "gqa":
        return 2 * math.ceil(a.num_kv_heads / tp) * a.head_dim
    return a.cache_values_per_layer()  # MLA's latent is replicated on every TP rank


class _Cost:
    """Per-rank weight bytes and step costs of one layout."""

    def __init__(self, spec: ModelSpec, req: PlanRequest, scheme: QuantScheme, lay: Layout, a_bytes: int) -> None:
        self.spec, self.req, self.lay, self.a = spec, req, lay, a_bytes
        gpu = req.gpu
        fp8_peak = (gpu.fp8_tflops or gpu.bf16_tflops) * 1e12
        self.dense_bytes = self.expert_bytes = self.embed_bytes = 0.0
        self.flops_tok = self.flops_seq = self.flops_expert_tok = 0.0  # time-weighted: FLOPs / peak
        for w in spec.weights:
            rows, cols, copies = _shard(w, lay, spec, req.redundant_experts)
            quant = scheme.applies(w)
            b = copies * (scheme.bytes_per_matrix(rows, cols) if quant else rows * cols * a_bytes)
            peak = fp8_peak if quant and scheme.compute == "fp8" else gpu.bf16_tflops * 1e12
            if w.kind == "vocab" and not w.per_seq:
                self.embed_bytes += b  # held, but a step reads only its tokens' rows
            elif w.experts > 1:
                self.expert_bytes += b
                if w.linear:  # balanced routing: N * top_k / tp full-expert products per rank
                    self.flops_expert_tok += 2 * w.rows * w.cols * spec.experts_per_token / lay.tp / peak
            else:
                self.dense_bytes += b
                if w.linear and w.per_seq:
                    self.flops_seq += 2 * rows * cols / peak
                elif w.linear and w.kind != "vocab":
                    self.flops_tok += 2 * rows * cols / peak
        if not any(w.name == "lm_head.weight" for w in spec.weights):  # tied: the embedding is the head
            self.flops_seq += 2 * math.ceil(spec.vocab_size / (64 * lay.tp)) * 64 * spec.hidden_size / (
                gpu.bf16_tflops * 1e12)

    def touched(self, tokens: float) -> float:
        k, e = self.spec.experts_per_token, self.spec.num_experts
        if not e:
            return 0.0
        pool = tokens * (self.lay.dp if self.lay.ep else 1)
        return 1 - (1 - k / e) ** pool

    def comm(self, tokens: float, seqs: float, fp8_dispatch: bool) -> tuple[float, float]:
        """(seconds, bytes sent per rank) of one step's collectives for ``tokens`` tokens per replica."""
        spec, lay, net, gpn = self.spec, self.lay, self.req.interconnect, self.req.gpu.gpus_per_node
        t, h, a = lay.tp, spec.hidden_size, self.a
        secs = sent = 0.0
        if t > 1:  # the vocab-parallel embedding's all-reduce, then attention's and each dense MLP's
            bw, lat = ((net.intra_gbps, net.intra_latency) if t <= gpn else
                       (net.inter_gbps_per_gpu, net.inter_latency))
            dense_mlps = spec.num_layers - (spec.moe_layers if lay.ep else 0)
            n_ar = 1 + spec.num_layers + dense_mlps
            ar = 2 * (t - 1) / t * tokens * h * a
            gather = (t - 1) / t * seqs * math.ceil(spec.vocab_size / (64 * t)) * 64 * t * 4
            sent += n_ar * ar + gather
            secs += n_ar * (lat + ar / (bw * 1e9)) + lat + gather / (bw * 1e9)
        if lay.ep and lay.ep_size > 1 and spec.moe_layers:
            n = lay.ep_size
            copies = expected_remote_ranks(spec.num_experts, spec.experts_per_token, n)
            per_tok = copies * h * ((1 + 4 / 128) if fp8_dispatch else a) + copies * h * a  # dispatch + combine
            vol = tokens / t * per_tok
            f_intra = (min(n, gpn) - 1) / (n - 1)
            lat = net.inter_latency if n > gpn else net.intra_latency
            one = max(f_intra * vol / (net.intra_gbps * 1e9),
                      (1 - f_intra) * vol / (net.inter_gbps_per_gpu * 1e9)) if vol else 0.0
            secs += spec.moe_layers * (2 * lat + one)
            sent += spec.moe_layers * vol
            if t > 1:
                ag = (t - 1) / t * tokens * h * a
                bw = net.intra_gbps if t <= gpn else net.inter_gbps_per_gpu
                secs += spec.moe_layers * (net.intra_latency + ag / (bw * 1e9))
                sent += spec.moe_layers * ag
        return secs, sent


def expected_remote_ranks(experts: int, top_k: int, ep: int) -> float:
    """Expected number of other EP ranks a token goes to when it picks ``top_k`` of ``experts`` distinct
    experts uniformly and each of ``ep`` ranks holds ``experts / ep`` of them: (ep - 1) times the
    chance that a given other rank holds at least one pick, 1 - C(E - m, k) / C(E, k)."""
    if ep <= 1:
        return 0.0
    m = experts / ep
    miss = math.prod((experts - m - j) / (experts - j) for j in range(top_k)) if experts - m >= top_k else 0.0
    return (ep - 1) * (1 - miss)


def plan_model(spec: ModelSpec, req: PlanRequest) -> Plan:
    """Every layout of ``req.gpus`` GPUs for ``spec``, fitting ones sorted by decode throughput."""
    req.validate()
    scheme = parse_quantization(spec.quantization_config)
    if req.quantization:
        scheme = online_scheme(req.quantization, scheme)  # routed experts stay 16-bit
    dtype = req.dtype or spec.dtype
    if dtype not in DTYPE_BYTES:
        raise PlanInputError(f"--dtype {dtype!r}: use one of {', '.join(sorted(DTYPE_BYTES))}")
    a_bytes = DTYPE_BYTES[dtype]
    kv_bytes = a_bytes if req.kv_cache_dtype == "auto" else KV_DTYPE_BYTES.get(req.kv_cache_dtype, 0)
    if not kv_bytes:
        raise PlanInputError(f"--kv-cache-dtype {req.kv_cache_dtype!r}: use auto or fp8_e4m3")
    gpu, net = req.gpu, req.interconnect
    whole = _Cost(spec, req, scheme, Layout(1, 1, False), a_bytes)
    plan = Plan(
        model={"architecture": spec.architecture, "model_type": spec.model_type, "params": spec.num_params,
               "active_params": spec.active_params, "mtp_params_not_loaded": spec.mtp_params,
               "weight_gib": (whole.dense_bytes + whole.expert_bytes + whole.embed_bytes) / GIB,
               "quantization": scheme.method,
               "dtype": dtype, "kv_cache_dtype": req.kv_cache_dtype, "attention": spec.attention.kind,
               "kv_bytes_per_token": spec.attention.cache_values_per_layer() * spec.num_layers * kv_bytes,
               "experts": spec.num_experts, "experts_per_token": spec.experts_per_token},
        hardware={"gpu": gpu.name, "gpus": req.gpus, "gpus_per_node": gpu.gpus_per_node,
                  "interconnect": net.describe(), "context": req.context, "source": gpu.source,
                  "gpu_memory_utilization": req.gpu_memory_utilization, "max_num_seqs": req.max_num_seqs,
                  "prefill_tokens": req.prefill_tokens, "redundant_experts": req.redundant_experts,
                  "gpu_hour_price": req.gpu_hour_price},
    )
    q_experts = quantized_experts(spec, scheme)
    fp8_dispatch = scheme.compute == "fp8" and scheme.experts and gpu.fp8_tflops is not None
    usable = gpu.memory_bytes * req.gpu_memory_utilization
    for tp in (d for d in range(1, req.gpus + 1) if req.gpus % d == 0):
        for ep in ((False, True) if spec.num_experts and req.gpus > 1 else (False,)):
            lay = Layout(tp, req.gpus // tp, ep)
            refusal = engine_refusal(tp, lay.dp, ep, num_experts=spec.num_experts, moe_intermediate=_moe_inter(spec),
                                     redundant_experts=req.redundant_experts, experts_quantized=q_experts,
                                     gpus_per_node=gpu.gpus_per_node)
            reason = f"the engine refuses it: {refusal}" if refusal else _divisibility(spec, lay)
            p = LayoutPlan(lay.name, tp, lay.dp, lay.ep_size, fits=False, reason=reason)
            if not p.reason:
                _fill(p, spec, req, _Cost(spec, req, scheme, lay, a_bytes), lay, a_bytes, kv_bytes, usable,
                      fp8_dispatch)
            (plan.layouts if p.fits else plan.excluded).append(p)
    plan.layouts.sort(key=lambda p: (-p.decode_tokens_per_s, -p.prefill_tokens_per_s))
    return plan


def _activation_bytes(spec: ModelSpec, req: PlanRequest, lay: Layout, a: int) -> float:
    """Peak transient buffers of a prefill step of --prefill-tokens tokens (one layer's at a time)."""
    att, t, n, h = spec.attention, lay.tp, req.prefill_tokens, spec.hidden_size
    heads = att.num_heads / t
    if att.kind == "gqa":
        attn = (2 * heads + 2 * math.ceil(att.num_kv_heads / t)) * att.head_dim
        expanded = 0.0
    else:
        attn = heads * (2 * att.head_dim + att.v_head_dim) + att.kv_lora_rank + att.qk_rope_head_dim
        expanded = req.context * heads * (att.head_dim + att.v_head_dim) * a  # expanded K/V of the prefix
    mlp = 3 * max([i for i in spec.intermediate_sizes if i != _moe_inter(spec)] or [0]) / t
    moe = 0.0
    if spec.num_experts:
        rows = n * spec.experts_per_token / (t if lay.ep else 1)
        moe = rows * (h + 3 * _moe_inter(spec) / (1 if lay.ep else t)) * a
    logits = req.max_num_seqs * math.ceil(spec.vocab_size / (64 * t)) * 64 * 4
    return n * a * (3 * h + max(attn, mlp)) + moe + expanded + logits


def _fill(p: LayoutPlan, spec: ModelSpec, req: PlanRequest, cost: _Cost, lay: Layout, a: int, kv_bytes: int,
          usable: float, fp8_dispatch: bool) -> None:
    gpu, ctx = req.gpu, req.context
    weights = cost.dense_bytes + cost.expert_bytes + cost.embed_bytes
    act = _activation_bytes(spec, req, lay, a)
    p.weights_gib, p.activation_gib = weights / GIB, act / GIB
    kv_budget = usable - weights - act
    p.kv_bytes_per_token = _cache_values(spec, lay.tp) * spec.num_layers * kv_bytes
    if kv_budget <= 0:
        p.reason = (f"weights {weights / GIB:.1f} GiB + activations {act / GIB:.1f} GiB per rank exceed "
                    f"{usable / GIB:.1f} GiB usable")
        return
    per_seq = p.kv_bytes_per_token * ctx
    seqs = int(kv_budget // per_seq)
    if seqs < 1:
        p.reason = f"the KV cache left ({kv_budget / GIB:.2f} GiB per rank) cannot hold one {ctx}-token sequence"
        return
    p.fits, p.kv_gib, p.max_concurrent_seqs = True, kv_budget / GIB, seqs * lay.dp
    att, hbm = spec.attention, gpu.hbm_gbps * 1e9

    def step(tokens: float, seqs_: float, keys: float, kv_io: float, prefill: bool) -> tuple[float, float, str, float]:
        compute = (tokens * (cost.flops_tok + cost.flops_expert_tok) + seqs_ * cost.flops_seq
                   + tokens * _attn_flops(spec, lay.tp, keys, prefill) / (gpu.bf16_tflops * 1e12))
        memory = (cost.dense_bytes + cost.expert_bytes * cost.touched(tokens) + kv_io) / hbm
        comm, sent = cost.comm(tokens, seqs_, fp8_dispatch)
        return max(compute, memory) + comm, comm, "compute" if compute >= memory else "memory", sent

    # decode: B sequences at the full context, one token each
    b = min(req.max_num_seqs, seqs)
    if att.kind == "dsa":
        read = spec.num_layers * (min(ctx, att.index_topk) * (att.kv_lora_rank + att.qk_rope_head_dim)
                                  + ctx * att.index_head_dim) * kv_bytes
    else:
        read = p.kv_bytes_per_token * ctx
    d_step, d_comm, bound, sent = step(b, b, ctx, b * read, prefill=False)
    p.decode_batch, p.decode_step_ms, p.decode_comm_ms, p.decode_bound = b, d_step * 1e3, d_comm * 1e3, bound
    p.decode_tokens_per_s = lay.dp * b / d_step
    p.decode_tokens_per_s_per_seq = 1 / d_step
    p.decode_comm_bytes_per_token = sent / b
    # prefill: a chunk of --prefill-tokens tokens of context-long sequences, causal (keys average C/2)
    n = req.prefill_tokens
    keys = ctx / 2  # DSA: min(keys, index_topk) latent keys, the indexer scores all of them
    p_step, p_comm, _, p_sent = step(n, max(1.0, n / ctx), keys, n * p.kv_bytes_per_token, prefill=True)
    p.prefill_step_ms, p.prefill_comm_ms = p_step * 1e3, p_comm * 1e3
    p.prefill_tokens_per_s = lay.dp * n / p_step
    p.prefill_comm_bytes_per_token = p_sent / n
    if req.gpu_hour_price is not None:
        per_s = req.gpus * req.gpu_hour_price / 3600
        p.cost_per_1m_output_tokens = per_s / p.decode_tokens_per_s * 1e6
        p.cost_per_1m_input_tokens = per_s / p.prefill_tokens_per_s * 1e6
