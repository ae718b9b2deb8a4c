"""Tensor-parallel layers on 2 gloo processes against the single-process computation with the same
full weights. Exact (bit for bit): each rank's merged gate/up and QKV output equals the product with
the rows it must hold (KV heads split, and replicated when TP > KV heads), and the vocab-parallel
embedding (vocabulary padded to 64 per rank). Within torch.testing's float32 tolerance (rtol 1.3e-6,
atol 1e-5): the gathered column-parallel output and LM head logits against the full product (MKL's
sgemm picks its kernel by output width, so a 6-column slice may round differently from the same
columns of a 12-column product: measured 2.9e-6), and row-parallel (partial sums added in another
order). A small TP transformer's collectives are counted and compared with ``tokenfab plan``'s
volume for TP2."""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from tokenfab.distributed import parallel_state as ps
from tokenfab.layers.parallel_linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_rows_per_rank,
)

TP = 2
H, HEAD_DIM, HEADS, INTER, VOCAB, LAYERS, TOKENS = 64, 16, 4, 96, 200, 2, 5


def _exact(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.equal(a, b))


def _close(a: torch.Tensor, b: torch.Tensor) -> bool | str:
    try:
        torch.testing.assert_close(a, b)  # float32: rtol 1.3e-6, atol 1e-5
    except AssertionError as e:
        return str(e)
    return True


def _checks(rank: int) -> dict:
    g = torch.Generator().manual_seed(0)  # the same full weights on every rank
    x = torch.randn(TOKENS, H, generator=g)
    out: dict[str, object] = {}

    w, b = torch.randn(6 * TP, H, generator=g), torch.randn(6 * TP, generator=g)
    col = ColumnParallelLinear(H, 6 * TP, bias=True, gather_output=True)
    col.load_full(w, b)
    out["column_gather"] = _close(col(x), F.linear(x, w, b))

    gate, up = torch.randn(INTER, H, generator=g), torch.randn(INTER, H, generator=g)
    gu = MergedColumnParallelLinear(H, [INTER, INTER])
    gu.load_shard(0, gate)
    gu.load_shard(1, up)
    n = INTER // TP
    rows = slice(rank * n, (rank + 1) * n)
    out["gate_up"] = _exact(gu(x), torch.cat((F.linear(x, gate[rows]), F.linear(x, up[rows])), dim=-1))

    for kv_heads in (2, 1):  # split (2 KV heads over 2 ranks) and replicated (1 KV head, TP 2)
        q, k, v = (torch.randn(heads * HEAD_DIM, H, generator=g) for heads in (HEADS, kv_heads, kv_heads))
        qkv = QKVParallelLinear(H, HEAD_DIM, HEADS, kv_heads)
        for i, t in enumerate((q, k, v)):
            qkv.load_shard(i, t)
        lq, lk, lv = qkv(x).split(qkv.local_sizes, dim=-1)
        hq = HEADS // TP
        kv_head = rank * hq // (HEADS // kv_heads)  # the KV head of this rank's first query head
        kv_rows = slice(kv_head * HEAD_DIM, (kv_head + 1) * HEAD_DIM)
        out[f"qkv_kv{kv_heads}"] = (_exact(lq, F.linear(x, q[rank * hq * HEAD_DIM : (rank + 1) * hq * HEAD_DIM]))
                                    and _exact(lk, F.linear(x, k[kv_rows])) and _exact(lv, F.linear(x, v[kv_rows])))

    down, bias = torch.randn(H, INTER, generator=g), torch.randn(H, generator=g)
    row = RowParallelLinear(INTER, H, bias=True)
    row.load_full(down, bias)
    hidden = torch.randn(TOKENS, INTER, generator=g)
    out["row"] = _close(row(hidden[:, rows]), F.linear(hidden, down, bias))

    table = torch.randn(VOCAB, H, generator=g)
    emb = VocabParallelEmbedding(VOCAB, H)
    emb.load_full(table)
    ids = torch.tensor([0, 1, 127, 128, 129, 199, 63, 64, 128, 5])
    out["embedding"] = _exact(emb(ids), F.embedding(ids, table))
    head = ParallelLMHead(VOCAB, H)
    head.tie(emb)
    out["lm_head"] = _close(head(x), F.linear(x, table).float())
    out["vocab_rows"] = emb.weight.shape[0]
    out["comm"] = _count_mini_transformer(g)
    return out


def _count_mini_transformer(g: torch.Generator) -> list:
    """Collectives of one decode step (TOKENS sequences) through a Llama-shaped TP stack."""
    emb, head = VocabParallelEmbedding(VOCAB, H), ParallelLMHead(VOCAB, H)
    emb.load_full(torch.randn(VOCAB, H, generator=g))
    head.load_full(torch.randn(VOCAB, H, generator=g))
    layers = []
    for _ in range(LAYERS):
        qkv, o = QKVParallelLinear(H, HEAD_DIM, HEADS, 2), RowParallelLinear(HEADS * HEAD_DIM, H)
        gu, down = MergedColumnParallelLinear(H, [INTER, INTER]), RowParallelLinear(INTER, H)
        for m in (qkv, o, gu, down):
            torch.nn.init.normal_(m.weight, generator=g)
        layers.append((qkv, o, gu, down))
    counter = ps.CommCounter()
    ps.set_comm_counter(counter)
    h = emb(torch.arange(TOKENS))
    for qkv, o, gu, down in layers:
        q = qkv(h)[:, : qkv.local_sizes[0]]  # attention itself is local to the rank's heads
        h = h + o(q)
        a, b = gu(h).chunk(2, dim=-1)
        h = h + down(F.silu(a) * b)
    head(h)
    ps.set_comm_counter(None)
    return counter.calls


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    ps.init_distributed(rank, TP, init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
    ps.init_parallel(TP)
    try:
        result = _checks(rank)
    finally:
        ps.destroy_parallel()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("tp")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, str(out)), nprocs=TP, join=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(TP)]


