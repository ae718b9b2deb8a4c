"""`tokenfab bench spec`: speculative decoding on vs off, same engine, same run.

Two workloads through the chat template, greedy (so both sides must give the same tokens; the
report says whether they did):

- input-grounded: "rewrite this passage, fixing its typos" with the passage in the prompt (the
  output copies long spans of the input: where prompt lookup pays);
- open-ended chat: short questions whose answers are not in the prompt.

At batch 1 and 16 (``--batch-sizes``), each case runs speculation off and on in interleaved rounds
(``--rounds``; the best round counts: these machines are shared), and reports output tokens/s, the
ratio on/off, the acceptance rate and mean accepted length, and draft / verify time.

Every method of ``--speculative-config`` runs ("ngram", "suffix", "draft_model", "eagle3", "mtp").
"Off" is the same engine with its speculative decoder detached. A draft model / head keeps its
cache in step with the target's only while attached, so for those methods the engine runs without
prefix caching (both sides: an "on" round would otherwise reuse blocks whose draft K/V an "off"
round never wrote).
"""

from __future__ import annotations

import argparse
import time

from tokenfab.bench.common import git_commit, git_dirty, load_average, machine, markdown_table, write_json

PASSAGES = [
    "The old lighthouse stood at the edge of the cliff for more then two hundred years. Every night its "
    "keeper climbed the narow stairs, trimmed the wick and watched the ships pass safely around the rocks.",
    "Our team met on Tuesday to review the quarterly results. Revenue grew by twelve percent, but costs "
    "rose faster then expected, mainly becuase of higher shipping prices and two new hires in support.",
    "To make bread, mix flour, water, salt and yeast in a large bowl. Knead the dough for ten minuts, let "
    "it rise for an hour, shape it into a loaf and bake it at two hundred degres for forty minutes.",
    "The library will be closed on Monday for maintenence. Books due that day may be returned on Tuesday "
    "without a fine, and the online catalogue will remain avaliable throughout the closure.",
    "Photosynthesis lets plants turn sunlight, water and carbon dioxide into sugar and oxygen. It takes "
    "place mostly in the leaves, inside small structures called chloroplasts, wich contain chlorophyll.",
    "The city council aproved a new plan for the river park. It adds a bike path, more trees, two "
    "playgrounds and a small cafe, and the work should be finished before the end of next summer.",
    "Please remember to lock the back door when you leave the office. The alarm code has changed; ask "
    "the front desk for the new one, and do not write it down or share it by email with anyone.",
    "Mount Everest is the highest mountain above sea level. Its summit is on the border betwen Nepal "
    "and China, and climbers usualy need several weeks to get used to the thin air before the ascent.",
]
QUESTIONS = [
    "What are three good habits for staying healthy?", "Tell me a short story about a brave cat.",
    "Why is the sky blue?", "Give me some tips for learning a new language.",
    "What should I pack for a weekend camping trip?", "Describe your ideal weekend.",
    "How do airplanes stay in the air?", "Write a short poem about the sea.",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None)
    p.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 4}',
                   help='vLLM\'s JSON, e.g. \'{"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}\'')
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2, help="interleaved off/on rounds; the best counts")
    p.add_argument("--workloads", default="grounded,chat")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--json", default=None)


def _prompts(llm, workload: str, batch: int) -> list[list[int]]:
    if workload == "grounded":
        texts = [f"Rewrite the following passage, fixing its spelling mistakes. Reply with the passage only.\n\n{p}"
                 for p in PASSAGES]
    else:
        texts = QUESTIONS
    return [llm.apply_chat_template([{"role": "user", "content": texts[i % len(texts)]}]) for i in range(batch)]


def _timed(llm, prompts, params, spec) -> tuple[float, list[list[int]], dict]:
    eng = llm.engine
    eng.spec = spec
    before = eng.get_stats()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    after = eng.get_stats()
    delta = {k: getattr(after, k) - getattr(before, k) for k in
             ("spec_draft_tokens_total", "spec_accepted_tokens_total", "spec_verified_total",
              "spec_draft_seconds_total", "spec_verify_seconds_total")}
    return dt, [list(o.outputs[0].token_ids) for o in outs], delta


def run(args: argparse.Namespace) -> int:
    from tokenfab import LLM, SamplingParams
    from tokenfab.speculative.config import SpeculativeConfig

    cfg = SpeculativeConfig.parse(args.speculative_config)
    model_based = cfg is not None and cfg.method in ("draft_model", "eagle3", "mtp")
    llm = LLM(args.model, dtype=args.dtype, device=args.device, speculative_config=args.speculative_config,
              enable_prefix_caching=not model_based)
    spec = llm.engine.spec
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    _timed(llm, _prompts(llm, "chat", 2), SamplingParams(temperature=0, max_tokens=8), None)  # warm up
    report = {"benchmark": "spec", "machine": machine(), "commit": git_commit(), "dirty": git_dirty(),
              "load_average_start": load_average(), "model": args.model or "bundled",
              "speculative_config": args.speculative_config, "max_tokens": args.max_tokens,
              "prefix_caching": not model_based, "results": []}
    rows = []
    for workload in args.workloads.split(","):
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            prompts = _prompts(llm, workload, batch)
            best = {"off": None, "on": None}
            outputs, stats = {}, {}
            for _ in range(args.rounds):
                for mode in ("off", "on"):
                    dt, toks, delta = _timed(llm, prompts, params, spec if mode == "on" else None)
                    if best[mode] is None or dt < best[mode]:
                        best[mode], stats[mode] = dt, delta
                    outputs[mode] = toks
            n_tok = sum(len(t) for t in outputs["off"])
            d = stats["on"]
            r = {
                "workload": workload, "batch": batch, "output_tokens": n_tok,
                "tok_s_off": n_tok / best["off"], "tok_s_on": sum(len(t) for t in outputs["on"]) / best["on"],
                "acceptance_rate": d["spec_accepted_tokens_total"] / max(d["spec_draft_tokens_total"], 1),
                "mean_accepted_length": (1 + d["spec_accepted_tokens_total"] / d["spec_verified_total"]
                                         if d["spec_verified_total"] else 0.0),
                "draft_s": d["spec_draft_seconds_total"], "verify_s": d["spec_verify_seconds_total"],
                "identical": outputs["on"] == outputs["off"],
            }
            r["ratio"] = r["tok_s_on"] / r["tok_s_off"]
            report["results"].append(r)
            rows.append([workload, batch, r["tok_s_off"], r["tok_s_on"], r["ratio"], r["acceptance_rate"],
                         r["mean_accepted_length"], r["draft_s"], r["verify_s"], "yes" if r["identical"] else "NO"])
            print(rows[-1], flush=True)
    report["load_average_end"] = load_average()
    print(f"speculative decoding {args.speculative_config}, greedy, {args.max_tokens} max tokens, best of "
          f"{args.rounds} interleaved rounds; load average {report['load_average_start']} -> "
          f"{report['load_average_end']}")
    print(markdown_table(["workload", "batch", "tok/s off", "tok/s on", "on/off", "acceptance", "accepted len",
                          "draft s", "verify s", "identical"], rows))
    write_json(args.json, report)
    return 0
