"""Two "nodes" on loopback through torchrun's rendezvous: ``torchrun --nnodes 2 --nproc-per-node 1
--node-rank {0,1} --master-addr 127.0.0.1 --master-port P -m tokenfab serve MODEL``, two processes
started by the test. Rank 0 serves (its engine core joins the group as rank 0), rank 1 runs the
tensor-parallel worker loop. Greedy answers, streamed and not, equal the one-process engine's;
SIGTERM to node 0 stops both. Slow tier (spawns process trees)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import httpx
import pytest

from tests.distributed.launch import free_port
from tests.server.streams import completion_text
from tests.watched_process import WatchedProcess
from tokenfab import LLM, SamplingParams

pytestmark = pytest.mark.slow
API_KEY = "test-torchrun-key"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


def tiny_llama_with_tokenizer(out: Path) -> Path:
    """A tiny random Llama (4 query / 2 KV heads: TP 2 divides both) with the bundled tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from tokenfab.loader.bundled import bundled_model_path

    gguf = Path(bundled_model_path())
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(str(out))
    return out


class Node(WatchedProcess):
    def __init__(self, rank: int, port: int, model: Path) -> None:
        env = {**os.environ, "TOKENFAB_API_KEY": API_KEY, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port),
               "-m", "tokenfab", "serve", str(model), "--port", "0", "--max-model-len", "256", "--no-access-log"]
        super().__init__(cmd, env, start_new_session=True)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def _complete(c: httpx.Client, prompt: str, stream: bool) -> str:
    return completion_text(c, {"prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}, stream)


def test_two_nodes_through_torchrun_serve_the_one_process_tokens(tmp_path):
    model = tiny_llama_with_tokenizer(tmp_path / "m")
    llm = LLM(str(model), max_model_len=256)
    expected = [o.outputs[0].text for o in
                llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))]
    del llm
    port = free_port()
    nodes = [Node(0, port, model), Node(1, port, model)]
    try:
        url = nodes[0].wait_for(r"serving .* at (http://\S+)/v1", 240, poll=0.1).group(1)
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
            for stream in (False, True):
                assert [_complete(c, p, stream) for p in PROMPTS] == expected
        assert nodes[1].proc.poll() is None  # rank 1 is the worker, still in its loop
        os.kill(nodes[0].proc.pid, signal.SIGTERM)  # torchrun passes it to the server, which drains
        assert nodes[0].proc.wait(60) is not None
        assert nodes[1].proc.wait(60) is not None  # the worker ends with the group
    finally:
        for n in nodes:
            n.kill()
