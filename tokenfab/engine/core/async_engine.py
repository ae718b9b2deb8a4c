"""AsyncEngine: the blocking ``LLMEngine`` driven by a background thread, for asyncio servers.

One dedicated thread owns the engine: it takes newly submitted requests and aborts (handed over
under a lock), runs ``engine.step()`` while there is work (so requests join and leave the running
batch between steps and the batch stays full), and sleeps on a condition variable when idle.
Outputs are turned into ``StreamChunk`` deltas and delivered to each request's asyncio queue on
its event loop with one ``call_soon_threadsafe`` per loop per step.

A request with ``n > 1`` (or several prompts) fans out into one engine request per choice
(``{id}-{i}``; seeded requests get ``seed + i``; grammar constraints are cloned), merged back into
one ``RequestStream`` whose chunks carry the choice index.

The engine is either an ``LLMEngine`` stepped on this thread (the in-process backend: tests, the
offline path, ``tokenfab serve --engine-in-process``) or an ``EngineCoreClient`` whose ``step()``
waits for the outputs of an engine core running in its own process (``engine/core/client.py``).
A backend with ``wakeup()`` is woken when work is queued; one with ``on_dead`` reports its own death
(the core process exited), which fails every stream and makes ``is_dead`` true at once.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from tokenfab.engine.core.request_stream import (
    Choice,
    PromptType,
    RequestStream,
    StreamChunk,
    deliver,
    make_choices,
    next_chunk,
)
from tokenfab.engine.forwarded import Forwarded
from tokenfab.engine.requests.errors import EngineDeadError, QueueFullError, RequestFailedError
from tokenfab.engine.requests.lora_request import LoRARequest
from tokenfab.engine.requests.outputs import RequestOutput
from tokenfab.engine.requests.sampling_params import SamplingParams

__all__ = [
    "AsyncEngine", "EngineDeadError", "QueueFullError", "RequestFailedError", "RequestStream", "StreamChunk",
]

logger = logging.getLogger(__name__)


class AsyncEngine:
    """Thread-safe, asyncio-friendly front of an ``LLMEngine``."""

    def __init__(self, engine: Any, max_waiting: int | None = None,
                 on_first_token: Callable[[float], None] | None = None,
                 on_finished: Callable[[StreamChunk, int], None] | None = None) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        # Metric hooks, called on the engine thread: on_first_token(seconds since arrival) and
        # on_finished(final chunk, number of generated tokens).
        self.on_first_token = on_first_token
        self.on_finished = on_finished
        self._cv = threading.Condition()
        self._pending_adds: deque[tuple[RequestStream, list[Choice]]] = deque()
        self._pending_aborts: list[RequestStream] = []
        self._pending_count = 0  # choices submitted but not yet handed to the engine
        self._in_transit = 0  # choices handed to the engine, not yet reflected in the stats snapshot
        self._subs: dict[str, Choice] = {}  # engine thread only
        self._stats: Any = None
        self._stopping = False
        self._accepting = True
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._idle = threading.Event()
        self._idle.set()
        self._counter = 0
        self.steps = 0
        try:
            self._stats = engine.get_stats()
        except Exception:  # a minimal engine without stats
            self._stats = None
        self._wakeup = getattr(engine, "wakeup", None)
        if hasattr(engine, "on_dead"):
            engine.on_dead = self._backend_died

    # ---- properties read by the server ----
    tokenizer: Forwarded[Any] = Forwarded("engine.tokenizer")
    model_name: Forwarded[str] = Forwarded("engine.model_name")
    max_model_len: Forwarded[int] = Forwarded("engine.max_model_len", int)
    vocab_size: Forwarded[int] = Forwarded("engine.vocab_size", int)

    @property
    def lora_targets(self) -> dict | None:
        """The modules LoRA adapters may target (``--enable-lora``; ``loader.lora_adapter.lora_targets_of``),
        for checking an adapter's files before a request uses it; None without LoRA."""
        return getattr(self.engine, "lora_targets", None)

    @property
    def scheduling_policy(self) -> str:
        return str(getattr(self.engine, "scheduling_policy", "fcfs"))

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._error is None

    @property
    def is_dead(self) -> bool:
        """True once a fatal engine error stopped it (the server answers 503 from then on)."""
        return self._error is not None

    @property
    def error(self) -> BaseException | None:
        return self._error

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """The engine's pure validation against the loaded model (ValueError naming the parameter);
        safe to call from the event loop while the engine thread steps."""
        check = getattr(self.engine, "check_request", None)
        if check is not None:
            check(prompt_token_ids, params)
        else:
            params.validate()

    def stats(self) -> Any:
        """The engine's stats as of the end of the last step (never blocks on a step)."""
        return self._stats

    def num_waiting(self) -> int:
        with self._cv:
            waiting = int(getattr(self._stats, "num_waiting", 0) or 0) if self._stats is not None else 0
            return self._pending_count + self._in_transit + waiting

    def num_running(self) -> int:
        return int(getattr(self._stats, "num_running", 0) or 0) if self._stats is not None else 0

    # ---- lifecycle ----
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="tokenfab-engine", daemon=True)
        self._thread.start()

    def stop_accepting(self) -> None:
        self._accepting = False

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no request is queued or running (used to drain on shutdown)."""
        return self._idle.wait(timeout)

    def shutdown(self, drain_timeout: float = 0.0) -> None:
        """Stop taking requests, let running ones finish for up to ``drain_timeout`` s, then stop."""
        self._accepting = False
        if drain_timeout > 0:
            self._idle.wait(drain_timeout)
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout=30)
        close = getattr(self.engine, "close", None)
        if close is not None:  # an engine-core process: stop it
            close()

    # ---- submission (event loop side) ----
    def _new_id(self) -> str:
        self._counter += 1
        return f"req-{self._counter}"

    def add_requests(self, request_id: str | None, prompts: Sequence[PromptType], params: SamplingParams,
                     priority: int = 0, arrival_time: float | None = None,
                     cache_salt: str | None = None, lora_request: LoRARequest | None = None) -> RequestStream:
        """Submit ``len(prompts) * params.n`` choices as one stream; choice index = prompt_index*n + i.

        Raises ``QueueFullError`` when the choices waiting plus these ``n * len(prompts)`` exceed
        ``max_waiting``, and ``EngineDeadError`` once dead or shutting down; the engine's own
        ValueError (prompt too long...) comes from ``stream.wait_accepted()``. A failure of one
        choice inside a step reaches the stream as ``RequestFailedError``.
        """
        if self._error is not None:
            raise EngineDeadError(f"engine stopped: {self._error}")
        if not self._accepting or self._stopping:
            raise EngineDeadError("server is shutting down")
        if self._thread is None:
            self.start()
        loop = asyncio.get_running_loop()
        request_id = request_id or self._new_id()
        total = max(1, int(params.n)) * len(prompts)
        stream = RequestStream(self._abort_stream, request_id, total, loop, arrival_time)
        subs = stream.subs = make_choices(stream, prompts, params, priority, cache_salt, lora_request)
        with self._cv:
            if self._error is not None:  # died while this request was being built
                raise EngineDeadError(f"engine stopped: {self._error}")
            if self.max_waiting is not None:
                stats_waiting = int(getattr(self._stats, "num_waiting", 0) or 0) if self._stats else 0
                waiting = self._pending_count + self._in_transit + stats_waiting
                # every choice of every prompt counts
                if waiting + total > self.max_waiting:
                    raise QueueFullError(
                        f"too many requests waiting: {waiting} choices queued and this request adds {total} "
                        f"(n x prompts), limit {self.max_waiting}; retry later"
                    )
            self._pending_adds.append((stream, subs))
            self._pending_count += total
            self._idle.clear()
            self._cv.notify()
        self._wake()
        return stream

    def add_request(self, request_id: str | None, prompt: PromptType, params: SamplingParams,
                    priority: int = 0, arrival_time: float | None = None,
                    cache_salt: str | None = None) -> RequestStream:
        return self.add_requests(request_id, [prompt], params, priority, arrival_time, cache_salt)

    async def generate(self, prompt: PromptType, params: SamplingParams, request_id: str | None = None,
                       priority: int = 0) -> AsyncIterator[StreamChunk]:
        """Convenience: submit, then yield chunks; aborts the request if the consumer stops early."""
        stream = self.add_request(request_id, prompt, params, priority)
        try:
            await stream.wait_accepted()
            async for chunk in stream:
                yield chunk
        finally:
            stream.abort()

    def _abort_stream(self, stream: RequestStream) -> None:
        with self._cv:
            self._pending_aborts.append(stream)
            self._cv.notify()
        self._wake()

    def _wake(self) -> None:
        """Interrupt a backend ``step()`` that waits for outputs (an engine-core client)."""
        if self._wakeup is not None:
            try:
                self._wakeup()
            except Exception:  # pragma: no cover
                logger.exception("waking the engine backend failed")

    def _backend_died(self, error: EngineDeadError) -> None:
        """Called by the backend, on any thread, when it cannot go on (the core process died):
        refuse new requests now; the engine thread fails the streams in flight."""
        with self._cv:
            if self._error is None:
                self._error = error
            self._accepting = False
            self._cv.notify_all()

    # ---- the engine thread ----
    def _run(self) -> None:
        try:
            self._loop_forever()
        except BaseException as e:  # pragma: no cover - last resort
            logger.exception("engine thread crashed")
            self._die(e)
        finally:
            self._idle.set()

    def _loop_forever(self) -> None:
        engine = self.engine
        has_work = False
        while True:
            with self._cv:
                while not (self._pending_adds or self._pending_aborts or has_work or self._stopping
                           or self._error is not None):
                    self._idle.set()
                    self._cv.wait()
                if self._stopping or self._error is not None:
                    break
                adds = list(self._pending_adds)
                self._pending_adds.clear()
                aborts = self._pending_aborts
                self._pending_aborts = []
                moved = sum(len(s) for _, s in adds)
                self._pending_count -= moved
                self._in_transit += moved
            for stream in aborts:
                self._do_abort(stream)
            for stream, subs in adds:
                self._do_add(stream, subs)
            if engine.has_unfinished_requests():
                try:
                    outputs = engine.step()
                except EngineDeadError as e:
                    logger.exception("engine step failed fatally; the engine is dead")
                    self._die(e)
                    break
                except Exception as e:  # not attributable to one request: fail those in flight
                    logger.exception("engine step failed; failing the requests in flight")
                    self._fail_all(RequestFailedError(f"engine step failed: {e}"))
                    outputs = []
                self.steps += 1
                self._dispatch(outputs)
            has_work = bool(engine.has_unfinished_requests())
            try:
                stats = engine.get_stats()
            except Exception:
                stats = None
            with self._cv:
                self._stats = stats
                self._in_transit = 0
                if not has_work and not self._pending_adds:
                    self._idle.set()
        # Shutting down (or the backend died): fail whatever is left.
        self._fail_all(self._error or EngineDeadError("server shut down"))

    def _do_add(self, stream: RequestStream, subs: list[Choice]) -> None:
        if stream.aborted:
            return
        added: list[Choice] = []
        try:
            for sub in subs:
                extra = {"cache_salt": sub.cache_salt} if sub.cache_salt is not None else {}
                if sub.lora_request is not None:  # multi-LoRA: only engines started with --enable-lora take it
                    extra["lora_request"] = sub.lora_request
                self.engine.add_request(sub.engine_id, sub.prompt, sub.params, sub.priority, **extra)
                self._subs[sub.engine_id] = sub
                added.append(sub)
        except Exception as e:
            for sub in added:
                self._subs.pop(sub.engine_id, None)
                self._safe_abort(sub.engine_id)
            error = e if isinstance(e, (ValueError, EngineDeadError)) else \
                RuntimeError(f"engine rejected the request: {e!r}")
            stream._loop.call_soon_threadsafe(stream._put, error)
            return
        stream._loop.call_soon_threadsafe(stream._set_accepted, None)

    def _do_abort(self, stream: RequestStream) -> None:
        for sub in stream.subs:
            if self._subs.pop(sub.engine_id, None) is not None:
                self._safe_abort(sub.engine_id)

    def _safe_abort(self, engine_id: str) -> None:
        try:
            self.engine.abort_request(engine_id)
        except Exception:  # pragma: no cover
            logger.exception("abort_request(%s) failed", engine_id)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, StreamChunk | BaseException]]] = {}
        now = time.monotonic()
        for out in outputs:
            sub = self._subs.get(out.request_id)
            if sub is None or not out.outputs:
                continue
            co = out.outputs[0]
            if co.finish_reason == "error":  # this choice failed: its stream alone gets the error
                self._subs.pop(out.request_id, None)
                self._do_abort(sub.stream)  # the stream's other choices stop too
                error = RequestFailedError(getattr(out, "error", None) or "the request failed in the engine")
                by_loop.setdefault(sub.stream._loop, []).append((sub.stream, error))
                continue
            first = sub.first_token_time is None
            chunk = next_chunk(sub, out, now)
            if first and sub.first_token_time is not None and self.on_first_token is not None:
                try:
                    self.on_first_token(now - sub.stream.arrival_time)
                except Exception:  # pragma: no cover
                    logger.exception("on_first_token callback failed")
            if chunk.finished:
                self._subs.pop(out.request_id, None)
                if self.on_finished is not None:
                    try:
                        self.on_finished(chunk, sub.num_tokens)
                    except Exception:  # pragma: no cover
                        logger.exception("on_finished callback failed")
            by_loop.setdefault(sub.stream._loop, []).append((sub.stream, chunk))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(deliver, items)
            except RuntimeError:  # loop closed
                pass

    def _die(self, error: BaseException) -> None:
        """A fatal engine error: refuse everything from now on and fail every stream with it."""
        self._error = error if isinstance(error, EngineDeadError) else EngineDeadError(str(error))
        self._accepting = False
        self._fail_all(self._error)

    def _fail_all(self, error: BaseException) -> None:
        streams = {id(s.stream): s.stream for s in self._subs.values()}
        for engine_id in list(self._subs):
            self._safe_abort(engine_id)
        self._subs.clear()
        with self._cv:
            pending = [s for s, _ in self._pending_adds]
            self._pending_adds.clear()
            self._pending_count = 0
        for stream in list(streams.values()) + pending:
            try:
                stream._loop.call_soon_threadsafe(stream._put, error)
            except RuntimeError:
                pass
