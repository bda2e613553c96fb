"""ApiError and the app's exception handlers: every refusal leaves as OpenAI's error body, with
400 for a bad request (malformed JSON and wrong field types included, where FastAPI says 422)."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from jhicache.async_engine import EngineClosedError, EngineDeadError
from jhicache.serve.protocol import JsonResponse, error_body

logger = logging.getLogger("jhicache.serve")


class ApiError(Exception):
    """A request the server refuses: its HTTP status, message and the field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.status, self.param, self.code)

    def response(self) -> JsonResponse:
        return JsonResponse(self.body(), status_code=self.status)


def ended_by_shutdown() -> ApiError:
    """What a request still running when the server's drain ends gets (the engine closed)."""
    return ApiError(503, "the server shut down before this request finished", None,
                    "shutting_down")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """The first problem as "field: what is wrong" (a union reports one per member: the first
    is enough to fix the request), and the top-level field it is in."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ())][1:]  # drop the leading "body"
    if first.get("type") == "json_invalid":
        return f"malformed JSON: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    if not loc and first.get("type") in ("model_attributes_type", "dict_type"):
        return ("the request body must be a JSON object, sent with "
                "Content-Type: application/json"), None
    where = ".".join(loc)
    if first.get("type") == "extra_forbidden":
        return (f"{where}: this server does not implement this field (it is refused rather "
                f"than ignored)", loc[0] if loc else None)
    return ((f"{where}: {first.get('msg')}" if where else str(first.get("msg"))),
            (loc[0] if loc else None))


async def _on_api_error(_: Request, exc: Exception) -> JsonResponse:
    assert isinstance(exc, ApiError)
    return exc.response()


async def _on_validation_error(_: Request, exc: Exception) -> JsonResponse:
    assert isinstance(exc, RequestValidationError)
    message, param = _validation_message(exc)
    return ApiError(400, message, param).response()


async def _on_http_error(_: Request, exc: Exception) -> JsonResponse:
    assert isinstance(exc, HTTPException)
    return ApiError(exc.status_code, str(exc.detail)).response()


async def _on_engine_failed(_: Request, exc: Exception) -> JsonResponse:
    logger.error("engine unavailable: %s", exc)
    return ApiError(503, f"engine unavailable: {exc}").response()


async def _on_engine_closed(_: Request, exc: Exception) -> JsonResponse:
    return ended_by_shutdown().response()  # the drain logs how many it ended


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(HTTPException, _on_http_error)
    app.add_exception_handler(EngineDeadError, _on_engine_failed)
    app.add_exception_handler(EngineClosedError, _on_engine_closed)
