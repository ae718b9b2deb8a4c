"""Pydantic models of a ``/v1/responses`` request (OpenAI's Responses API, the subset we serve).

Like every request model here (``protocol.py``), unknown fields are refused with a 400 that names them. Input
items are told apart by ``type`` (a message may leave it out, as OpenAI allows); an item type we do not serve
(images, files, hosted tools) is a 400 listing the ones we do. Items this server itself returned
(``response.output``: messages with ``id``/``status``, ``output_text`` parts with ``annotations``, function
calls, reasoning items) are accepted back as input unchanged, so a client can chain turns by hand.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from tokenfab.server.protocol import INT32_MAX, FunctionDefinition, Int, JsonObject, Text, _Request

ItemStatus = Literal["in_progress", "completed", "incomplete"]
SUPPORTED_ITEMS = ("message", "function_call", "function_call_output", "reasoning")


class InputText(_Request):
    type: Literal["input_text"]
    text: Text


class OutputText(_Request):
    type: Literal["output_text"]
    text: Text
    annotations: list[dict[str, Any]] | None = Field(default=None, max_length=0,
                                                     description="accepted back empty (we never annotate)")
    logprobs: list[dict[str, Any]] | None = None


class Refusal(_Request):
    type: Literal["refusal"]
    refusal: Text


ContentPart = Annotated[InputText | OutputText | Refusal, Field(discriminator="type")]


class MessageItem(_Request):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | list[ContentPart] = Field(description="text, or input_text/output_text parts (no images)")
    id: Text | None = None
    status: ItemStatus | None = None
    phase: Literal["commentary", "final_answer"] | None = None


class FunctionCallItem(_Request):
    type: Literal["function_call"]
    call_id: Annotated[Text, Field(min_length=1, max_length=256)]
    name: Text
    arguments: Text = Field(description="the arguments as a JSON object's text")
    id: Text | None = None
    status: ItemStatus | None = None


class FunctionCallOutputItem(_Request):
    type: Literal["function_call_output"]
    call_id: Annotated[Text, Field(min_length=1, max_length=256)]
    output: Text | list[InputText]
    id: Text | None = None
    status: ItemStatus | None = None


class SummaryText(_Request):
    type: Literal["summary_text"]
    text: Text


class ReasoningText(_Request):
    type: Literal["reasoning_text"]
    text: Text


class ReasoningItem(_Request):
    """An earlier turn's reasoning: accepted, not put back into the prompt (as chat's ``reasoning_content``)."""

    type: Literal["reasoning"]
    id: Text | None = None
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: Text | None = None
    status: ItemStatus | None = None


def _item_type(value: Any) -> str | None:
    if isinstance(value, dict):
        kind = value.get("type", "message")
    else:
        kind = getattr(value, "type", None)
    return kind if kind in SUPPORTED_ITEMS else None


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type, custom_error_type="invalid_item_type",
                  custom_error_message=f"unsupported input item type; this server takes {', '.join(SUPPORTED_ITEMS)}"),
]


class FunctionTool(FunctionDefinition):
    """A function tool in the Responses API's flat shape: chat's FunctionDefinition without the ``function``
    wrapper."""

    type: Literal["function"]


class FunctionChoice(_Request):
    type: Literal["function"]
    name: Text


class TextFormat(_Request):
    """``text.format``: plain text, any JSON object, or JSON matching ``schema`` (grammar-enforced)."""

    type: Literal["text", "json_object", "json_schema"]
    name: Text | None = None
    description: Text | None = None
    json_schema: JsonObject | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Request):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = Field(default=None, description="accepted; not used")


class ReasoningConfig(_Request):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = Field(
        default=None, description="passed to the chat template as reasoning_effort (GPT-OSS: low/medium/high; "
        "minimal -> low, xhigh -> high); none switches thinking off (enable_thinking/thinking false)")
    summary: Literal["auto", "concise", "detailed"] | None = Field(
        default=None, description="accepted; reasoning comes back whole as reasoning_text content, no summary")


class StreamOptions(_Request):
    include_obfuscation: bool | None = Field(default=None, description="accepted; no obfuscation is sent")


class ResponsesRequest(_Request):
    model: Text | None = None
    input: Annotated[Text, Field(min_length=1)] | Annotated[list[InputItem], Field(min_length=1, max_length=4096)]
    instructions: Text | None = Field(default=None, description="a system message put first (not carried over "
                                      "by previous_response_id)")
    max_output_tokens: Int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    tools: list[FunctionTool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = Field(
        default=None, description="default: auto with tools, none without; required/named are grammar-enforced")
    parallel_tool_calls: bool = True
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    store: bool = Field(default=True, description="keep the response in this server's memory for "
                        "previous_response_id and GET (bounded: --responses-store-size, --responses-ttl)")
    previous_response_id: Text | None = None
    metadata: dict[Annotated[Text, Field(max_length=64)], Annotated[Text, Field(max_length=512)]] | None = Field(
        default=None, max_length=16)
    user: Text | None = Field(default=None, max_length=256, description="accepted; not used")
    safety_identifier: Text | None = Field(default=None, max_length=256, description="accepted; not used")
    stream: bool = False
    stream_options: StreamOptions | None = None
