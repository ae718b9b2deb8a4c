"""The Markdown report of `tokenfab bench cpu` (from the JSON report's dict)."""

from __future__ import annotations

from typing import Any

from tokenfab.bench.common import markdown_table


def _pct(x: float | None, bound: float | None) -> str:
    return f"{100 * x / bound:.0f}%" if x and bound else "-"


def _num(x: float | None) -> str:
    return f"{x:.1f}" if isinstance(x, float) else "-"


def _workload_rows(r: dict[str, Any]) -> list[list[Any]]:
    ours, llama, b = r["tokenfab"], r["llama_cpp"], r["roofline_bounds"]
    lb = llama.get("llama_bench", {}).get("results", {})
    bb = {int(x["B"]): x for x in llama.get("batched_bench", {}).get("rows", [])}
    rows = []
    for key, tool in (("prefill", "llama-bench"), ("decode", "llama-bench")):
        name = ours[key]["workload"]
        peer = lb.get(name, {}).get("tok_s")
        rows.append([f"{name} ({key})", tool, _num(ours[key]["tok_s"]), _num(peer),
                     f"{ours[key]['tok_s'] / peer:.2f}x" if peer else "-", _num(b.get(name)),
                     _pct(ours[key]["tok_s"], b.get(name)), _pct(peer, b.get(name))])
    for row in ours["batched"]:
        peer = bb.get(row["batch"], {}).get("S_TG t/s")
        bound = b.get(row["workload"])
        rows.append([f"{row['workload']} (batched decode)", "llama-batched-bench S_TG", _num(row["tok_s"]),
                     _num(peer), f"{row['tok_s'] / peer:.2f}x" if peer else "-", _num(bound),
                     _pct(row["tok_s"], bound), _pct(peer, bound)])
    return rows


def _roofline_lines(r: dict[str, Any]) -> list[str]:
    roof, w = r["roofline"], r["roofline"]["model"]
    lines = [f"- memory: {roof['copy']['gb_s']:.1f} GB/s ({roof['copy']['what']}, {roof['copy']['threads']} threads)",
             f"- FMA proxy: {roof['fp32_matmul']['gflop_s']:.1f} GFLOP/s ({roof['fp32_matmul']['what']})"]
    if roof.get("int8_matmul"):
        lines.append(f"- int8 proxy: {roof['int8_matmul']['gop_s']:.1f} GOP/s ({roof['int8_matmul']['what']})")
    else:
        lines.append("- int8 proxy: none (this torch has no CPU int8 matmul)")
    types = ", ".join(f"{k} x{v}" for k, v in sorted(w["tensor_types"].items()))
    lines += [f"- model: {w['weight_bytes'] / 1e6:.1f} MB of tensors ({types}), {w['parameters'] / 1e6:.1f} M "
              "parameters; every byte is read per decode step (embedding tied to the output head)",
              "- bounds: decode at B sequences <= min(B x bandwidth / weight bytes, peak / (2 x parameters)); "
              "prefill <= peak / (2 x parameters) (attention and KV reads left out); peak: the FMA proxy, the "
              "int8 proxy for an int8-activation run (gguf-q8act)"]
    return lines


def markdown(r: dict[str, Any]) -> str:
    m, llama, hf = r["machine"], r["llama_cpp"], r["transformers"]
    flags = ", ".join(f"{k}{'' if v else ' (no)'}" for k, v in r["isa_flags"].items())
    lb, ll = r["load_average_before"], r["load_average_after"]
    out = [f"# tokenfab bench cpu: {r['isa_tag']}", "",
           f"{m.get('lscpu_model_name') or m.get('cpu')}, {m['cpus']} CPUs, {r['threads']} threads for every engine; "
           f"commit {r['commit']}{' (checkout had uncommitted changes)' if r['uncommitted_changes'] else ''}; "
           f"started {r['started']}; load average (1/5/15 min) before {lb}, after {ll}; model {r['model']}", "",
           f"ISA flags: {flags}", "",
           "Environment (every engine of the run inherits it): "
           + (", ".join(f"{a}={b}" for a, b in m.get("env", {}).items()) or "none set"), ""]
    k = r["kernels"]
    g = k.get("ggml", {})
    out.append("tokenfab's native kernels: " + ", ".join(f"{n}={k[n]}" for n in k if n not in ("ggml",)) +
               f"; GGML family: isa={g.get('isa')}, vnni={g.get('vnni')}, amx={g.get('amx')} ({g.get('amx_reason')}), "
               f"q8 path={g.get('q8_path')} ({g.get('q8_reason')})")
    out += ["", "## Workloads (tokens/s)", ""]
    if "skipped" in llama:
        out += [f"llama.cpp: skipped ({llama['skipped']})", ""]
    else:
        out += ["The llama.cpp tools time `llama_decode` alone (random tokens, no sampling, no detokenizing); "
                "tokenfab's figures go through the LLM API (scheduler, greedy sampler, detokenizer, outputs).", ""]
    out.append(markdown_table(["workload", "llama.cpp tool", "tokenfab", "llama.cpp", "tokenfab / llama.cpp",
                               "roofline bound", "tokenfab % of bound", "llama.cpp % of bound"], _workload_rows(r)))
    biggest = r["tokenfab"]["batched"][-1]
    out += ["", "## transformers", ""]
    if "best" in hf:
        runs = ", ".join(f"{x['engine']}: {x['output_tok_s']:.1f}" for x in hf["runs"])
        out.append(f"End to end on the {biggest['workload']} prompts, output tokens/s (prefill included): tokenfab "
                   f"{biggest['e2e_output_tok_s']:.1f}, transformers {runs}; best {hf['best']['engine']}.")
    else:
        out.append(f"skipped ({hf['skipped']})")
    out += ["", "## Ratios (tokenfab / peer)", ""]
    out += [f"- {name}: {v:.2f}x" for name, v in r["ratios"].items()] or ["- none (no peer ran)"]
    out += ["", "## Roofline (measured in this run)", "", *_roofline_lines(r), "", "## Settings", ""]
    out.append("- tokenfab: " + ", ".join(f"{a}={b}" for a, b in r["tokenfab"]["settings"].items()) +
               "; " + "; ".join(f"{x['workload']}: {x['timing']}" for x in (r["tokenfab"]["prefill"],
                                                                          r["tokenfab"]["decode"])))
    if "settings" in llama:
        s = llama["settings"]
        out += [f"- llama.cpp: {s.get('source')}, {s.get('version')}; cmake {s.get('cmake_args')}",
                f"- `{llama['llama_bench']['command']}`", f"- `{llama['batched_bench']['command']}`",
                f"- llama-batched-bench: {llama['batched_bench']['settings_line']}"]
    if "best" in hf:
        out.append("- transformers: " + ", ".join(f"{a}={b}" for a, b in hf["best"]["settings"].items()))
    return "\n".join(out)
