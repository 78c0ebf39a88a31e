"""Responses checked against OpenAI's own OpenAPI schemas (tests/openai_schemas/responses.json:
the schemas needed, taken unchanged from openai/openai-openapi; the file names its commit),
with jsonschema, every ``$ref`` resolved. The spec marks nullable fields the OpenAPI 3.0 way
(``nullable: true``), which JSON Schema ignores: such a schema is read as "it, or null"."""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

SPEC = Path(__file__).with_name("openai_schemas") / "responses.json"
URI = "urn:openai-openapi"


def _nullable(node):
    """``{..., "nullable": true}`` -> ``{"anyOf": [{...}, {"type": "null"}]}``, everywhere."""
    if isinstance(node, list):
        return [_nullable(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _nullable(v) for k, v in node.items() if k != "nullable"}
    if node.get("nullable") is True:
        return {"anyOf": [out, {"type": "null"}]}
    return out


@lru_cache(maxsize=1)
def _registry():
    from referencing import Registry, Resource
    from referencing.jsonschema import DRAFT202012

    doc = json.loads(SPEC.read_text())
    components = _nullable(doc["components"])
    return Registry().with_resource(URI, Resource(contents={"components": components},
                                                  specification=DRAFT202012))


@lru_cache(maxsize=None)
def _validator(name: str):
    from jsonschema import Draft202012Validator

    return Draft202012Validator({"$ref": f"{URI}#/components/schemas/{name}"},
                                registry=_registry())


def check(obj, name: str) -> None:
    """Raise AssertionError listing every way ``obj`` breaks OpenAI's schema ``name``
    (CreateChatCompletionResponse, CreateChatCompletionStreamResponse, CreateCompletionResponse,
    Model, ListModelsResponse, ErrorResponse; for the Responses API: Response,
    ResponseStreamEvent, ResponseItemList)."""
    errors = sorted(_validator(name).iter_errors(obj), key=lambda e: list(e.path))
    if errors:
        lines = [f"{'/'.join(map(str, e.path)) or '(root)'}: {e.message[:200]}" for e in errors]
        raise AssertionError(f"not a valid {name}:\n" + "\n".join(lines[:10]))
