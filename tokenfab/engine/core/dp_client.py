"""Data parallelism (``--data-parallel-size N``): N engine-core replicas behind one API server.

Each replica is its own engine-core process (``engine/core/process.py``; with
``--tensor-parallel-size`` each is rank 0 of its own TP group) and gets its own
``EngineCoreClient``. ``DPClient`` quacks like one client, so ``AsyncEngine`` and the server stay
as they are. It routes each request (``Router``), sends aborts to the replica that owns the
request, merges the outputs of all replicas in ``step()`` and sums their stats for ``/metrics``.

Routing rule (``Router.choose``): the load of a replica is its waiting + running requests (the
stats each core sends with its outputs, plus adds still on the wire). A request whose prompt's
first full KV blocks (hashed as a chain: 1, 2, ... up to ``MAX_AFFINITY_BLOCKS`` blocks, salted
by ``cache_salt``) were last sent to replica r goes to r — the longest such prefix wins — unless r
is much busier than the least-loaded replica: ``load(r) > min_load + max(AFFINITY_SLACK,
min_load)`` (more than the slack over the least load and more than twice it). Otherwise it goes to
the least-loaded replica (ties: the one picked longest ago, so an idle server alternates).

A replica that dies fails its own requests (finish_reason "error" with the reason) and is routed
around; the others keep serving. Only when every replica is dead does the client report itself
dead (``on_dead``: the server answers 503 and ``/health`` fails).

With ``--enable-expert-parallel`` (attention-DP + EP, ``executors/dp_lockstep.py``) the replicas form
one torch.distributed world (a rendezvous on a free loopback port, ``TOKENFAB_DP_EP_MASTER``) and
step in lockstep: there one dead replica is all dead (the others' collectives cannot go on).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections import Counter, OrderedDict
from typing import Any

import zmq

from tokenfab.engine.args import EngineArgs
from tokenfab.engine.core.client import EngineCoreClient
from tokenfab.engine.core.launch import CoreLaunch, load_tokenizer
from tokenfab.engine.core.wakeup import WakeupPipe
from tokenfab.engine.intake import tokenize_prompt
from tokenfab.engine.requests.errors import EngineDeadError
from tokenfab.engine.requests.outputs import CompletionOutput, RequestOutput
from tokenfab.engine.requests.sampling_params import SamplingParams
from tokenfab.engine.requests.stats import EngineStats
from tokenfab.engine.runner.cpu_threads import child_env
from tokenfab.engine.runner.device_setup import resolve_device
from tokenfab.executors import dp_lockstep
from tokenfab.executors.tp_protocol import free_port

log = logging.getLogger("tokenfab.dp")

MAX_AFFINITY_BLOCKS = 32
AFFINITY_SLACK = 4
AFFINITY_ENTRIES = 1 << 16


def prefix_keys(token_ids: list[int], block_size: int, salt: str | None = None,
                max_blocks: int = MAX_AFFINITY_BLOCKS) -> list[int]:
    """Chained hashes of the prompt's first 1, 2, ... full blocks (shortest first)."""
    keys: list[int] = []
    h = hash(("tokenfab-dp", salt))
    n = min(len(token_ids) // block_size, max_blocks)
    for b in range(n):
        h = hash((h, tuple(token_ids[b * block_size : (b + 1) * block_size])))
        keys.append(h)
    return keys


class Router:
    """Least-loaded routing with prefix-cache affinity (the rule is in the module docstring)."""

    def __init__(self, num_replicas: int, slack: int = AFFINITY_SLACK, max_entries: int = AFFINITY_ENTRIES) -> None:
        self.num_replicas = num_replicas
        self.slack = slack
        self.max_entries = max_entries
        self.affinity: OrderedDict[int, int] = OrderedDict()  # prefix key -> replica it was last sent to
        self.last_pick = [-1] * num_replicas  # the pick counter when each replica was last chosen
        self.picks = 0
        self.routed = [0] * num_replicas  # requests sent to each replica
        self.affinity_hits = 0

    def choose(self, keys: list[int], loads: list[int | None]) -> int:
        """The replica for a request with prefix ``keys`` given each replica's load (None: dead)."""
        alive = [r for r, load in enumerate(loads) if load is not None]
        if not alive:
            raise EngineDeadError("every data-parallel replica is dead")
        least = min(loads[r] for r in alive)  # type: ignore[type-var]
        pick = None
        for key in reversed(keys):  # the longest cached prefix first
            r = self.affinity.get(key)
            if r is not None and loads[r] is not None:
                if loads[r] <= least + max(self.slack, least):  # type: ignore[operator]
                    pick = r
                    self.affinity_hits += 1
                break
        if pick is None:
            pick = min((r for r in alive if loads[r] == least), key=lambda r: self.last_pick[r])
        self.record(keys, pick)
        return pick

    def record(self, keys: list[int], replica: int) -> None:
        for key in keys:
            self.affinity[key] = replica
            self.affinity.move_to_end(key)
        while len(self.affinity) > self.max_entries:
            self.affinity.popitem(last=False)
        self.last_pick[replica] = self.picks
        self.picks += 1
        self.routed[replica] += 1


def _load(client: EngineCoreClient) -> int:
    stats = client.get_stats()
    if stats is None:
        return len(client._inflight)
    return int(stats.num_waiting) + int(stats.num_running)


def merge_stats(stats: list[EngineStats]) -> EngineStats:
    """Counters and gauges summed; ratios weighted (KV usage by blocks, the rest averaged)."""
    out = {}
    for f in dataclasses.fields(EngineStats):
        values = [getattr(s, f.name) for s in stats]
        if isinstance(values[0], dict):  # counts by name (LoRA adapters): summed name by name
            out[f.name] = dict(sum((Counter(v) for v in values), Counter()))
            continue
        out[f.name] = sum(values) if f.type in ("int", int) else sum(values) / len(values)
    total = out["num_total_blocks"]
    out["kv_cache_usage"] = out["num_used_blocks"] / total if total else 0.0
    return EngineStats(**out)


class DPClient:
    """N engine-core replicas behind one front end (see the module docstring)."""

    def __init__(self, clients: list[EngineCoreClient], block_size: int, lockstep: bool = False) -> None:
        self.clients = clients
        self.lockstep = lockstep  # attention-DP + EP (executors/dp_lockstep.py): one dead replica, all dead
        self.block_size = block_size
        self.router = Router(len(clients))
        self.owner: dict[str, int] = {}
        self.dead: list[str | None] = [None] * len(clients)
        self.on_dead: Any = None
        self._lock = threading.Lock()
        self._wake = WakeupPipe()  # a replica died, or new work: interrupt a waiting step()
        first = clients[0]
        self.tokenizer = first.tokenizer
        self.model_name = first.model_name
        self.max_model_len = first.max_model_len
        self.vocab_size = first.vocab_size
        self.eos_token_ids = first.eos_token_ids
        self.kv_cache_tokens = min(c.kv_cache_tokens for c in clients)
        self.scheduling_policy = first.scheduling_policy
        self.core_pid = ", ".join(str(c.core_pid) for c in clients)
        for i, c in enumerate(clients):
            c.on_dead = lambda e, i=i: self._replica_died(i, e)

    @classmethod
    def spawn(cls, args: EngineArgs, log_level: str = "info") -> DPClient:
        """Start ``args.data_parallel_size`` engine cores at once, then connect to each."""
        n = args.data_parallel_size
        replica_args = dataclasses.replace(args, data_parallel_size=1)
        lockstep = dp_lockstep.dp_ep_enabled(args)
        extra: dict[str, str] = {}
        if lockstep:  # attention-DP + EP: the replicas join one world, rank 0 hosts the rendezvous
            dp_lockstep.validate_dp_ep(args)
            replica_args = dataclasses.replace(replica_args, enforce_eager=True)
            extra = {dp_lockstep.MASTER_ENV: f"127.0.0.1:{free_port()}", dp_lockstep.SIZE_ENV: str(n)}
        launches: list[CoreLaunch] = []
        clients: list[EngineCoreClient] = []
        on_cpu = resolve_device(args.device).type == "cpu"
        try:
            for r in range(n):
                # TOKENFAB_DP_RANK: the replica's index (its rank in the attention-DP + EP world)
                # CPU: each replica on its own slice of the cores (engine/runner/cpu_threads.py)
                cores = child_env(r, n) if on_cpu and args.cpu_threads is None else {}
                launches.append(CoreLaunch.start(replica_args, log_level, env={**os.environ, **extra, **cores,
                                                                                "TOKENFAB_DP_RANK": str(r)}))
            tokenizer = load_tokenizer(args.model)
            for launch in launches:
                clients.append(EngineCoreClient.connect(launch, tokenizer))
        except BaseException:
            for c in clients:
                c.close()
            for launch in launches[len(clients):]:
                launch.kill()
            raise
        log.info("data parallel: %d engine-core replicas (pids %s)%s", n, ", ".join(str(c.core_pid) for c in clients),
                 " in lockstep, experts sharded over them (attention-DP + EP)" if lockstep else "")
        return cls(clients, args.block_size, lockstep)

    # ---- liveness ----
    def _replica_died(self, index: int, error: EngineDeadError) -> None:
        with self._lock:
            if self.dead[index] is not None:
                return
            self.dead[index] = str(error)
            if self.lockstep:  # the others' collectives cannot go on without it
                for i, d in enumerate(self.dead):
                    if d is None:
                        self.dead[i] = f"data-parallel replica {index} died (attention-DP + EP): {error}"
            all_dead = all(d is not None for d in self.dead)
        log.error("data-parallel replica %d is dead: %s", index, error)
        self.wakeup()
        if all_dead and self.on_dead is not None:
            self.on_dead(EngineDeadError(f"every data-parallel replica is dead (last: {error})"))

    @property
    def is_dead(self) -> bool:
        return all(d is not None for d in self.dead)

    def _alive(self) -> list[int]:
        return [i for i, d in enumerate(self.dead) if d is None]

    def wakeup(self) -> None:
        self._wake.set()

    # ---- the LLMEngine face ----
    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.clients[0].check_request(prompt_token_ids, params)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    priority: int = 0, cache_salt: str | None = None) -> None:
        if request_id in self.owner:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = list(tokenize_prompt(self.tokenizer, prompt)[1])
        keys = prefix_keys(ids, self.block_size, cache_salt)
        while True:
            loads = [None if self.dead[i] is not None else _load(c) for i, c in enumerate(self.clients)]
            r = self.router.choose(keys, loads)  # EngineDeadError when none is alive
            try:
                self.clients[r].add_request(request_id, ids, params, priority, cache_salt)
            except EngineDeadError as e:  # it died just now: route around it
                self._replica_died(r, e)
                continue
            self.owner[request_id] = r
            return

    def abort_request(self, request_id: str) -> None:
        r = self.owner.pop(request_id, None)
        if r is not None and self.dead[r] is None:
            self.clients[r].abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return any(self.dead[r] is not None for r in self.owner.values()) \
            or any(self.clients[i].has_unfinished_requests() for i in self._alive())

    def step(self, timeout_ms: int = 1000) -> list[RequestOutput]:
        """The outputs of every replica that arrived; waits up to ``timeout_ms`` for some."""
        if self.is_dead and not self.owner:
            raise EngineDeadError(self.dead[-1] or "every data-parallel replica is dead")
        alive = self._alive()
        outputs: list[RequestOutput] = []
        self._fail_dead_replicas(outputs)
        if not outputs:
            poller = zmq.Poller()
            poller.register(self._wake.fd, zmq.POLLIN)
            for i in alive:
                poller.register(self.clients[i].sock, zmq.POLLIN)
                poller.register(self.clients[i].wake_fd, zmq.POLLIN)
            poller.poll(timeout_ms)
            self._wake.clear()
        for i in alive:
            try:
                outs = self.clients[i].step(0)
            except EngineDeadError as e:
                self._replica_died(i, e)
                continue
            for out in outs:
                if out.finished:
                    self.owner.pop(out.request_id, None)
            outputs += outs
        self._fail_dead_replicas(outputs)
        if not outputs and self.is_dead and not self.owner:
            raise EngineDeadError("every data-parallel replica is dead")
        return outputs

    def _fail_dead_replicas(self, outputs: list[RequestOutput]) -> None:
        """The requests of replicas that died end with an error (once each)."""
        for rid, r in list(self.owner.items()):
            if self.dead[r] is not None:
                del self.owner[rid]
                message = f"data-parallel replica {r} died: {self.dead[r]}"
                co = CompletionOutput(index=0, text="", token_ids=[], finish_reason="error")
                outputs.append(RequestOutput(rid, None, [], [co], True, error=message))

    def get_stats(self) -> EngineStats | None:
        stats = [s for i in self._alive() if (s := self.clients[i].get_stats()) is not None]
        return merge_stats(stats) if stats else None

    def close(self, timeout: float = 10.0) -> None:
        for c in self.clients:
            c.close(timeout)
        self._wake.close()
