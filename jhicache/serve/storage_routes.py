"""The storage tier's admin routes, as SGLang's: show, attach (or replace) and detach the
backend at run time, and clear its pages; behind the admin key when the server has one."""

from __future__ import annotations

import asyncio
import hmac
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict
from starlette.responses import JSONResponse, Response

from jhicache.serve.context import ServerContext
from jhicache.serve.errors import ApiError


class AttachBody(BaseModel):
    """PUT /hicache/storage-backend: SGLang's field names, and ours for the file backend's
    directory. A field not listed (SGLang's prefetch or write policy) is refused, not ignored:
    this server sets those at start only."""

    model_config = ConfigDict(strict=True, extra="forbid")
    hicache_storage_backend: str
    hicache_storage_backend_extra_config_json: str | None = None
    storage_dir: str | None = None
    timeout_s: float | None = 30.0  # how long the old tier's backups may take to be written


def storage_router(ctx: ServerContext, admin_api_key: str | None) -> APIRouter:
    router = APIRouter()

    def check_admin(request: Request) -> None:
        if admin_api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {admin_api_key}".encode()):
            raise ApiError(401, "this route needs the admin API key (Authorization: Bearer)")

    @router.get("/hicache/storage-backend")
    async def show(request: Request) -> dict[str, Any]:
        check_admin(request)
        return storage_tier(ctx.engine.info.config)

    @router.put("/hicache/storage-backend")
    async def attach(request: Request, body: AttachBody) -> JSONResponse:
        check_admin(request)
        return await _set(ctx, body.hicache_storage_backend, body.storage_dir,
                          body.hicache_storage_backend_extra_config_json, body.timeout_s)

    @router.delete("/hicache/storage-backend")
    async def detach(request: Request) -> JSONResponse:
        check_admin(request)
        return await _set(ctx, None, None, None, 30.0)

    @router.post("/hicache/storage-backend/clear")
    async def clear(request: Request) -> Response:
        check_admin(request)
        status, why = await cleared_storage(ctx)
        if status != 200:
            raise ApiError(status, f"storage not cleared: {why}")
        return JSONResponse({"cleared": True})

    return router


async def cleared_storage(ctx: ServerContext) -> tuple[int, str]:
    """Has the engine delete the storage tier's pages (off the event loop): (200, "") or the
    refusal's status and reason (both clear routes answer with it)."""
    if await asyncio.to_thread(ctx.engine.clear_storage):
        return 200, ""
    if not (await asyncio.to_thread(ctx.engine.stats)).storage_reachable:
        return 503, "its backend cannot be reached"
    return 400, "requests are running or waiting"


async def _set(ctx: ServerContext, backend: str | None, storage_dir: str | None,
               config: str | None, timeout_s: float | None) -> JSONResponse:
    """Has the engine attach (or detach) the tier between two steps, off the event loop."""
    try:
        now = await asyncio.to_thread(ctx.engine.set_storage, backend, storage_dir, config,
                                      timeout_s)
    except ValueError as e:
        raise ApiError(400, str(e)) from e
    return JSONResponse(storage_tier(now))


def storage_tier(config: dict[str, Any]) -> dict[str, Any]:
    """The storage tier as a config shows it (None: no tier)."""
    enabled = config.get("storage_dir") is not None or config.get("storage_backend") == "mooncake"
    return {"hicache_storage_backend": config.get("storage_backend") if enabled else None,
            "hicache_storage_backend_extra_config_json": config.get("storage_backend_config"),
            "storage_dir": config.get("storage_dir")}
