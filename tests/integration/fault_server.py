"""A server process for the fault tests: the real app and store, a scripted fast model.

``python fault_server.py STORE FD`` serves on the listening socket inherited as file
descriptor ``FD`` (the test binds it, so there is no port race) with uvicorn's own signal
handling: SIGTERM is a graceful shutdown, which is what production gets. The model is
:class:`FakeRuntime` (a reply streamed in 3-character deltas, each after a short sleep so
that a kill lands mid-stream); the session store is a real :class:`SessionStore` on
``STORE``, and the app owns it, so shutdown checkpoints and closes it.
"""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Generator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))

import uvicorn
from server_fakes import FakeRuntime

from adapters.openai_server import ServerConfig, create_app
from agentspec.chat.api import ChatResult
from agentspec.chat.stream import ResultStream
from agentspec.chat.turn import ChatTurn
from agentspec.storage.sessions import SessionStore

DELTA_S = 0.004  # per 3-character delta: a 300-character reply streams for ~0.4 s


class SlowRuntime(FakeRuntime):
    """FakeRuntime whose deltas take a little time, as a model's do."""

    def _steps(self, turn: ChatTurn) -> Generator[str, None, ChatResult]:
        reply = ResultStream(super()._steps(turn))
        for delta in reply:
            time.sleep(DELTA_S)
            yield delta
        return reply.result


def main() -> None:
    store_path, fd = Path(sys.argv[1]), int(sys.argv[2])
    store = SessionStore.open_or_recover(store_path)
    app = create_app(SlowRuntime(store), ServerConfig(owns_runtime=True, max_tokens_limit=4096,
                                                      default_max_tokens=1024))
    sock = socket.socket(fileno=fd)  # family detected from the descriptor (an INET socket)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning",
                                           timeout_graceful_shutdown=20))
    server.run(sockets=[sock])  # installs uvicorn's SIGTERM/SIGINT handlers, as uvicorn.run


if __name__ == "__main__":
    main()
