"""Byte sizes on the command line: ``4GiB``, ``512MB``, ``1.5G``, ``1000000`` (no torch: the CLI imports this)."""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_bytes(text: str | int) -> int:
    """A size in bytes from an integer or a number with a unit (decimal kB/MB/GB/TB or K/M/G/T, binary
    KiB/MiB/GiB/TiB); ValueError naming the text otherwise."""
    if isinstance(text, int):
        n = text
    else:
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*", text)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(f"not a byte size: {text!r} (e.g. 4GiB, 512MB, 1000000)")
        n = int(float(m.group(1)) * _UNITS[unit])
    if n < 0:
        raise ValueError(f"a byte size must be >= 0, got {text!r}")
    return n


def gib_to_bytes(text: str) -> int:
    """vLLM's ``--kv-offloading-size``: GiB, a float."""
    return parse_bytes(f"{text}GiB")
