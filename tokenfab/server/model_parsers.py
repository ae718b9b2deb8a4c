"""Which tool-call and reasoning parser a server uses: the ``--tool-call-parser``/``--reasoning-parser`` flags,
else the model's type (its in-process config, or the model folder's ``config.json`` when the engine runs in its
own process)."""

from __future__ import annotations

import functools
import json
import os
from typing import Any

from tokenfab.server.chat_tools import DEFAULT_TOOL_PARSER
from tokenfab.server.reasoning import reasoning_parser_for_model
from tokenfab.server.serving import OpenAIServer
from tokenfab.server.tools import tool_parser_for_model


@functools.lru_cache(maxsize=8)
def _model_config(path: str) -> dict[str, Any]:
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def parser_names(server: OpenAIServer) -> tuple[str | None, str | None]:
    """(tool parser, reasoning parser) for ``server`` (or anything with its ``engine``, ``tokenizer`` and
    ``config``): ``--tool-call-parser``/``--reasoning-parser`` when set
    (``ServerConfig.tool_call_parser``/``reasoning_parser``), else by the model's type."""
    cfg = getattr(getattr(server.engine, "engine", None), "config", None)
    if cfg is None:  # the engine runs in its own process: read the model folder's config.json
        cfg = _model_config(str(getattr(server.tokenizer, "name_or_path", "") or ""))
    get = cfg.get if isinstance(cfg, dict) else (lambda key, default=None: getattr(cfg, key, default))
    model_type, archs = get("model_type"), get("architectures")
    template = getattr(server.tokenizer, "chat_template", None)
    template = template if isinstance(template, str) else ""
    # a template without a tool format (the bundled SmolLM2): Hermes, the most common trained-in format
    by_model = tool_parser_for_model(model_type, archs, template) if "tool" in template else None
    tool = getattr(server.config, "tool_call_parser", None) or by_model or DEFAULT_TOOL_PARSER
    reasoning = getattr(server.config, "reasoning_parser", None) or reasoning_parser_for_model(model_type, archs)
    return tool, reasoning
