"""build_app: the FastAPI application over one ServerContext: its routes, its error handlers,
the requests in flight counted for the server's drain, and the engine closed when the server
shuts down."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI

from jhicache.serve.body_limit import BodyLimit
from jhicache.serve.context import ServerContext
from jhicache.serve.errors import install_error_handlers
from jhicache.serve.native_routes import native_router
from jhicache.serve.openai_routes import openai_router
from jhicache.serve.shutdown import Admission, Drain
from jhicache.serve.storage_routes import storage_router
from jhicache.warmup import freeze_heap

logger = logging.getLogger("jhicache.serve")

DEFAULT_MAX_REQUEST_BYTES = 8 << 20  # far above any prompt the context holds, as JSON


def build_app(ctx: ServerContext, drain: Drain, warmup: bool = False,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              admin_api_key: str | None = None) -> FastAPI:
    """The app; with `warmup`, the engine compiles its programs once the server listens
    (`/health` answers 503 until then, and generation requests are refused with 503). A
    request body over `max_request_bytes` is refused with 413 before it is read whole. The
    storage tier's admin routes need `admin_api_key` as a bearer token when one is given.
    `drain` (over `ctx.engine`) counts the requests in flight and refuses new ones once the
    server stops (`DrainingServer`)."""
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if warmup:  # a server keeps its engine to its end: the heap is frozen after
            ctx.engine.start_warmup(freeze_heap=True)
            if not ctx.engine.in_process:  # and this process's, which formats the outputs
                logger.info("the server's process: %d objects frozen", freeze_heap())
        yield
        await drain.close_engine()  # closed by the drain already, unless it never ran
        if ctx.tokenizer is not None:
            await asyncio.to_thread(ctx.tokenizer.close)  # its process of long texts

    app = FastAPI(title="jhicache", lifespan=lifespan)
    app.state.context = ctx
    install_error_handlers(app)
    app.include_router(openai_router(ctx))
    app.include_router(native_router(ctx))
    app.include_router(storage_router(ctx, admin_api_key))
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)
    app.add_middleware(Admission, drain=drain)  # the outermost: it sees every request
    return app
