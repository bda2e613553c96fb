"""ServerThread: uvicorn serving one ServerContext on a free port of 127.0.0.1 from a thread, its
stop drained as the command's server's is."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from jhicache.serve.app import DEFAULT_MAX_REQUEST_BYTES, build_app
from jhicache.serve.context import ServerContext
from jhicache.serve.shutdown import CONNECTIONS_GRACE_S, Drain, DrainingServer


def free_socket() -> socket.socket:
    """A socket bound to a free port of 127.0.0.1 (held until the server takes it: no race)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


class ServerThread:
    """uvicorn serving `ctx` on a free port of 127.0.0.1 from a thread; `stop()` shuts it down
    as the command's server does at Ctrl-C: the requests in flight get up to
    `shutdown_timeout` seconds, then the engine is closed."""

    def __init__(self, ctx: ServerContext, log_level: str = "warning",
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 shutdown_timeout: float = 30.0, admin_api_key: str | None = None) -> None:
        self.ctx = ctx
        self._sock = free_socket()
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.drain = Drain(ctx.engine, shutdown_timeout)
        # log_config=None: a server inside another program leaves that program's logging as it
        # is (uvicorn's own config would close every handler the process has)
        config = uvicorn.Config(build_app(ctx, self.drain, max_request_bytes=max_request_bytes,
                                          admin_api_key=admin_api_key),
                                log_level=log_level, lifespan="on", log_config=None,
                                timeout_graceful_shutdown=CONNECTIONS_GRACE_S)
        self.server = DrainingServer(config, self.drain)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                        daemon=True)

    @property
    def thread(self) -> threading.Thread:
        """The thread uvicorn and its event loop run on."""
        return self._thread

    def start(self, timeout_s: float = 60.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        """Stops the server (drained) and waits for its thread."""
        self.server.stop()
        self._thread.join(self.drain.timeout_s + 60)
        self._sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
