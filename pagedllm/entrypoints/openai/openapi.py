"""The OpenAPI schema (/openapi.json) with every route's JSON request body in it.

The routes read their bodies themselves (request_body.py: content type, size and depth limits,
then pydantic), so FastAPI sees no body parameter and would document none: clients, code
generators and fuzzers would see ``POST /v1/completions`` as taking nothing. Here each route
that takes a ``typed_body(Model)`` (or declares ``openapi_extra=json_body_doc(...)``) gets its
model's JSON schema as the request body, and the models' shared definitions go to
``components/schemas``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from pydantic import BaseModel

REF_TEMPLATE = "#/components/schemas/{model}"


def json_body_doc(*models: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` for a route whose body is one of ``models`` (read by the route itself)."""
    schemas = [m.model_json_schema(ref_template=REF_TEMPLATE) for m in models]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def install(app: FastAPI, routers: Iterable[APIRouter]) -> None:
    """Make ``app.openapi()`` (what /openapi.json serves) document the request bodies of the
    routes of ``routers`` (the routers the app includes, without a prefix)."""
    routes = [route for router in routers for route in router.routes if isinstance(route, APIRoute)]

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _with_bodies(app, routes)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented override


def _with_bodies(app: FastAPI, routes: list[APIRoute]) -> dict[str, Any]:
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for route in routes:
        if route.path_format not in schema["paths"]:  # left out of the schema (include_in_schema=False)
            continue
        model = _body_model(route)
        for method in route.methods or ():
            operation = schema["paths"][route.path_format][method.lower()]
            if model is not None and "requestBody" not in operation:
                operation.update(json_body_doc(model))
            if "requestBody" in operation:
                _hoist_defs(operation["requestBody"]["content"]["application/json"]["schema"], components)
    return schema


def _body_model(route: APIRoute) -> type[BaseModel] | None:
    """The model of the route's ``typed_body`` dependency, if it has one."""
    for dependency in route.dependant.dependencies:
        model = getattr(dependency.call, "body_model", None)
        if model is not None:
            return model
    return None


def _hoist_defs(schema: dict[str, Any], components: dict[str, Any]) -> None:
    """Move pydantic's ``$defs`` (nested ones too) into ``components/schemas``, where refs point."""
    for branch in schema.get("anyOf", []):
        _hoist_defs(branch, components)
    components.update(schema.pop("$defs", {}))
