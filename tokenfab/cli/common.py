"""Options shared by the offline commands (generate, chat)."""

from __future__ import annotations

import argparse

from tokenfab.engine.args import EngineArgs
from tokenfab.engine.requests.sampling_params import SamplingParams


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int = 128) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, seed=args.sample_seed, repetition_penalty=args.repetition_penalty, stop=args.stop,
    )


def add_engine_args(p: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(p, with_model=False)
    p.add_argument("--model", default=None, help="HF directory or .gguf file (default: bundled model)")
