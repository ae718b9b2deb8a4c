"""The OpenAPI document tells the truth: every error status a route answers is documented with
OpenAI's error body, the 200s have response models, /metrics is text/plain, no 422 (the server
answers 400), and real responses validate against the documented models."""

from __future__ import annotations

from tests.server.inprocess import fake_server
from tokenfab.server.app import ServerConfig
from tokenfab.server.responses import (
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    ErrorResponse,
    HealthResponse,
    ModelList,
    TokenizeResponse,
)

ERROR_REF = "#/components/schemas/ErrorResponse"


def _ref(op: dict, status: str, media: str = "application/json") -> str | None:
    return op["responses"][status]["content"][media]["schema"].get("$ref")


def test_openapi_documents_errors_and_response_models():
    with fake_server(ServerConfig(api_key="k", drain_timeout=0)) as (client, _):
        doc = client.get("/openapi.json").json()
    paths = doc["paths"]
    for path in ("/v1/completions", "/v1/chat/completions"):
        op = paths[path]["post"]
        assert {"200", "400", "401", "413", "429", "500", "503"} <= set(op["responses"])
        assert "422" not in op["responses"]
        for status in ("400", "401", "413", "429", "500", "503"):
            assert _ref(op, status) == ERROR_REF
        assert "text/event-stream" in op["responses"]["200"]["content"]
    assert _ref(paths["/v1/completions"]["post"], "200").endswith("/CompletionResponse")
    assert _ref(paths["/v1/chat/completions"]["post"], "200").endswith("/ChatCompletionResponse")
    assert _ref(paths["/v1/models"]["get"], "200").endswith("/ModelList")
    assert _ref(paths["/v1/models/{model_id}"]["get"], "404") == ERROR_REF
    assert _ref(paths["/health"]["get"], "200").endswith("/HealthResponse")
    assert _ref(paths["/health"]["get"], "503") == ERROR_REF
    assert _ref(paths["/tokenize"]["post"], "200").endswith("/TokenizeResponse")
    assert _ref(paths["/detokenize"]["post"], "200").endswith("/DetokenizeResponse")
    assert list(paths["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    schemas = doc["components"]["schemas"]
    assert "HTTPValidationError" not in schemas
    assert schemas["CompletionRequest"]["additionalProperties"] is False  # unknown fields are refused
    import json

    text = json.dumps(doc)
    assert '"ge":' not in text and '"le":' not in text  # bounds in JSON Schema's words, so they count
    n = schemas["CompletionRequest"]["properties"]["max_tokens"]["anyOf"][0]
    assert (n["minimum"], n["maximum"]) == (0, 2**31 - 1)
    assert schemas["CompletionRequest"]["properties"]["priority"]["maximum"] == 0  # fcfs: only 0
    assert schemas["CompletionRequest"]["properties"]["model"]["anyOf"][0]["enum"] == ["fake-model"]


def test_real_responses_validate_against_the_documented_models():
    with fake_server() as (client, _):
        CompletionResponse.model_validate(client.post("/v1/completions", json={
            "prompt": [5, 6, 7], "max_tokens": 3, "logprobs": 2, "echo": True, "prompt_logprobs": 1}).json())
        ChatCompletionResponse.model_validate(client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "logprobs": True, "top_logprobs": 2,
            "prompt_logprobs": 0}).json())
        ModelList.model_validate(client.get("/v1/models").json())
        HealthResponse.model_validate(client.get("/health").json())
        TokenizeResponse.model_validate(client.post("/tokenize", json={"prompt": "abc"}).json())
        DetokenizeResponse.model_validate(client.post("/detokenize", json={"tokens": [66, 67]}).json())
        ErrorResponse.model_validate(client.post("/v1/completions", json={"prompt": 1}).json())
        resp = client.get("/metrics")
        assert resp.headers["content-type"].startswith("text/plain")
