"""`tokenfab chat`: an interactive conversation that streams tokens as they are generated."""

from __future__ import annotations

import argparse
import sys

from tokenfab.cli.common import add_engine_args, add_sampling_args, sampling_from_args
from tokenfab.engine.args import EngineArgs


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--system", default=None, help="system prompt")
    add_sampling_args(p, max_tokens=512)
    add_engine_args(p)


def run(args: argparse.Namespace) -> int:
    from tokenfab.engine.llm import LLM

    llm = LLM(**vars(EngineArgs.from_cli_args(args)))
    engine = llm.engine
    params = sampling_from_args(args)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print(f"tokenfab chat with {engine.model_name}. Empty line or Ctrl-D to quit; /reset clears history.")
    turn = 0
    while True:
        try:
            user = input("> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if not user.strip():
            return 0
        if user.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        messages.append({"role": "user", "content": user})
        ids = llm.apply_chat_template(messages)
        rid = f"chat-{turn}"
        turn += 1
        engine.add_request(rid, ids, params)
        reply = ""
        while engine.has_unfinished_requests():
            for out in engine.step():
                delta = out.outputs[0].delta_text
                reply += delta
                sys.stdout.write(delta)
                sys.stdout.flush()
        print()
        messages.append({"role": "assistant", "content": reply})
