"""A small fixed-format fine-tuning task, written by code (deterministic): the user asks for a word in capital
letters in one of several phrasings, and the assistant always answers exactly ``ANSWER: <WORD>``.

The base SmolLM2 answers these in free prose, so "greedy answers change to the taught format" is a sharp test;
train and eval use disjoint words, so the format (and the upper-casing) must generalise, not be memorised.

    python -m tests.train.task_dataset OUT_DIR   # writes OUT_DIR/train.jsonl and OUT_DIR/eval.jsonl
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

WORDS = """apple river stone cloud tiger garden window candle forest silver rocket planet bridge button
castle dragon engine feather guitar harbor island jacket kettle ladder marble needle orange pencil pepper
rabbit saddle tunnel violin wallet yellow zipper anchor basket carpet desert fabric goblet helmet insect
jungle kitten lemon magnet napkin oyster parrot quartz ribbon shovel ticket umbrella valley walrus
blanket cactus dolphin falcon glacier hammer iceberg lantern meadow nickel oxygen pillow puzzle
saucer thunder velvet whistle banana cherry donkey eagle ferret gravel hollow jigsaw koala lizard mango
nectar otter pirate quiver rocket salmon turnip unicorn vortex wizard yogurt zebra badger copper
dagger ember fossil goblin hazel ivory jasper kernel lobster mitten nutmeg orchid pebble raven sphinx
tulip""".split()
WORDS = list(dict.fromkeys(WORDS))  # unique, order kept

TRAIN_TEMPLATES = (
    "Write the word '{w}' in capital letters.",
    "Shout this word: {w}",
    "What is {w} in uppercase?",
)
EVAL_TEMPLATES = (
    "Please capitalize every letter of: {w}",
    "How do you write {w} in all caps?",
)
N_EVAL_WORDS = 20
ANSWER_RE = re.compile(r"^ANSWER: ([A-Z]+)$")


def record(word: str, template: str) -> dict:
    return {"messages": [
        {"role": "user", "content": template.format(w=word)},
        {"role": "assistant", "content": f"ANSWER: {word.upper()}"},
    ]}


def train_records() -> list[dict]:
    """Every train word in every train phrasing, interleaved (a few hundred records)."""
    words = WORDS[N_EVAL_WORDS:]
    return [record(w, t) for i, t in enumerate(TRAIN_TEMPLATES) for w in words[i:] + words[:i]]


def eval_records() -> list[dict]:
    """Held-out words in every phrasing (the train phrasings and two unseen ones)."""
    words = WORDS[:N_EVAL_WORDS]
    return [record(w, t) for t in TRAIN_TEMPLATES + EVAL_TEMPLATES for w in words]


def eval_prompts() -> list[tuple[list[dict], str]]:
    """(chat without the answer, expected word) for greedy checks, held-out words in unseen phrasings."""
    return [([{"role": "user", "content": t.format(w=w)}], w.upper())
            for t in EVAL_TEMPLATES for w in WORDS[:N_EVAL_WORDS]]


def follows_format(text: str) -> bool:
    return ANSWER_RE.match(text.strip()) is not None


def write_task_dataset(out_dir: str | Path) -> tuple[Path, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = out / "train.jsonl", out / "eval.jsonl"
    for path, records in zip(paths, (train_records(), eval_records())):
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return paths


if __name__ == "__main__":
    for p in write_task_dataset(sys.argv[1] if len(sys.argv) > 1 else "."):
        print(p)
