"""`tokenfab run-batch -i in.jsonl -o out.jsonl [--model M] [engine args]`: an OpenAI batch input file run offline,
vLLM's flags. The same code as ``/v1/batches``: lines checked by ``validation.check_line`` (every line's ``url``
one of the batch endpoints), run by ``LineRunner`` through the online handlers over an in-process engine, written
as OpenAI output lines (a body the endpoint rejects: its 4xx status and error body) in input order."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from tokenfab.engine.args import EngineArgs
from tokenfab.server.batch.validation import ENDPOINTS, check_line, read_lines

# Only argparse and EngineArgs at import time (`tokenfab --help` imports every command's module); `run` imports
# the engine and the server modules it drives. Nothing imports this module back.


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-i", "--input-file", required=True, help="the batch input, OpenAI's JSONL format")
    parser.add_argument("-o", "--output-file", required=True, help="where the result lines are written")
    parser.add_argument("--model", default=None,
                        help="HF model directory or .gguf file (default: bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--max-concurrency", type=int, default=64, help="lines in the engine at once (default 64)")
    EngineArgs.add_cli_args(parser, with_model=False)


def check_file(path: Path) -> tuple[list[tuple[int, dict[str, Any]]], list[str]]:
    """The file's request lines, or the message of every bad one (by line number)."""
    lines: list[tuple[int, dict[str, Any]]] = []
    problems: list[str] = []
    seen: set[str] = set()
    for number, raw in read_lines(path):
        try:
            url = json.loads(raw).get("url")
        except (ValueError, AttributeError):
            url = None
        _, error = check_line(number, raw, url if url in ENDPOINTS else ENDPOINTS[0], seen)
        if error is not None:
            problems.append(error["message"])
        else:
            lines.append((number, json.loads(raw)))
    return lines, problems


async def run_lines(engine: Any, lines: list[tuple[int, dict[str, Any]]], concurrency: int) -> list[dict[str, Any]]:
    """Every line through ``LineRunner`` over ``engine`` (an ``AsyncEngine``, started here); results in input order."""
    from tokenfab.server.batch.dispatch import LineRunner
    from tokenfab.server.batch.results import result_line
    from tokenfab.server.serving import OpenAIServer

    engine.start()
    server = OpenAIServer(engine)
    runner = LineRunner(server)
    slots = asyncio.Semaphore(concurrency)

    async def one(line: dict[str, Any]) -> dict[str, Any]:
        async with slots:
            while True:
                status, body = await runner.run(line["url"], line["body"])
                if status != 429:
                    return result_line(line["custom_id"], status, body)
                await asyncio.sleep(0.1)

    try:
        return list(await asyncio.gather(*(one(line) for _, line in lines)))
    finally:
        server.close()
        await asyncio.to_thread(engine.shutdown, 5.0)


def run(args: argparse.Namespace) -> int:
    if args.max_concurrency < 1:
        print("tokenfab run-batch: --max-concurrency must be at least 1", file=sys.stderr)
        return 2
    try:
        lines, problems = check_file(Path(args.input_file))
    except OSError as e:
        print(f"tokenfab run-batch: cannot read {args.input_file}: {e}", file=sys.stderr)
        return 1
    if problems or not lines:
        for message in problems or ["the input file has no request lines"]:
            print(f"tokenfab run-batch: {message}", file=sys.stderr)
        return 1
    from tokenfab.engine.core.async_engine import AsyncEngine
    from tokenfab.engine.llm_engine import LLMEngine

    try:
        engine = AsyncEngine(LLMEngine(EngineArgs.from_cli_args(args)))
    except (FileNotFoundError, ValueError, OSError, RuntimeError) as e:
        print(f"tokenfab run-batch: cannot load the model: {e}", file=sys.stderr)
        return 1
    results = asyncio.run(run_lines(engine, lines, args.max_concurrency))
    with open(args.output_file, "w", encoding="utf-8") as out:
        for result in results:
            out.write(json.dumps(result, ensure_ascii=False) + "\n")
    failed = sum(r["response"]["status_code"] >= 400 for r in results)
    print(f"tokenfab run-batch: {len(results)} lines, {len(results) - failed} succeeded, {failed} failed -> "
          f"{args.output_file}")
    return 0
