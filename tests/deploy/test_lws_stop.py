"""The manifests' stop sequences, run on this machine with the container command lines exactly as
deploy/kubernetes renders them (a tiny random Llama on CPU, requests in flight), then what the kubelet does
when the pod is deleted: run the preStop hook, then SIGTERM to the container's first process.

- The replica Deployment: ``tokenfab serve`` drains by itself on SIGTERM; every request completes.
- The LeaderWorkerSet (torchrun with the $(LWS_*) variables expanded as Kubernetes would, on loopback, one
  process a "node"): with the manifest's preStop hooks (the leader's ``wait_idle`` returns once its requests
  are done; the workers' sleep outlasts it) every request completes. Without them, SIGTERM to both torchruns
  loses the requests in flight: torchrun signals each rank's whole process group, so rank 0's engine core
  exits at once. That is the reason for the hooks.

Slow tier (process trees); the fast twin is tests/deploy/test_kubernetes_manifests.py (the same command lines
parsed by the same parsers)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from tests.deploy.manifests import find, objects
from tests.distributed.launch import free_port
from tests.distributed.test_torchrun import tiny_llama_with_tokenizer
from tests.watched_process import WatchedProcess

pytestmark = pytest.mark.slow
MAX_TOKENS = 300
STREAMS = 3


class Container(WatchedProcess):
    """A container's process: its rendered command line (the image's commands from this venv), its own session."""

    def __init__(self, container: dict, env: dict[str, str] | None = None, args: list[str] | None = None) -> None:
        command = [str(Path(sys.executable).parent / container["command"][0]), *container["command"][1:]]
        env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        args = container["args"] if args is None else args
        super().__init__([*command, *args, "--max-model-len", "512", "--no-access-log"], env, start_new_session=True)

    def sigterm(self) -> None:  # the kubelet signals the container's first process only
        self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def lws_pod(container: dict, worker_index: int) -> Container:
    """One LWS pod: LWS's env in the container, Kubernetes' $(VAR) expansion of its args."""
    lws_env = {"LWS_LEADER_ADDRESS": "127.0.0.1", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": str(worker_index)}
    args = [re.sub(r"\$\(([A-Z_]+)\)", lambda m: lws_env[m.group(1)], a) for a in container["args"]]
    return Container(container, lws_env, args)


class Stream(threading.Thread):
    """A streamed completion; ``started`` once its first token arrived."""

    def __init__(self, url: str, prompt: str) -> None:
        super().__init__(daemon=True)
        self.url, self.prompt = url, prompt
        self.started = threading.Event()
        self.tokens = 0  # from the final usage chunk: 0 if the stream never finished
        self.finish_reason: str | None = None
        self.error: str | None = None

    def run(self) -> None:
        body = {"prompt": self.prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        self.error = str(chunk["error"])
                        break
                    if chunk.get("usage"):  # the last chunk: the tokens generated, counted by the server
                        self.tokens = chunk["usage"]["completion_tokens"]
                    if chunk["choices"]:
                        self.finish_reason = chunk["choices"][0].get("finish_reason") or self.finish_reason
                    self.started.set()
        except httpx.HTTPError as e:
            self.error = repr(e)
        finally:
            self.started.set()


@pytest.fixture()
def group(tmp_path):
    model = tiny_llama_with_tokenizer(tmp_path / "m")
    port = free_port()
    docs = objects(("leaderworkerset.yaml",), LWS_MODEL_PATH=str(model), PORT=str(port),
                   TORCHRUN_PORT=str(free_port()), LWS_GPUS_PER_NODE="1", LWS_GROUP_SIZE="2",
                   PRESTOP_SLEEP_SECONDS="0", DRAIN_TIMEOUT="60")
    template = find(docs, "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]
    leader_c = template["leaderTemplate"]["spec"]["containers"][0]
    pods = [lws_pod(leader_c, 0), lws_pod(template["workerTemplate"]["spec"]["containers"][0], 1)]
    try:
        pods[0].wait_for(r"tokenfab is serving", 300, poll=0.1)
        yield f"http://127.0.0.1:{port}", pods, leader_c["lifecycle"]["preStop"]["exec"]["command"]
    finally:
        for pod in pods:
            pod.kill()


def test_the_deployment_command_drains_its_requests_on_sigterm(tmp_path):
    model = tiny_llama_with_tokenizer(tmp_path / "m")
    port = free_port()
    pod = find(objects(("deployment.yaml",), MODEL_PATH=str(model), PORT=str(port), GPUS_PER_POD="1",
                       DRAIN_TIMEOUT="60"), "Deployment")["spec"]["template"]["spec"]
    server = Container(pod["containers"][0])
    try:
        server.wait_for(r"tokenfab is serving", 300, poll=0.1)
        streams = _start_streams(f"http://127.0.0.1:{port}")
        server.sigterm()  # the preStop hook is a sleep: nothing to run
        for s in streams:
            s.join(90)
            assert s.error is None and s.finish_reason == "length" and s.tokens == MAX_TOKENS, vars(s)
        assert server.proc.wait(pod["terminationGracePeriodSeconds"]) in (0, -signal.SIGTERM)
    finally:
        server.kill()


def _start_streams(url: str) -> list[Stream]:
    streams = [Stream(url, f"Request {i} says") for i in range(STREAMS)]
    for s in streams:
        s.start()
    for s in streams:
        assert s.started.wait(120)
    assert all(s.error is None and s.finish_reason is None for s in streams), "finished before the stop began"
    return streams


def test_with_the_prestop_hooks_every_request_in_flight_completes(group):
    url, (leader, worker), hook = group
    streams = _start_streams(url)
    # the kubelet runs the leader's preStop hook (the worker's is a sleep that outlasts it) ...
    assert hook[0] == "python"
    done = subprocess.run([sys.executable, *hook[1:]], timeout=120)
    assert done.returncode == 0
    # ... then SIGTERM to each pod's first process, torchrun
    leader.sigterm()
    worker.sigterm()
    for s in streams:
        s.join(60)
        assert s.error is None and s.finish_reason == "length" and s.tokens == MAX_TOKENS, vars(s)
    assert leader.proc.wait(90) is not None and worker.proc.wait(90) is not None  # within the grace period


def test_without_them_sigterm_to_both_torchruns_loses_the_requests_in_flight(group):
    url, (leader, worker), _ = group
    streams = _start_streams(url)
    leader.sigterm()
    worker.sigterm()
    for s in streams:
        s.join(120)
    assert any(s.error is not None or s.tokens < MAX_TOKENS for s in streams), [vars(s) for s in streams]
    assert leader.proc.wait(90) is not None and worker.proc.wait(90) is not None
