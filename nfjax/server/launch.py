"""Run the app under uvicorn: in the foreground with signal handling (`serve`), or in a thread (`ServerThread`,
for tests and in-process benchmarks).

SIGTERM/SIGINT in the foreground: uvicorn stops accepting connections; the app answers new requests on open
connections with 503, lets in-flight requests run for `shutdown_timeout_s`, then aborts what is left (streams get
an error event and `data: [DONE]`); the engine loop drains and the process exits 0 (SIGINT: 130, like Ctrl-C
elsewhere in the CLI).
"""
from __future__ import annotations

import asyncio
import gc
import signal
import socket
import threading
from typing import Callable

import uvicorn

from nfjax.config import ServerConfig
from nfjax.errors import UserError
from nfjax.server.app import ServerState, create_app


def bind_socket(host: str, port: int, listen: bool = True) -> socket.socket:
    """A socket bound to host:port (listening unless `listen=False`: `nfjax serve` binds before it loads the
    model, so that a port in use is found at once, and listens once the model is ready).
    A port in use (or an address that cannot be bound) is a UserError naming host:port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        if listen:
            sock.listen(2048)
    except OSError as e:
        sock.close()
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        raise UserError(f"cannot listen on {where}: {e.strerror or e}") from None
    sock.setblocking(False)
    return sock


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class _Server(uvicorn.Server):
    """uvicorn's server plus: report readiness, and start the app's drain when a shutdown signal arrives."""

    def __init__(self, config: uvicorn.Config, state: ServerState, on_ready: Callable[[], None] | None):
        super().__init__(config)
        self.nf_state = state
        self.on_ready = on_ready
        self._aio: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets=None) -> None:
        self._aio = asyncio.get_running_loop()
        await super().startup(sockets=sockets)
        if self.started and not self.should_exit and self.on_ready is not None:
            self.on_ready()

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        if self._aio is not None:
            grace = self.nf_state.config.shutdown_timeout_s
            self._aio.call_soon_threadsafe(self.nf_state.begin_drain, grace)


def _uvicorn_config(app, cfg: ServerConfig) -> uvicorn.Config:
    # uvicorn's own graceful timeout is a backstop behind the app's drain (which aborts at shutdown_timeout_s)
    return uvicorn.Config(app, log_level=cfg.log_level, access_log=False, lifespan="on", loop="asyncio",
                          http="h11", timeout_graceful_shutdown=cfg.shutdown_timeout_s + 10.0)


def serve(engine, cfg: ServerConfig, model_name: str, on_ready: Callable[[str], None] | None = None,
          sock: socket.socket | None = None) -> int:
    """Serve until SIGTERM/SIGINT (blocking). Prints `nfjax server listening on URL` once ready. Returns the exit
    code: 0 after SIGTERM. `sock`: a socket from `bind_socket(..., listen=False)` (default: bind cfg.host:port)."""
    app = create_app(engine, cfg, model_name)
    if sock is None:
        sock = bind_socket(cfg.host, cfg.port)
    else:
        try:
            sock.listen(2048)
        except OSError as e:
            sock.close()
            raise UserError(f"cannot listen on {cfg.host}:{cfg.port}: {e.strerror or e}") from None
    url = _url(sock)

    def ready():
        print(f"nfjax server listening on {url}  (model {model_name!r})", flush=True)
        if on_ready is not None:
            on_ready(url)

    server = _Server(_uvicorn_config(app, cfg), app.state.nfjax, ready)
    # The model's and the compiled programs' Python objects (280k on the tiny model) are kept for the process's life:
    # frozen, the cyclic GC no longer walks them in every full collection on the engine loop's thread (streaming 512
    # sequences on a CPU: 6.0 -> 3.8 ms of output processing a step, and no growth over the outputs' length;
    # docs/design.md section 16). One engine a process here, so nothing frozen is garbage left uncollected.
    gc.collect()
    gc.freeze()
    main = threading.current_thread() is threading.main_thread()
    got = []
    # uvicorn re-raises the signal it caught once it has shut down; let that land on a handler that records it
    # instead of the default one (which would kill the process with -SIGTERM instead of exiting 0).
    prev = signal.signal(signal.SIGTERM, lambda s, f: got.append(s)) if main else None
    try:
        server.run(sockets=[sock])
    finally:
        if main:
            signal.signal(signal.SIGTERM, prev)
        sock.close()
    return 0


class ServerThread:
    """A server on a background thread (no signal handling): `with ServerThread(engine) as s: s.url ...`."""

    def __init__(self, engine, cfg: ServerConfig | None = None, model_name: str = "nfjax-tiny"):
        self.cfg = cfg or ServerConfig(port=0, log_level="warning")
        self.app = create_app(engine, self.cfg, model_name)
        self.state: ServerState = self.app.state.nfjax
        self._sock = bind_socket(self.cfg.host, self.cfg.port)
        self.url = _url(self._sock)
        self._ready = threading.Event()
        self.server = _Server(_uvicorn_config(self.app, self.cfg), self.state, self._ready.set)
        self._thread = threading.Thread(target=self._run, name="nfjax-uvicorn", daemon=True)
        self._error: BaseException | None = None

    def _run(self) -> None:
        try:
            self.server.run(sockets=[self._sock])
        except BaseException as e:      # surfaced by start()/stop()
            self._error = e
        finally:
            self._ready.set()

    def start(self, timeout: float = 60.0) -> "ServerThread":
        self._thread.start()
        if not self._ready.wait(timeout) or self._error is not None or not self.server.started:
            raise RuntimeError(f"server did not start: {self._error!r}")
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Abort whatever is in flight and shut down."""
        if self._thread.is_alive():
            aio = self.server._aio
            if aio is not None:
                aio.call_soon_threadsafe(self.state.begin_drain, 0.0)
            self.server.should_exit = True
            self._thread.join(timeout)
        self._sock.close()
        if self._thread.is_alive():
            raise RuntimeError("server thread did not stop")

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
