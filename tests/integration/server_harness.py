"""Running the OpenAI-compatible server on loopback inside a test process.

uvicorn runs on a background thread on a socket bound to 127.0.0.1 with a free port chosen
by the kernel (no race between picking a port and binding it). The server shares the test
process's loaded model through the Runtime passed in.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from adapters.openai_server import ServerConfig, create_app


class ServerThread:
    """A uvicorn server on a loopback socket, run on a daemon thread.

    Args:
        runtime: The Runtime (or fake) to serve.
        config: Server settings.
    """

    def __init__(self, runtime: Any, config: ServerConfig) -> None:
        self.app = create_app(runtime, config)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])
        self.server = uvicorn.Server(uvicorn.Config(
            self.app, log_level="warning", timeout_graceful_shutdown=5, lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="uvicorn-test", daemon=True)

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:<port>/v1``, what OpenAI clients take as ``base_url``."""
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def root(self) -> str:
        """``http://127.0.0.1:<port>``."""
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> None:
        """Start serving; return once uvicorn accepts connections."""
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        """Ask uvicorn to exit and wait for the thread."""
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


@contextmanager
def serving(runtime: Any, config: ServerConfig) -> Iterator[ServerThread]:
    """Serve ``runtime`` for the duration of a ``with`` block."""
    server = ServerThread(runtime, config)
    server.start()
    try:
        yield server
    finally:
        server.stop()
