"""Pydantic models of the OpenAI API subset we serve (requests; responses are in ``responses.py``).

Every request model forbids unknown fields: a field we do not implement is a 400 that names it,
never silently ignored. The fields the fleet's routers add to every request are known, each with its own
decision (``router_fields.py``). Types are strict (``"5"`` is not an integer), floats finite, every integer
bounded to what the engine can hold, so the OpenAPI document is exactly what the server accepts.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

from tokenfab.server.router_fields import ChatRouterFields, RouterFields

INT32_MAX = 2**31 - 1
SEED_MAX = 2**63 - 1
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256  # per stop string
MAX_TOKEN_LIST = 1024  # stop_token_ids and logit_bias entries
MAX_LOGPROBS = 20


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _no_surrogates(value: str) -> str:
    """JSON may carry a lone UTF-16 surrogate ("\\ud800"); no tokenizer can encode it."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"the text is not valid Unicode: a lone surrogate at index {e.start}") from None
    return value


def check_text(value: Any) -> None:
    """Raise ValueError if any string inside ``value`` (nested lists/dicts too) is not valid Unicode."""
    if isinstance(value, str):
        _no_surrogates(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            check_text(k)
            check_text(v)
    elif isinstance(value, list):
        for v in value:
            check_text(v)


def _integral(value: Any) -> Any:
    """JSON Schema's "integer" includes 2.0; strict pydantic would not (and must still refuse "2")."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Int = Annotated[int, BeforeValidator(_integral)]
Text = Annotated[str, AfterValidator(_no_surrogates)]


def _checked_text(value: Any) -> Any:
    check_text(value)
    return value


# A JSON object from the client (a schema, a tool's parameters) whose strings must all be valid Unicode.
JsonObject = Annotated[dict[str, Any], AfterValidator(_checked_text)]
TokenId = Annotated[Int, Field(ge=0, le=INT32_MAX)]
StopString = Annotated[Text, Field(min_length=1, max_length=MAX_STOP_CHARS)]


NonEmptyText = Annotated[Text, Field(min_length=1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
# one text, several texts, one token-id prompt, several token-id prompts; none empty
Prompt = (NonEmptyText | Annotated[list[NonEmptyText], Field(min_length=1)] | TokenIds
          | Annotated[list[TokenIds], Field(min_length=1)])


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(default=False, description="vLLM extra: with include_usage, every "
                                         "chunk carries its choice's running usage")


class JsonSchemaFormat(_Request):
    name: Text = "response"
    description: Text | None = None
    # "schema" shadows a BaseModel attribute name in pydantic; keep it under an alias.
    json_schema: JsonObject | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingFields(_Request, RouterFields):
    model: Text | None = None
    n: Int = Field(default=1, ge=1, le=128)
    max_tokens: Int | None = Field(default=None, ge=1, le=INT32_MAX)
    stop: StopString | list[StopString] | None = Field(default=None, max_length=MAX_STOP_STRINGS)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: Int | None = Field(default=None, ge=0, le=SEED_MAX)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[Annotated[str, Field(pattern=r"^[0-9]{1,10}$")],
                     Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        default=None, max_length=MAX_TOKEN_LIST,
        description="token id (a decimal string) -> bias in [-100, 100] added to its logit")
    user: Text | None = Field(default=None, max_length=256,
                              description="an end-user id (accepted for compatibility; not used)")
    response_format: ResponseFormat | None = None
    # Extra sampling fields (vLLM names)
    top_k: Int | None = Field(default=None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=100.0)
    ignore_eos: bool = False
    min_tokens: Int = Field(default=0, ge=0, le=INT32_MAX)
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=MAX_TOKEN_LIST)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: Int = Field(default=0, ge=-INT32_MAX, le=INT32_MAX,
                          description="lower runs first; only with --scheduling-policy priority (else must be 0)")
    prompt_logprobs: Int | None = Field(default=None, ge=0, le=MAX_LOGPROBS,
                                        description="vLLM extra: logprobs of the prompt tokens, with k alternatives")
    cache_salt: Text | None = Field(default=None, min_length=1, max_length=256,
                                    description="requests with different salts never share prefix-cache blocks")
    speculative: bool = Field(default=True, description="tokenfab extra: false opts out of speculative decoding")

    def logit_bias_ids(self) -> dict[int, float] | None:
        return {int(k): float(v) for k, v in self.logit_bias.items()} if self.logit_bias else None


class CompletionRequest(_SamplingFields):
    prompt: Prompt
    # 0 is OpenAI's legacy "score the prompt": only with echo (the prompt is returned, nothing generated)
    max_tokens: Int | None = Field(default=None, ge=0, le=INT32_MAX)
    echo: bool = False
    logprobs: Int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    suffix: Text | None = Field(default=None, description="not supported: must be empty")
    best_of: Int | None = Field(default=None, ge=1, le=128, description="must equal n (no server-side ranking)")


class TextPart(_Request):
    type: Literal["text"]
    text: Text


class FunctionCall(_Request):
    name: Text
    arguments: Text = Field(description="the arguments as a JSON object's text")


class MessageToolCall(_Request):
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = Field(default=None, description="text, or text parts (no images)")
    name: Text | None = None
    tool_calls: list[MessageToolCall] | None = Field(default=None, max_length=128,
                                                     description="an assistant message's calls")
    tool_call_id: Text | None = Field(default=None, description="a tool message: the call it answers (required)")
    reasoning_content: Text | None = Field(default=None, description="an earlier assistant turn's reasoning "
                                           "(given to the chat template, which decides whether to render it; "
                                           "GPT-OSS: Harmony's analysis message)")
    reasoning: Text | None = Field(default=None, description="the same as reasoning_content (vLLM's newer name, "
                                   "as responses return it)")


class FunctionDefinition(_Request):
    name: Annotated[Text, Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]
    description: Text | None = None
    parameters: JsonObject | None = Field(default=None, description="a JSON schema of the arguments")
    strict: bool | None = None


class ChatTool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: Text


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatTemplateKwargs(_Request):
    """The variables a client may pass to the chat template: an allow-list (any other key is a 400;
    ``add_generation_prompt`` and ``continue_final_message`` are fields of the request)."""

    enable_thinking: bool | None = Field(default=None, description="Qwen3-style thinking switch")
    thinking: bool | None = Field(default=None, description="DeepSeek-style thinking switch")
    reasoning_effort: Literal["low", "medium", "high"] | None = Field(default=None,
                                                                      description="GPT-OSS reasoning effort")


class ChatCompletionRequest(_SamplingFields, ChatRouterFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(default=None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: Int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: Text | None = Field(default=None,
                                       description="refused unless the server runs with --trust-request-chat-template")
    chat_template_kwargs: ChatTemplateKwargs | None = None
    tools: list[ChatTool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        default=None, description="default: auto with tools, none without; required/named are grammar-enforced")
    parallel_tool_calls: bool = True
    reasoning_effort: Literal["low", "medium", "high"] | None = Field(
        default=None, description="GPT-OSS: goes into the Harmony system message (default medium); other models' "
        "templates receive it as the chat_template_kwargs key of the same name")


class TokenizeRequest(_Request):
    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = Field(default=False, description="with messages: end the prompt inside the last "
                                         "message (vllm-router's kv_aware sends it when it tokenizes a chat)")


class DetokenizeRequest(_Request):
    model: Text | None = None
    tokens: list[TokenId] = Field(max_length=1 << 20)
