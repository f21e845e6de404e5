"""The OpenAPI document: the app's routes with each API's request models (`REQUEST_BODIES`
of `chat_wire`, `responses_wire`, `messages_wire`), and the shapes every API shares (health,
models, OpenAI's error object)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorBody


class ModelHealth(BaseModel):
    """One served model's state: `unloaded`, or its scheduler's (`ok`, `stopping`)."""

    status: Literal["ok", "stopping", "unloaded"]
    queue_depth: int
    active: int
    pinned: bool


class Health(BaseModel):
    status: Literal["ok"]
    model: str  # the default model
    queue_depth: int  # every model's together
    models: dict[str, ModelHealth] = {}


class ModelCard(BaseModel):
    """OpenAI's model object, with what this server knows of the model (`fleet.card_of`)."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    aliases: list[str] = []
    family: str | None = None
    quantization: str | None = None
    context_length: int | None = None
    draft: str | None = None
    loaded: bool = True
    pinned: bool = False


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    why = {400: "invalid request (OpenAI's error shape, `param` names the field)",
           401: "missing or wrong API key", 404: "unknown model or path",
           409: "another turn on the conversation is in progress and outlasted this "
                "request's time limit; or a background response runs on another server "
                "sharing the store",
           413: "request body too large",
           503: "queue full, the model busy or failing to load, or the response store "
                "failing (Retry-After where a retry can succeed)",
           504: "the request's time limit passed"}
    return {c: {"model": ErrorResponse, "description": why[c]} for c in codes}


GENERATE_RESPONSES = error_responses(400, 401, 404, 413, 503, 504)


def sse(description: str) -> dict[str, Any]:
    """A `text/event-stream` body: each server-sent event (its `data`, and its `event` name
    where the API names them) as clients and schema checkers parse one."""
    return {"text/event-stream": {"description": description, "schema": {
        "type": "object", "required": ["data"],
        "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}}}


def openapi(app: Any, bodies: dict[str, type[BaseModel]], vocab_size: int | None = None
            ) -> dict[str, Any]:
    """The app's OpenAPI document with the request bodies the handlers parse (`bodies`:
    path -> model; prompt token ids bounded by the served model's `vocab_size`)."""
    from fastapi.openapi.utils import get_openapi

    if app.openapi_schema:
        return app.openapi_schema  # type: ignore[no-any-return]
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                      description="OpenAI-compatible constrained decoding")
    components = doc.setdefault("components", {}).setdefault("schemas", {})
    for path, model in bodies.items():
        js = model.model_json_schema(ref_template="#/components/schemas/{model}",
                                     by_alias=True)
        defs = js.pop("$defs", {})
        clash = [k for k, v in defs.items() if components.get(k, v) != v]
        assert not clash, f"two request models define components {clash} differently"
        components.update(defs)
        components[model.__name__] = js
        doc["paths"][path]["post"]["requestBody"] = {
            "required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    if vocab_size is not None:
        ids = components["CompletionRequest"]["properties"]["prompt"]["anyOf"][1]["items"]
        ids["maximum"] = vocab_size - 1
    app.openapi_schema = doc
    return doc
