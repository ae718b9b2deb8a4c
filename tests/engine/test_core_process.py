"""The engine core across a process boundary: the wire protocol (``ipc``), the core loop
(``core_process.EngineCore``) with its client (``core_client.EngineCoreClient``), and death.

The core loop runs in a thread of this process here (same protocol, same sockets: ipc://), on the
bundled model, and its text must equal what ``LLMEngine`` makes when it detokenizes itself: every
per-step delta, the final text, the stop reason, logprob texts. Death is shown on a stand-in core
process that answers the handshake and is then SIGKILLed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import threading
import time

import msgpack
import pytest
import zmq

from tests.engine.fake_core import fake_core_process
from tokenfab.engine.args import EngineArgs
from tokenfab.engine.core import ipc
from tokenfab.engine.core.client import EngineCoreClient
from tokenfab.engine.core.process import EngineCore
from tokenfab.engine.output_processor import TokenTexts
from tokenfab.engine.requests.errors import EngineDeadError
from tokenfab.engine.requests.sampling_params import SamplingParams


# ---- the wire protocol -------------------------------------------------------------------------
def test_every_message_round_trips():
    params = ipc.params_to_wire(SamplingParams(temperature=0.5, seed=3, stop=["x"], logit_bias={5: -1.5}))
    out = ["r1", [1, 2], [[[1, 7], [-0.1, -2.0], [1, 2]], [[2], [-0.5], [1]]], "stop", 2, None, 16,
           [None, [[3], [-1.0], [1]]]]
    messages = [("hello",), ("add", "r1", [1, 2, 3], params, 0, None, '{"type": "json_object"}', 1.5, None),
                ("add", "r2", [4], params, 0, "salt", None, 1.5, ["x", 7, "/adapters/x", None]),  # a LoRA request
                ("abort", ["r1", "r2"]), ("shutdown",), ("ready", {"model_name": "m"}),
                ("outputs", [out], {"num_running": 1}), ("outputs", [], None), ("dead", "boom")]
    for tag, *fields in messages:
        assert ipc.decode(ipc.encode(tag, *fields)) == (tag, list(fields))


def _pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


@pytest.mark.parametrize("frame", [
    b"", b"\xc1", b"not msgpack at all \xff\xfe", _pack({"v": 1}), _pack([1]), _pack("add"),
    _pack([2, "hello"]),  # another protocol version
    _pack([True, "hello"]),  # a bool is not the version
    _pack([1, "exec"]),  # unknown type
    _pack([1, b"hello"]),  # the type as bytes
    _pack([1, "hello", "extra"]),  # too many fields
    _pack([1, "abort"]),  # too few
    _pack([1, "abort", "r1"]),  # not a list of ids
    _pack([1, "abort", [1]]),
    _pack([1, "add", "r", [1, "2"], {}, 0, None, None, 0.0]),  # a token id that is a string
    _pack([1, "add", "r", [1, True], {}, 0, None, None, 0.0]),  # a bool token id
    _pack([1, "add", "r", [1], [], 0, None, None, 0.0]),  # params not a map
    _pack([1, "add", "r", [1], {}, 0.5, None, None, 0.0]),  # float priority
    _pack([1, "outputs", [["r", [1], None, "stop", None, None, 0]], None]),  # a record one field short
    _pack([1, "outputs", [["r", [1], [[[1], [0.0]]], None, None, None, 0, None]], None]),  # logprob pair
    _pack([1, "outputs", [["r", [1], [[[1, 2], [0.0], [1]]], None, None, None, 0, None]], None]),  # ragged
    _pack([1, "outputs", [["r", [1], None, None, [1], None, 0, None]], None]),  # stop reason a list
    _pack([1, "ready", {1: "x"}]),  # non-string map keys (strict_map_key)
    _pack([1, "hello"]) + b"\x00",  # trailing bytes
])
def test_malformed_frames_are_rejected(frame):
    with pytest.raises(ipc.ProtocolError):
        ipc.decode(frame)


def test_unknown_tag_cannot_be_encoded():
    with pytest.raises(ipc.ProtocolError):
        ipc.encode("eval", "1+1")


def test_sampling_params_round_trip():
    p = SamplingParams(n=1, temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, seed=2**62, presence_penalty=0.5,
                       frequency_penalty=-0.5, repetition_penalty=1.1, max_tokens=9, min_tokens=2,
                       stop=["a", "bc"], stop_token_ids=[3], ignore_eos=True, logprobs=3, prompt_logprobs=1,
                       logit_bias={7: 2.0, 11: -100.0}, skip_special_tokens=False, include_stop_str_in_output=True)
    _, fields = ipc.decode(ipc.encode("add", "r", [1], ipc.params_to_wire(p), 0, None, None, 0.0, None))
    back = ipc.params_from_wire(fields[2])
    assert dataclasses.asdict(back) == dataclasses.asdict(p)


@pytest.mark.parametrize("wire, field", [
    ({"temperature": 1.0, "eval": "x"}, "unknown"),
    ({"temperature": -1.0}, "temperature"),
    ({"logit_bias": [[1, 2.0, 3]]}, "logit_bias"),
    ({"logit_bias": {"1": 2.0}}, "logit_bias"),
    ({"stop": "abc"}, "stop"),
    ({"max_tokens": "9"}, "max_tokens"),
])
def test_bad_sampling_params_are_refused_by_name(wire, field):
    with pytest.raises(ValueError, match=field):
        ipc.params_from_wire(wire)


# ---- the core loop and its client, in this process --------------------------------------------
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a"]
CASES = [
    SamplingParams(temperature=0.0, max_tokens=12),
    SamplingParams(temperature=0.0, max_tokens=16, stop=[" Paris", "\n\n", "return"]),
    SamplingParams(temperature=0.0, max_tokens=16, stop=["ib", "a little"], include_stop_str_in_output=True,
                   logprobs=2),
    SamplingParams(temperature=0.0, max_tokens=10, stop=["."], min_tokens=6, prompt_logprobs=1),
    SamplingParams(temperature=0.9, seed=11, max_tokens=14, logprobs=1, stop=["the"]),
    SamplingParams(temperature=1.0, seed=5, max_tokens=8, top_k=20, stop_token_ids=[13]),
]


@pytest.fixture(scope="module")
def engine():
    from tokenfab.engine.llm_engine import LLMEngine

    return LLMEngine(EngineArgs(max_model_len=256, num_kv_blocks=64))


def _fresh(p: SamplingParams) -> SamplingParams:
    """One grammar matcher per request (the core compiles its own from ``spec_json``)."""
    if p.constraint is None:
        return p
    clone = p.constraint.clone()
    clone.spec_json = p.constraint.spec_json
    return dataclasses.replace(p, constraint=clone)


def _with_grammar(engine) -> list[SamplingParams]:
    from tokenfab.engine.runner.structured import StructuredOutputCompiler

    rf = {"type": "json_schema", "json_schema": {"name": "c", "schema": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    constraint = StructuredOutputCompiler(engine.tokenizer, engine.vocab_size).from_response_format(rf)
    constraint.spec_json = json.dumps(rf)
    return CASES + [SamplingParams(temperature=0.0, max_tokens=12, constraint=constraint)]


def _in_process(engine, params):
    """Per request: (every delta text, final RequestOutput), LLMEngine detokenizing itself."""
    deltas: dict[str, list[str]] = {}
    final = {}
    for i, prompt in enumerate(PROMPTS):
        for j, p in enumerate(params):
            engine.add_request(f"{i}-{j}", prompt, _fresh(p))
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.setdefault(out.request_id, []).append(out.outputs[0].delta_text)
            if out.finished:
                final[out.request_id] = out
    return deltas, final


@pytest.fixture(scope="module")
def core(engine, tmp_path_factory):
    """The reference first (detokenizing), then the same engine token-only behind EngineCore."""
    cases = _with_grammar(engine)
    reference = _in_process(engine, cases)
    engine.post.detokenize, engine.post.decode_one = False, TokenTexts(None)
    address = f"ipc://{tmp_path_factory.mktemp('core')}/core.sock"
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(address)
    loop = EngineCore(engine, sock)
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    client = EngineCoreClient(address, os.getpid(), engine.tokenizer, ready_timeout=30)
    yield client, (cases, reference)
    client._send(ipc.encode("shutdown"))
    thread.join(10)
    client.close()
    sock.close(0)
    ctx.term()
    engine.post.detokenize, engine.post.decode_one = True, TokenTexts(engine.tokenizer)


def _through_client(client, params, prefix=""):
    deltas: dict[str, list[str]] = {}
    final = {}
    for i, prompt in enumerate(PROMPTS):
        for j, p in enumerate(params):
            client.add_request(f"{prefix}{i}-{j}", client.tokenizer.encode(prompt), _fresh(p))
    deadline = time.monotonic() + 120
    while client.has_unfinished_requests():
        assert time.monotonic() < deadline
        for out in client.step():
            rid = out.request_id.removeprefix(prefix)
            deltas.setdefault(rid, []).append(out.outputs[0].delta_text)
            if out.finished:
                final[rid] = out
    return deltas, final


def _same_logprobs(got, want, rid) -> None:
    if want is None:
        assert got is None, rid
        return
    assert len(got) == len(want), rid
    for g, w in zip(got, want):
        if w is None:
            assert g is None, rid
            continue
        assert list(g) == list(w), rid
        for tok in w:
            assert (g[tok].rank, g[tok].decoded_token) == (w[tok].rank, w[tok].decoded_token), rid
            assert g[tok].logprob == pytest.approx(w[tok].logprob, abs=1e-4), rid


def test_handshake_reports_the_model(core, engine):
    client, _ = core
    assert client.model_name == engine.model_name and client.vocab_size == engine.vocab_size
    assert client.max_model_len == engine.max_model_len and client.eos_token_ids == engine.eos_token_ids
    assert client.kv_cache_tokens == engine.kv_cache_tokens


def test_text_equals_the_in_process_engine(core):
    client, (cases, (ref_deltas, ref_final)) = core
    deltas, final = _through_client(client, cases)
    assert set(final) == set(ref_final)
    stopped_by_string = 0
    for rid, ref in ref_final.items():
        got, want = final[rid].outputs[0], ref.outputs[0]
        assert got.token_ids == want.token_ids, rid
        assert got.text == want.text, rid
        assert (got.finish_reason, got.stop_reason) == (want.finish_reason, want.stop_reason), rid
        # the decoded_token texts included; values to float noise (the batches the core ran may differ)
        _same_logprobs(got.logprobs, want.logprobs, rid)
        _same_logprobs(final[rid].prompt_logprobs, ref.prompt_logprobs, rid)
        assert deltas[rid] == ref_deltas[rid], rid  # the hold-back of stop-string prefixes included
        stopped_by_string += isinstance(want.stop_reason, str)
    assert stopped_by_string >= 3  # the cases reach the stop-string path
    assert all(final[f"{i}-{len(CASES)}"].outputs[0].text.startswith('{"city"') for i in range(len(PROMPTS)))


def test_abort_reaches_the_core(core, engine):
    client, _ = core
    client.add_request("a1", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    got = []
    while not got:
        got = client.step()
    client.abort_request("a1")
    deadline = time.monotonic() + 10
    while client.has_unfinished_requests():  # busy until the core acknowledged the abort
        assert time.monotonic() < deadline
        assert client.step(timeout_ms=50) == []  # nothing more reaches the caller
    assert not engine.has_unfinished_requests()  # the core dropped it


def test_bad_request_is_refused_before_sending(core):
    client, _ = core
    with pytest.raises(ValueError, match="prompt"):
        client.add_request("b1", [client.vocab_size + 5], SamplingParams())
    with pytest.raises(ValueError, match="context"):
        client.add_request("b2", [1] * 300, SamplingParams())
    assert not client.has_unfinished_requests()


def test_core_rejects_a_request_it_cannot_take(core):
    """A request the front end let through but the core refuses comes back as an error output."""
    client, _ = core
    client._send(ipc.encode("add", "x1", [1, 2], {"temperature": 1.0, "nope": 1}, 0, None, None, 0.0, None))
    client.processor.add("x1", [1, 2], SamplingParams())
    client._inflight.add("x1")
    client._adds_sent += 1
    outs = []
    while client.has_unfinished_requests():
        outs += client.step()
    assert outs[-1].outputs[0].finish_reason == "error" and "nope" in outs[-1].error


# ---- death -------------------------------------------------------------------------------------
_SILENT_LOOP = """
    while True:  # answers hello, swallows everything else (requests never finish)
        ident, frame = sock.recv_multipart()
        if ipc.decode(frame)[0] == "hello":
            sock.send_multipart([ident, ipc.encode("ready", info)])
