"""Per-family weight inventories for ``tokenfab plan`` (see ``model_spec``): the same tensors, shapes and
biases as the Hugging Face modules of each architecture, named as in the checkpoints."""

from __future__ import annotations

from tokenfab.planner.hardware import PlanInputError
from tokenfab.planner.spec_types import AttentionShape, ConfigReader, ModelSpec, Weight


def _vec(name: str, n: int, kind: str = "rep") -> Weight:
    return Weight(name, n, 1, kind, linear=False, quantizable=False)


def _linear(out: list[Weight], name: str, rows: int, cols: int, kind: str, bias: bool = False,
            bias_kind: str | None = None) -> None:
    out.append(Weight(f"{name}.weight", rows, cols, kind))
    if bias:
        out.append(_vec(f"{name}.bias", rows, bias_kind or ("rep" if kind == "row" else kind)))


def _gated_mlp(out: list[Weight], prefix: str, hidden: int, inter: int, bias: bool = False) -> None:
    _linear(out, f"{prefix}.gate_proj", inter, hidden, "col", bias)
    _linear(out, f"{prefix}.up_proj", inter, hidden, "col", bias)
    _linear(out, f"{prefix}.down_proj", hidden, inter, "row", bias)


def _experts(out: list[Weight], prefix: str, names: tuple[str, str, str], hidden: int, inter: int,
             n: int) -> None:
    gate, up, down = names
    out.append(Weight(f"{prefix}.0.{gate}.weight", inter, hidden, "ecol", experts=n))
    out.append(Weight(f"{prefix}.0.{up}.weight", inter, hidden, "ecol", experts=n))
    out.append(Weight(f"{prefix}.0.{down}.weight", hidden, inter, "erow", experts=n))


def _gqa(out: list[Weight], p: str, c: ConfigReader, hidden: int, heads: int, kv: int, hd: int, qkv_bias: bool,
         o_bias: bool, qk_norm: bool) -> None:
    _linear(out, f"{p}.q_proj", heads * hd, hidden, "col", qkv_bias)
    _linear(out, f"{p}.k_proj", kv * hd, hidden, "kv", qkv_bias)
    _linear(out, f"{p}.v_proj", kv * hd, hidden, "kv", qkv_bias)
    _linear(out, f"{p}.o_proj", hidden, heads * hd, "row", o_bias)
    if qk_norm:
        out += [_vec(f"{p}.q_norm.weight", hd), _vec(f"{p}.k_norm.weight", hd)]


def _mla(out: list[Weight], p: str, c: ConfigReader, hidden: int, heads: int, dsa_indexer: bool) -> None:
    q_lora, r = c.opt_int("q_lora_rank"), c.int("kv_lora_rank")
    nope, rope, v = c.int("qk_nope_head_dim"), c.int("qk_rope_head_dim"), c.int("v_head_dim")
    bias = c.flag("attention_bias")
    if q_lora:
        _linear(out, f"{p}.q_a_proj", q_lora, hidden, "rep", bias)
        out.append(_vec(f"{p}.q_a_layernorm.weight", q_lora))
        _linear(out, f"{p}.q_b_proj", heads * (nope + rope), q_lora, "col")
    else:
        _linear(out, f"{p}.q_proj", heads * (nope + rope), hidden, "col")
    _linear(out, f"{p}.kv_a_proj_with_mqa", r + rope, hidden, "rep", bias)
    out.append(_vec(f"{p}.kv_a_layernorm.weight", r))
    _linear(out, f"{p}.kv_b_proj", heads * (nope + v), r, "col")
    _linear(out, f"{p}.o_proj", hidden, heads * v, "row", bias)
    if dsa_indexer:
        if not q_lora:
            raise PlanInputError("config.json: DSA needs q_lora_rank")
        ih, idim = c.int("index_n_heads"), c.int("index_head_dim")
        _linear(out, f"{p}.indexer.wq_b", ih * idim, q_lora, "rep")
        _linear(out, f"{p}.indexer.wk", idim, hidden, "rep")
        out += [_vec(f"{p}.indexer.k_norm.weight", idim), _vec(f"{p}.indexer.k_norm.bias", idim)]
        _linear(out, f"{p}.indexer.weights_proj", ih, hidden, "rep")