@pytest.mark.parametrize("check", ["column_gather", "gate_up", "qkv_kv2", "qkv_kv1", "row", "embedding", "lm_head"])
def test_tp_layer_matches_single_process(results, check):
    for rank, r in enumerate(results):
        assert r[check] is True, f"rank {rank}: {r[check]}"


def test_vocab_padding(results):
    assert vocab_rows_per_rank(VOCAB, TP) == 128  # 200 -> 2 x 128 rows, a multiple of 64 per rank
    assert all(r["vocab_rows"] == 128 for r in results)


def test_single_process_is_identity():
    assert ps.get_parallel_state().tp_size == 1
    x = torch.randn(3, 8)
    w = torch.randn(8, 8)
    row = RowParallelLinear(8, 8)
    row.load_full(w)
    assert torch.equal(row(x), F.linear(x, w))


def test_comm_volume_matches_plan(results, tmp_path):
    """What the TP2 stack sent per token (ring all-reduce: 2 (t-1)/t of the payload; all-gather: (t-1)
    pieces) equals tokenfab plan's decode figure for the same shape."""
    from tests.planner.plan_configs import write_config
    from tokenfab.planner.hardware import get_gpu, parse_interconnect
    from tokenfab.planner.model_spec import build_spec, load_config
    from tokenfab.planner.plan import PlanRequest, plan_model

    calls = results[0]["comm"]
    assert [k for k, _ in calls] == ["all_reduce"] * (1 + 2 * LAYERS) + ["all_gather"]
    assert {b for k, b in calls if k == "all_reduce"} == {TOKENS * H * 4}  # float32 hidden states
    sent = sum(2 * (TP - 1) / TP * b if k == "all_reduce" else (TP - 1) * b for k, b in calls)
    config = dict(model_type="llama", hidden_size=H, intermediate_size=INTER, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=2, head_dim=HEAD_DIM, vocab_size=VOCAB,
                  torch_dtype="float32")
    gpu = get_gpu("h100")
    plan = plan_model(build_spec(load_config(write_config(tmp_path, config))),
                      PlanRequest(gpus=TP, gpu=gpu, interconnect=parse_interconnect(None, gpu), context=64,
                                  max_num_seqs=TOKENS, dtype="float32"))
    tp2 = next(p for p in plan.layouts if p.tp == TP)
    assert tp2.decode_batch == TOKENS
    assert tp2.decode_comm_bytes_per_token == pytest.approx(sent / TOKENS, rel=1e-12)


def _worker4(rank: int, port: int, tp: int, out_dir: str) -> None:
    """World of 4: TP groups of ``tp`` consecutive ranks; checks the groups and a QKV/row pair."""
    torch.set_num_threads(1)
    ps.init_distributed(rank, 4, init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
    state = ps.init_parallel(tp)
    try:
        summed = ps.tp_all_reduce(torch.tensor([float(rank)]))  # the sum of this TP group's ranks
        g = torch.Generator().manual_seed(0)
        x = torch.randn(TOKENS, H, generator=g)
        q, k, v = (torch.randn(n * HEAD_DIM, H, generator=g) for n in (HEADS, 2, 2))
        qkv = QKVParallelLinear(H, HEAD_DIM, HEADS, 2)  # TP 4 > 2 KV heads: ranks 0,1 hold head 0; 2,3 head 1
        for i, t in enumerate((q, k, v)):
            qkv.load_shard(i, t)
        lq, lk, _ = qkv(x).split(qkv.local_sizes, dim=-1)
        hq = HEADS // tp
        kv_head = state.tp_rank * hq // (HEADS // 2)
        o_w = torch.randn(H, HEADS * HEAD_DIM, generator=g)
        o = RowParallelLinear(HEADS * HEAD_DIM, H)
        o.load_full(o_w)
        full_q = F.linear(x, q)
        result = {
            "group_sum": summed.item(), "tp_rank": state.tp_rank, "dp_rank": state.dp_rank,
            "kv_head": kv_head, "qkv": _exact(lq, full_q[:, state.tp_rank * hq * HEAD_DIM:][:, : hq * HEAD_DIM])
            and _exact(lk, F.linear(x, k[kv_head * HEAD_DIM : (kv_head + 1) * HEAD_DIM])),
            "row": _close(o(lq), F.linear(full_q, o_w)),
        }
    finally:
        ps.destroy_parallel()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_four_processes(tmp_path, tp):
    """4 gloo processes (slow: four interpreters on a 2-core machine): TP2 x DP2 and TP4 groups."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker4, args=(port, tp, str(tmp_path)), nprocs=4, join=True)
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for rank, r in enumerate(res):
        group = range(rank // tp * tp, rank // tp * tp + tp)
        assert r["group_sum"] == sum(group)
        assert (r["tp_rank"], r["dp_rank"]) == (rank % tp, rank // tp)
        assert r["qkv"] is True and r["row"] is True, r
    if tp == 4:
        assert [r["kv_head"] for r in res] == [0, 0, 1, 1]
