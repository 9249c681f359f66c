"""`GET /openapi.json`: an OpenAPI 3.1 document whose request schemas are the pydantic models that validate the
requests (`schemas.py`), so the documented fields and ranges are the enforced ones."""
from __future__ import annotations

from pydantic.json_schema import models_json_schema

from nfjax.server import schemas

_REF = "#/components/schemas/{model}"
_ERRORS = {400: "invalid request (`param` names the field)", 404: "unknown model or route",
           408: "request body not received in time", 413: "request body too large", 429: "queue full",
           503: "shutting down or engine failed"}


def _ref(model) -> dict:
    return {"$ref": _REF.format(model=model.__name__)}


def _json(schema: dict, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*codes: int) -> dict:
    return {str(c): _json(_ref(schemas.ErrorResponse), _ERRORS[c]) for c in codes}


def _post(summary: str, body: dict, ok: dict, *codes: int) -> dict:
    return {"post": {"summary": summary, "requestBody": {"required": True,
                                                         "content": {"application/json": {"schema": body}}},
                     "responses": {"200": ok, **_errors(*codes)}}}


def _get(summary: str, ok: dict, *codes: int) -> dict:
    return {"get": {"summary": summary, "responses": {"200": ok, **_errors(*codes)}}}


def openapi_document(version: str) -> dict:
    models = [*schemas.REQUEST_MODELS, schemas.TokenizeResponse, schemas.DetokenizeResponse,
              schemas.VersionResponse, schemas.ErrorResponse]
    _, defs = models_json_schema([(m, "validation") for m in models], ref_template=_REF)
    generation = (400, 404, 408, 413, 429, 503)
    stream_note = ("the response object, or with `stream: true` a `text/event-stream` of chunks ending in "
                   "`data: [DONE]`")
    obj = {"type": "object"}
    paths = {
        "/v1/completions": _post("Text completions (OpenAI)", _ref(schemas.CompletionRequest),
                                 _json(obj, stream_note), *generation),
        "/v1/chat/completions": _post("Chat completions (OpenAI)", _ref(schemas.ChatCompletionRequest),
                                      _json(obj, stream_note), *generation),
        "/tokenize": _post("Token ids of a prompt or of chat messages",
                           {"oneOf": [_ref(schemas.TokenizeCompletionRequest), _ref(schemas.TokenizeChatRequest)]},
                           _json(_ref(schemas.TokenizeResponse), "the token ids"), 400, 404, 408, 413),
        "/detokenize": _post("Text of token ids", _ref(schemas.DetokenizeRequest),
                             _json(_ref(schemas.DetokenizeResponse), "the text"), 400, 404, 408, 413),
        "/v1/models": _get("The served model", _json(obj, "a list with the one served model")),
        "/v1/models/{name}": _get("One model", _json(obj, "the model card"), 404),
        "/health": _get("Health", _json(obj, "ok"), 503),
        "/metrics": _get("Prometheus metrics", {"description": "Prometheus text exposition",
                                                "content": {"text/plain": {"schema": {"type": "string"}}}}),
        "/version": _get("Server version", _json(_ref(schemas.VersionResponse), "the nfjax version")),
        "/openapi.json": _get("This document", _json(obj, "OpenAPI 3.1")),
    }
    paths["/v1/models/{name}"]["get"]["parameters"] = [
        {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}]
    return {"openapi": "3.1.0", "info": {"title": "nfjax OpenAI-compatible server", "version": version},
            "paths": paths, "components": {"schemas": defs.get("$defs", {})}}