"""


@pytest.fixture
def fake_core(tmp_path):
    with fake_core_process(tmp_path, _SILENT_LOOP) as core:
        yield core


def test_a_killed_core_is_noticed_at_once(fake_core):
    address, proc = fake_core
    client = EngineCoreClient(address, proc.pid, None, ready_timeout=60)
    died = threading.Event()
    client.on_dead = lambda e: died.set()
    client.add_request("r", [1, 2], SamplingParams(max_tokens=5))
    assert client.step(timeout_ms=50) == []
    t0 = time.monotonic()
    proc.send_signal(signal.SIGKILL)
    assert died.wait(5), "the watchdog did not notice the core's death"
    with pytest.raises(EngineDeadError, match="died"):
        client.step()
    assert time.monotonic() - t0 < 5
    with pytest.raises(EngineDeadError):
        client.add_request("r2", [1], SamplingParams())
    client.close()


def test_async_engine_fails_streams_and_turns_dead(fake_core):
    """Through AsyncEngine (what the server talks to): the stream in flight gets EngineDeadError,
    ``is_dead`` turns true, new requests are refused; no hang."""
    from tokenfab.engine.core.async_engine import AsyncEngine

    address, proc = fake_core
    client = EngineCoreClient(address, proc.pid, None, ready_timeout=60)
    engine = AsyncEngine(client)

    async def scenario():
        stream = engine.add_request(None, [1, 2, 3], SamplingParams(max_tokens=5))
        await stream.wait_accepted()
        assert not engine.is_dead and engine.is_running
        proc.send_signal(signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            async with asyncio.timeout(10):
                async for _ in stream:
                    pass
        assert engine.is_dead and not engine.is_running
        with pytest.raises(EngineDeadError):
            engine.add_request(None, [1], SamplingParams())

    try:
        asyncio.run(scenario())
    finally:
        engine.shutdown()