def _layer_types(c: ConfigReader, key: str, n: int, default: list[str]) -> list[str]:
    types = c.d.get(key) or default
    if not isinstance(types, list) or len(types) != n:
        raise PlanInputError(f"config.json: {key!r} must list one entry per layer ({n})")
    return [str(t) for t in types]


def build(model_type: str, c: ConfigReader) -> ModelSpec:
    hidden, n_layers, vocab = c.int("hidden_size"), c.int("num_hidden_layers"), c.int("vocab_size")
    heads = c.int("num_attention_heads")
    w: list[Weight] = [Weight("model.embed_tokens.weight", vocab, hidden, "vocab", linear=False, quantizable=False)]
    inters: list[int] = []
    n_experts = top_k = moe_layers = mtp = 0
    deepseek = model_type in ("deepseek_v3", "kimi_k2", "deepseek_v32", "glm_moe_dsa")
    if deepseek:
        dsa = model_type in ("deepseek_v32", "glm_moe_dsa")
        r, rope = c.int("kv_lora_rank"), c.int("qk_rope_head_dim")
        attn = AttentionShape("dsa" if dsa else "mla", heads, 1, c.int("qk_nope_head_dim") + rope,
                              c.int("v_head_dim"), r, rope,
                              c.int("index_head_dim") if dsa else 0, c.int("index_n_heads") if dsa else 0,
                              c.int("index_topk") if dsa else 0)
        first_dense = c.int("first_k_dense_replace", 0, minimum=0)
        mlp_types = _layer_types(c, "mlp_layer_types", n_layers,
                                 ["dense" if i < first_dense else "sparse" for i in range(n_layers)])
        idx_types = _layer_types(c, "indexer_types", n_layers, ["full"] * n_layers)
        n_experts, top_k = c.int("n_routed_experts"), c.int("num_experts_per_tok")
        moe_inter, n_shared = c.int("moe_intermediate_size"), c.int("n_shared_experts", 0, minimum=0)
        layer_sizes: list[int] = []
        for i in range(n_layers + c.int("num_nextn_predict_layers", 0, minimum=0)):
            start = len(w)
            p = f"model.layers.{i}"
            _mla(w, f"{p}.self_attn", c, hidden, heads, dsa and idx_types[min(i, n_layers - 1)] == "full")
            if mlp_types[min(i, n_layers - 1)] == "dense":
                inters.append(c.int("intermediate_size"))
                _gated_mlp(w, f"{p}.mlp", hidden, inters[-1])
            else:
                moe_layers += i < n_layers
                w.append(Weight(f"{p}.mlp.gate.weight", n_experts, hidden, "rep", quantizable=False))
                _experts(w, f"{p}.mlp.experts", ("gate_proj", "up_proj", "down_proj"), hidden, moe_inter, n_experts)
                inters.append(moe_inter)
                if n_shared:
                    _gated_mlp(w, f"{p}.mlp.shared_experts", hidden, moe_inter * n_shared)
            w += [_vec(f"{p}.input_layernorm.weight", hidden), _vec(f"{p}.post_attention_layernorm.weight", hidden)]
            layer_sizes.append(sum(x.numel for x in w[start:]))
            if i >= n_layers:  # multi-token prediction: its own norms and the eh projection
                mtp += layer_sizes[-1] + 3 * hidden + 2 * hidden * hidden
                del w[start:]
    else:
        kv = c.int("num_key_value_heads", heads)
        hd = c.int("head_dim", hidden // heads) if c.d.get("head_dim") is not None else hidden // heads
        attn = AttentionShape("gqa", heads, kv, hd, hd, sliding_window=c.d.get("sliding_window") or 0)
        qwen2 = model_type in ("qwen2", "qwen2_moe")
        gpt_oss = model_type == "gpt_oss"
        attn_bias = c.flag("attention_bias", default=gpt_oss)
        for i in range(n_layers):
            p = f"model.layers.{i}"
            _gqa(w, f"{p}.self_attn", c, hidden, heads, kv, hd, qkv_bias=qwen2 or attn_bias,
                 o_bias=attn_bias and not qwen2, qk_norm=model_type in ("qwen3", "qwen3_moe"))
            if gpt_oss:
                w.append(_vec(f"{p}.self_attn.sinks", heads, "head"))
            is_moe = False
            if model_type in ("qwen2_moe", "qwen3_moe"):
                key = "num_experts" if c.d.get("num_experts") is not None else "num_local_experts"
                n_experts = c.int(key, 0, minimum=0)  # transformers v5 writes num_local_experts
                step = c.int("decoder_sparse_step", 1)
                is_moe = n_experts > 0 and i not in (c.d.get("mlp_only_layers") or []) and (i + 1) % step == 0
            elif model_type in ("mixtral", "gpt_oss"):
                n_experts, is_moe = c.int("num_local_experts"), True
            if is_moe:
                moe_layers += 1
                top_k = c.int("num_experts_per_tok")
                if model_type == "gpt_oss":
                    inter = c.int("intermediate_size")
                    m = f"{p}.mlp"
                    w += [Weight(f"{m}.router.weight", n_experts, hidden, "rep", quantizable=False),
                          _vec(f"{m}.router.bias", n_experts),
                          Weight(f"{m}.experts.gate_up_proj", 2 * inter, hidden, "ecol", experts=n_experts),
                          Weight(f"{m}.experts.gate_up_proj_bias", 2 * inter, 1, "ecol", False, n_experts,
                                 quantizable=False),
                          Weight(f"{m}.experts.down_proj", hidden, inter, "erow", experts=n_experts),
                          Weight(f"{m}.experts.down_proj_bias", hidden, 1, "erep", False, n_experts,
                                 quantizable=False)]
                elif model_type == "mixtral":
                    inter = c.int("intermediate_size")
                    w.append(Weight(f"{p}.block_sparse_moe.gate.weight", n_experts, hidden, "rep", quantizable=False))
                    _experts(w, f"{p}.block_sparse_moe.experts", ("w1", "w3", "w2"), hidden, inter, n_experts)
                else:
                    inter = c.int("moe_intermediate_size")
                    w.append(Weight(f"{p}.mlp.gate.weight", n_experts, hidden, "rep", quantizable=False))
                    _experts(w, f"{p}.mlp.experts", ("gate_proj", "up_proj", "down_proj"), hidden, inter, n_experts)
                    shared = c.int("shared_expert_intermediate_size", 0, minimum=0) if qwen2 else 0
                    if shared:
                        _gated_mlp(w, f"{p}.mlp.shared_expert", hidden, shared)
                        w.append(Weight(f"{p}.mlp.shared_expert_gate.weight", 1, hidden, "rep", quantizable=False))
                        inters.append(shared)
                inters.append(inter)
            else:
                inters.append(c.int("intermediate_size"))
                _gated_mlp(w, f"{p}.mlp", hidden, inters[-1], bias=c.flag("mlp_bias"))
            w += [_vec(f"{p}.input_layernorm.weight", hidden), _vec(f"{p}.post_attention_layernorm.weight", hidden)]
    w.append(_vec("model.norm.weight", hidden))
    if not c.flag("tie_word_embeddings"):
        w.append(Weight("lm_head.weight", vocab, hidden, "vocab", per_seq=True, quantizable=False))
    return ModelSpec(model_type, "", hidden, n_layers, vocab, attn, w, n_experts if moe_layers else 0,
                     top_k if moe_layers else 0, moe_layers, mtp, intermediate_sizes=inters)
