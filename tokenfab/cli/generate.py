"""`tokenfab generate`: complete one or more prompts (from --prompt or a file, one per line)."""

from __future__ import annotations

import argparse
import json
import sys

from tokenfab.cli.common import add_engine_args, add_sampling_args, sampling_from_args
from tokenfab.engine.args import EngineArgs


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", action="append", default=None, help="prompt text (repeatable)")
    p.add_argument("--prompts-file", default=None, help="file with one prompt per line ('-' = stdin)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template as a user turn")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    add_sampling_args(p)
    add_engine_args(p)


def run(args: argparse.Namespace) -> int:
    prompts = list(args.prompt or [])
    if args.prompts_file:
        fh = sys.stdin if args.prompts_file == "-" else open(args.prompts_file, encoding="utf-8")
        with fh:
            prompts += [line.rstrip("\n") for line in fh if line.strip()]
    if not prompts:
        print("tokenfab generate: give --prompt TEXT or --prompts-file FILE", file=sys.stderr)
        return 2
    from tokenfab.engine.llm import LLM

    llm = LLM(**vars(EngineArgs.from_cli_args(args)))
    params = sampling_from_args(args)
    if args.chat:
        inputs = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    else:
        inputs = prompts
    outputs = llm.generate(inputs, params, use_tqdm=len(prompts) > 1)
    for prompt, out in zip(prompts, outputs):
        c = out.outputs[0]
        if args.json:
            print(json.dumps({"prompt": prompt, "text": c.text, "token_ids": c.token_ids,
                              "finish_reason": c.finish_reason}))
        else:
            print(f"{prompt}{c.text}" if not args.chat else c.text)
            if len(prompts) > 1:
                print("-" * 40)
    return 0
