"""Fuzz a live tokenfab server on the bundled model with schemathesis, for longer than the suite does.

    .venv/bin/python scripts/fuzz_server.py --examples 150 [--json out.json]

Starts the server in process on a free port, runs schemathesis over its OpenAPI document (every
operation, schema-valid and schema-violating requests, ``--examples`` each; conformance checks, no
5xx, an OpenAI error body on every 4xx; see tests/server/fuzzing.py), then checks that greedy
output is still what ``LLM.generate`` gives. Prints the counts (requests, statuses, 5xx) as JSON;
exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=150, help="examples per operation and mode")
    parser.add_argument("--seed", type=int, default=0, help="0: derandomized (same run every time)")
    parser.add_argument("--json", dest="json_out", default=None)
    args = parser.parse_args()

    import httpx
    import schemathesis

    from tests.server.conftest import GREEDY_MAX_TOKENS, GREEDY_PROMPTS, MAX_MODEL_LEN, LiveServer
    from tests.server.fuzzing import run_schemathesis
    from tokenfab import LLM, SamplingParams
    from tokenfab.engine.core.async_engine import AsyncEngine
    from tokenfab.server.app import ServerConfig, build_app

    llm = LLM(max_model_len=MAX_MODEL_LEN)
    greedy = SamplingParams(temperature=0.0, max_tokens=GREEDY_MAX_TOKENS)
    expected = [o.outputs[0].text for o in llm.generate(GREEDY_PROMPTS, greedy)]
    server = LiveServer(build_app(AsyncEngine(llm.engine), ServerConfig(max_waiting=512, drain_timeout=5)))
    try:
        schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
        report = run_schemathesis(schema, max_examples=args.examples, seed=args.seed, cap_generation=4,
                                  timeout=300)
        after = [httpx.post(f"{server.url}/v1/completions", timeout=300, json={
            "prompt": p, "max_tokens": GREEDY_MAX_TOKENS, "temperature": 0}).json()["choices"][0]["text"]
            for p in GREEDY_PROMPTS]
    finally:
        server.stop()
    result = {**report.as_dict(), "examples_per_operation_and_mode": args.examples,
              "greedy_unchanged_after": after == expected}
    print(json.dumps(result, indent=2))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if report.server_errors == 0 and not report.failures and after == expected else 1


if __name__ == "__main__":
    sys.exit(main())
