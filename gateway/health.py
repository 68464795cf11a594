"""The metrics port: /metrics (Prometheus), /healthz (alive) and /readyz (connected and
consuming), for Kubernetes probes and for tests and the benchmark to wait on."""

import threading
import time
from typing import Dict, Iterable, Tuple, Union
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

# /healthz fails when the worker's loop has not reported for this long: a hung process is
# restarted, a busy one (reconnecting with backoff reports too) is not.
STALL_S = 60.0

# (alive, ready, why not ready, seconds since the last report)
Status = Tuple[bool, bool, str, float]


class Health:
    """What the worker reports about itself; read by the HTTP handler's thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._beat = time.monotonic()
        self._ready = False
        self._why = "starting"

    def beat(self) -> None:
        with self._lock:
            self._beat = time.monotonic()

    def ready(self, ready: bool, why: str = "") -> None:
        with self._lock:
            self._ready, self._why = ready, why
            self._beat = time.monotonic()

    def status(self) -> Status:
        with self._lock:
            stalled = time.monotonic() - self._beat
            return stalled < STALL_S, self._ready, self._why, stalled


class Parts:
    """A process serving several virtual hosts: one Health per vhost, read as one. Alive while
    every part reports; ready while every part is ready or refused (a refused vhost is reported
    on its own, and must not hold back a rollout of the others), and at least one is ready."""

    def __init__(self, names: Iterable[str]) -> None:
        self.parts: Dict[str, Health] = {name: Health() for name in names}
        self.refused: Dict[str, bool] = {name: False for name in self.parts}

    def status(self) -> Status:
        states = {name: part.status() for name, part in self.parts.items()}
        stalled = max(s[3] for s in states.values())
        serving = [name for name, s in states.items() if s[1]]
        waiting = [f"{name}: {s[2]}" for name, s in states.items() if not s[1] and not self.refused[name]]
        ready = bool(serving) and not waiting
        why = "; ".join(waiting) or ("" if ready else "every virtual host refused")
        return stalled < STALL_S, ready, why, stalled


def serve(port: int, registry: CollectorRegistry, health: Union[Health, Parts],
          addr: str = "0.0.0.0") -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the http.server name)
            alive, ready, why, stalled = health.status()
            if self.path == "/metrics":
                self._reply(200, generate_latest(registry), CONTENT_TYPE_LATEST)
            elif self.path == "/healthz":
                self._reply(200 if alive else 503, b"ok\n" if alive else
                            f"no progress for {stalled:.0f} s\n".encode())
            elif self.path == "/readyz":
                self._reply(200 if ready else 503, b"ready\n" if ready else f"not ready: {why}\n".encode())
            else:
                self._reply(404, b"not found: try /metrics, /healthz or /readyz\n")

        def _reply(self, code: int, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # probes every few seconds: not worth a log line
            pass

    server = ThreadingHTTPServer((addr, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server
