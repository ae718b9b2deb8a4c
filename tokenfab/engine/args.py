"""Engine configuration, shared by the Python API and every CLI command."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from tokenfab.engine.kv_transfer.sizes import gib_to_bytes, parse_bytes
from tokenfab.engine.kv_transfer.transfer_config import KVTransferConfig


@dataclass
class EngineArgs:
    model: str | None = None  # HF directory or .gguf file; None = bundled SmolLM2-135M-Instruct
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"  # auto: cuda when available, else cpu
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes of KV cache on CPU (default: see kv budget)
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None  # overrides the memory budget (tests)
    max_num_seqs: int = 256
    # hybrid models (per-sequence recurrent state, e.g. Gated DeltaNet): state slots, one per running sequence;
    # None: max_num_seqs. Their bytes come out of the KV budget (engine/runner/kv_budget.py, docs/hybrid-cache.md)
    num_state_slots: int | None = None
    # their prefix caching: recurrent-state snapshots kept at block boundaries (None: num_state_slots; 0: prefix
    # caching off for such models), also out of the KV budget (engine/requests/state_snapshots.py)
    num_state_snapshots: int | None = None
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # disable CUDA graphs
    # CPU float32: keep MKL-packed copies of the linear weights (faster skinny products, 2x the
    # weight memory); packed only when the weights take under a quarter of the machine's memory
    cpu_weight_packing: bool = True
    # GGUF block-quantized weights: None = packed on CPU float32 ("gguf"), "gguf-q8act" = packed with
    # int8 activations, "none" = dequantized at load (see loader/gguf_mode.py)
    quantization: str | None = None
    seed: int = 0  # the model's random init / tests; unseeded requests draw their seeds from OS entropy
    served_model_name: str | None = None
    scheduling_policy: str = "fcfs"  # "fcfs" (priority ignored) or "priority" (lower value runs first)
    # background work (priority 2**31-1, e.g. /v1/batches; any policy) while online requests wait or prefill:
    # the share of a step's tokens its prefill chunks may take, and whether its decodes go on (scheduler.py)
    background_prefill_share: float = 0.0
    # "auto" (background_limits below): on a CPU, background decodes pause while online work is pending and
    # background prefill takes at most 16 tokens a step (a CPU step lasts as long as its tokens, and an arriving
    # online request waits for the step in flight: docs/batches.md); on a GPU neither. Both act only while
    # background work exists. background_max_prefill_tokens None or 0: no cap
    background_decodes_while_online: bool | str = "auto"
    background_max_prefill_tokens: int | str | None = "auto"
    # while online traffic is present (scheduler.py): the most background tokens (decode rows + prefill) a step;
    # "auto": BACKGROUND_TOKENS_PER_CPU_THREAD per engine thread on a CPU, no cap on a GPU; None or 0: no cap
    background_max_tokens_while_online: int | str | None = "auto"
    # overlap scheduling (vLLM's name): step N+1 is scheduled and launched before step N's tokens
    # reach the host; off by default until measured on GPU (engine/overlap.py)
    async_scheduling: bool = False
    # speculative decoding (vLLM's shape): a JSON string or a dict, e.g. '{"method": "ngram",
    # "num_speculative_tokens": 4}'; None: off (tokenfab/speculative/config.py)
    speculative_config: str | dict | None = None
    # KV cache storage (vLLM's flags): "auto" = the model dtype, "fp8" / "fp8_e4m3" = float8 e4m3 with
    # per-layer k/v scales (checkpoint or first-batch calibration; tokenfab/quant/kv_fp8.py)
    kv_cache_dtype: str = "auto"
    # layers kept in the model dtype under an FP8 cache: "0,5,sliding_window" (indices and/or every
    # sliding-window layer), or a list
    kv_cache_dtype_skip_layers: str | list | None = None
    # prefill/decode disaggregation, vLLM's --kv-transfer-config JSON (engine/kv_transfer/transfer_config.py,
    # docs/fleet.md); None: off
    kv_transfer_config: str | dict | None = None
    # KV-cache events over ZeroMQ (vLLM's shape): JSON string or dict {"enable_kv_cache_events": true, "publisher":
    # "zmq", "endpoint": "tcp://*:5557", "topic": "kv-events"}; None: off (engine/requests/kv_event_publisher.py)
    kv_events_config: str | dict | None = None
    # the KV tier beyond the device (engine/kv_transfer, docs/kv-tier.md): evicted prefix blocks kept in this many
    # bytes of host memory, then in files under kv_offload_dir (at most kv_offload_disk_bytes; None: 8 GiB)
    kv_offload_bytes: int = 0
    kv_offload_dir: str | None = None
    kv_offload_disk_bytes: int | None = None
    # False in the engine-core process: outputs carry token ids only (the API server detokenizes and
    # checks stop strings); not a CLI flag
    detokenize: bool = True
    # parallelism (executors/tp_executor.py, engine/core/dp_client.py): TP ranks per engine (workers spawned
    # on this node, or torchrun's ranks), engine-core replicas behind one server, experts sharded
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    # EPLB (vLLM's shape): JSON string or dict {"num_redundant_experts": R, "step_interval": N,
    # "window_size": W}; None: off (tokenfab/executors/eplb_engine.py)
    eplb_config: str | dict | None = None
    # two-batch overlap (distributed/two_batch.py): a step of >= tbo_min_tokens tokens at TP/EP > 1 runs
    # as two micro-batches, one's all-reduce in flight while the other computes; None: the default
    enable_two_batch_overlap: bool = False
    tbo_min_tokens: int | None = None
    # CPU threads of the engine's kernels (torch's and the native ones); None: the process's share of the
    # cores, split without overlap between TP ranks and DP replicas (engine/runner/cpu_threads.py)
    cpu_threads: int | None = None
    # multi-LoRA serving (vLLM's flags; engine/runner/lora_manager.py, docs/lora-serving.md): adapters loaded
    # at start (name=path strings or {"name", "path", "base_model_name"} dicts/JSON), adapters per step,
    # their largest rank, adapters kept in host memory (least recently used dropped; None: max_loras)
    enable_lora: bool = False
    lora_modules: list | None = None
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        KVTransferConfig.parse(self.kv_transfer_config)  # a bad config fails here, before the model loads
        background_limits(self, "cpu", cpu_threads=1)  # a bad background setting fails here (threads: no torch)
        if self.num_state_slots is not None and self.num_state_slots < 1:
            raise ValueError(f"num_state_slots must be at least 1, got {self.num_state_slots!r}")
        if self.num_state_snapshots is not None and self.num_state_snapshots < 0:
            raise ValueError(f"num_state_snapshots must be at least 0, got {self.num_state_snapshots!r}")
        if self.cpu_threads is not None and (not isinstance(self.cpu_threads, int) or self.cpu_threads < 1):
            raise ValueError(f"cpu_threads must be a positive integer, got {self.cpu_threads!r}")
        # lazy: this module is the CLI's (``tokenfab --help``), which must not pay for importing torch
        from tokenfab.quant.kv_fp8 import parse_kv_cache_dtype, parse_skip_layers

        parse_kv_cache_dtype(self.kv_cache_dtype)  # a bad value fails here, before the model loads
        parse_skip_layers(self.kv_cache_dtype_skip_layers)
        from tokenfab.executors.eplb_engine import EplbConfig

        if EplbConfig.parse(self.eplb_config) is not None and not self.enable_expert_parallel:
            raise ValueError("eplb_config needs --enable-expert-parallel (EPLB places the experts of EP ranks)")
        from tokenfab.executors.dp_lockstep import validate_dp_ep

        validate_dp_ep(self)  # attention-DP + EP: TP 1, none of the options that break the lockstep

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, with_model: bool = True) -> None:
        if with_model:
            parser.add_argument("model", nargs="?", default=None,
                                help="HF model directory or .gguf file (default: bundled SmolLM2-135M-Instruct)")
        parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
        parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
        parser.add_argument("--block-size", type=int, default=16)
        parser.add_argument("--kv-cache-memory", type=int, default=None, help="KV cache bytes (CPU)")
        parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
        parser.add_argument("--num-kv-blocks", type=int, default=None)
        parser.add_argument("--max-num-seqs", type=int, default=256)
        parser.add_argument("--num-state-slots", type=int, default=None,
                            help="hybrid models (linear-attention layers with per-sequence recurrent state): state "
                            "slots, at most this many sequences run at once (default: --max-num-seqs)")
        parser.add_argument("--num-state-snapshots", type=int, default=None,
                            help="hybrid models with prefix caching: recurrent-state snapshots kept at block "
                            "boundaries for prefix hits (default: --num-state-slots; 0 turns prefix caching off "
                            "for such models)")
        parser.add_argument("--cpu-threads", type=int, default=None,
                            help="CPU threads of the kernels (default: this process's share of the cores, TP ranks "
                                 "and DP replicas on disjoint cores)")
        parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
        parser.add_argument("--max-model-len", type=int, default=None)
        parser.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
        parser.add_argument("--enforce-eager", action="store_true", help="disable CUDA graphs")
        parser.add_argument("--no-cpu-weight-packing", dest="cpu_weight_packing", action="store_false",
                            help="CPU: do not keep packed copies of the linear weights (MKL float32, oneDNN bfloat16)")
        parser.add_argument("--quantization", default=None, choices=["gguf", "gguf-q8act", "none", "fp8", "fp8-block"],
                            help="GGUF files: gguf = keep Q8_0/Q4_0/Q4_1 weights packed (CPU, float32 "
                            "activations; the default for a quantized GGUF on CPU); gguf-q8act = packed, with "
                            "int8 activation blocks (faster, drifts slightly); none = dequantize to --dtype. "
                            "fp8 / fp8-block: quantize a float checkpoint's linears to FP8 at load (per-channel "
                            "/ 128x128 block scales). Quantized checkpoints need no flag (quantization_config)")
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--served-model-name", default=None)
        parser.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                            help="fcfs: first come, first served (request priority ignored); priority: lower "
                            "priority value first, then arrival; preemption takes the lowest-priority, newest")
        parser.add_argument("--background-prefill-share", type=float, default=0.0,
                            help="background requests (priority 2**31-1: /v1/batches lines) yield to online ones "
                            "under any policy; while online requests wait or prefill, background prefill chunks get "
                            "at most this share of a step's tokens (default 0: none)")
        parser.add_argument("--no-background-decodes-while-online", dest="background_decodes_while_online",
                            action="store_false", default="auto",
                            help="pause background decodes too while online requests wait or prefill (they then "
                            "count in --background-prefill-share); the default on a CPU")
        parser.add_argument("--background-decodes-while-online", dest="background_decodes_while_online",
                            action="store_true", default="auto",
                            help="let background decodes go on while online requests wait or prefill (the default "
                            "on a GPU)")
        parser.add_argument("--background-max-prefill-tokens", type=_max_prefill_tokens, default="auto",
                            help="at most this many background prefill tokens in any step, online work or not; "
                            "bounds the step an arriving online request waits behind. 0: no cap; auto (default): "
                            f"{CPU_BACKGROUND_MAX_PREFILL_TOKENS} on a CPU, no cap on a GPU")
        parser.add_argument("--background-max-tokens-while-online", type=_max_prefill_tokens, default="auto",
                            help="while online requests are in the engine (or left it under a second ago), "
                            "background work (decode rows and prefill tokens together) takes at most this many "
                            "tokens a step, so an arriving online request waits behind a small step. 0: no cap; "
                            f"auto (default): {BACKGROUND_TOKENS_PER_CPU_THREAD} per engine CPU thread on a CPU, "
                            "no cap on a GPU")
        parser.add_argument("--async-scheduling", action="store_true",
                            help="overlap scheduling: schedule step N+1 while step N runs on the device; sampled "
                            "tokens feed the next step without a host sync, stop checks run one step behind")
        parser.add_argument("--speculative-config", default=None,
                            help='speculative decoding as JSON, e.g. \'{"method": "ngram", '
                            '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}\' '
                            "(methods: ngram, suffix, draft_model, eagle3, mtp; outputs are unchanged: greedy bit "
                            "for bit, sampled in distribution)")

        parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                            help="shard the model over N ranks (this node: N-1 worker processes are spawned; "
                            "under torchrun: the world size)")
        parser.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                            help="N engine-core replicas (each with its own TP group) behind one server; "
                            "requests go to the least loaded, prefix-cache affinity first")
        parser.add_argument("--enable-expert-parallel", action="store_true",
                            help="MoE models: shard the experts over the ranks (all-to-all dispatch)")
        parser.add_argument("--eplb-config", default=None,
                            help='expert-parallel load balancing as JSON, e.g. \'{"num_redundant_experts": 2, '
                            '"step_interval": 3000, "window_size": 1000}\': R replicas of hot experts per MoE '
                            "layer, re-placed every N steps from the load of the last min(W, N) steps")
        parser.add_argument("--enable-two-batch-overlap", action="store_true",
                            help="TP/EP > 1: split large steps into two micro-batches so one's all-reduce runs "
                            "while the other computes (same tokens; measured only on CPU gloo, where it is "
                            "informational: tokenfab bench comm --tbo)")
        parser.add_argument("--tbo-min-tokens", type=int, default=None,
                            help="two-batch overlap only for steps of at least this many tokens (default 1024)")

        parser.add_argument("--enable-lora", action="store_true",
                            help="serve LoRA adapters (PEFT format) next to the base model: a request picks one "
                            "with 'model'; /v1/load_lora_adapter and /v1/unload_lora_adapter manage them")
        parser.add_argument("--lora-modules", nargs="+", default=None,
                            help='adapters loaded at start: name=path, or JSON {"name": ..., "path": ..., '
                            '"base_model_name": ...}')
        parser.add_argument("--max-loras", type=int, default=1, help="distinct adapters in one step (default 1)")
        parser.add_argument("--max-lora-rank", type=int, default=16, help="largest adapter rank (default 16)")
        parser.add_argument("--max-cpu-loras", type=int, default=None,
                            help="adapters kept in host memory, least recently used dropped (default: --max-loras)")

        parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                            help="KV cache storage: auto = the model dtype; fp8 / fp8_e4m3 = float8 e4m3 (half "
                            "of bf16) with per-layer k/v scales from the checkpoint (k_scale / v_scale) or "
                            "calibrated once on the first batch (amax / 448; later larger values saturate)")
        parser.add_argument("--kv-transfer-config", default=None,
                            help='prefill/decode disaggregation in vLLM\'s shape, e.g. \'{"kv_connector": '
                            '"NixlConnector", "kv_role": "kv_producer", "kv_port": 14579}\' (docs/fleet.md)')
        parser.add_argument("--kv-events-config", default=None,
                            help='publish the prefix cache\'s block stored/removed/cleared events over ZeroMQ in '
                            'vLLM\'s format, e.g. \'{"enable_kv_cache_events": true, "publisher": "zmq", '
                            '"endpoint": "tcp://*:5557", "topic": "kv-events"}\'')
        parser.add_argument("--kv-offload-bytes", type=parse_bytes, default=0,
                            help="keep prefix-cache blocks evicted from the device in this much host memory "
                            "(e.g. 4GiB) and load them back on a prefix hit instead of recomputing them")
        parser.add_argument("--kv-offloading-size", dest="kv_offload_bytes", type=gib_to_bytes,
                            help="vLLM's name for --kv-offload-bytes, in GiB")
        parser.add_argument("--kv-offload-dir", default=None,
                            help="blocks pushed out of host memory go to files in a directory of their own made "
                            "here (removed at exit); the disk level of the tier")
        parser.add_argument("--kv-offload-disk-bytes", type=parse_bytes, default=None,
                            help="at most this many bytes of files under --kv-offload-dir, least recently used "
                            "removed first (default 8GiB)")
        parser.add_argument("--kv-cache-dtype-skip-layers", default=None,
                            help="with an FP8 KV cache, layers that keep the model dtype: comma-separated "
                            "layer indices and/or 'sliding_window' (every sliding-window layer)")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})


CPU_BACKGROUND_MAX_PREFILL_TOKENS = 16  # measured: docs/batches.md, benchmarks/results/lora_bench.md
# on a CPU a step costs a fixed part (~8 ms on 2 threads, bundled model) plus ~1.3 ms a row (decode or prompt
# token) divided among the threads: 2 rows a thread keep a background step near 1.3x the fixed part, a third of
# an online 26-token prefill (docs/batches.md)
BACKGROUND_TOKENS_PER_CPU_THREAD = 2


def _max_prefill_tokens(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"give a number of tokens (0: no cap) or auto, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"give a number of tokens >= 0 (0: no cap) or auto, got {text!r}")
    return value


def background_limits(args: EngineArgs, device_type: str,
                      cpu_threads: int | None = None) -> tuple[bool, int | None, int | None]:
    """(background decodes go on while online work is pending, background prefill tokens a step, background
    tokens a step while online traffic is present; None: no cap) for an engine on ``device_type`` computing
    with ``cpu_threads`` threads (None: torch's count), "auto" resolved: on a CPU decodes paused,
    ``CPU_BACKGROUND_MAX_PREFILL_TOKENS`` and ``BACKGROUND_TOKENS_PER_CPU_THREAD`` per thread; on a GPU decodes on
    and no caps. ValueError for a bad setting."""
    decodes, cap = args.background_decodes_while_online, args.background_max_prefill_tokens
    online_cap = args.background_max_tokens_while_online
    if online_cap == "auto":
        if device_type == "cpu":
            if cpu_threads is None:
                import torch  # lazy: this module is the CLI's

                cpu_threads = torch.get_num_threads()
            online_cap = BACKGROUND_TOKENS_PER_CPU_THREAD * max(1, cpu_threads)
        else:
            online_cap = None
    elif online_cap is not None and (isinstance(online_cap, bool) or not isinstance(online_cap, int)
                                     or online_cap < 0):
        raise ValueError("background_max_tokens_while_online must be a number of tokens >= 0 (0: no cap), None or "
                         f"'auto', got {online_cap!r}")
    cpu = device_type == "cpu"
    if decodes == "auto":
        decodes = not cpu
    elif not isinstance(decodes, bool):
        raise ValueError(f"background_decodes_while_online must be true, false or 'auto', got {decodes!r}")
    if cap == "auto":
        cap = CPU_BACKGROUND_MAX_PREFILL_TOKENS if cpu else None
    elif cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0):
        raise ValueError(f"background_max_prefill_tokens must be a number of tokens >= 0 (0: no cap), None or "
                         f"'auto', got {cap!r}")
    return decodes, cap or None, online_cap or None
