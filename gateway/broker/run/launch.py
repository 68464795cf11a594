"""How the `run` process and its threads start, one way each: the process with its metrics
port, a stop event that its SIGTERM and SIGINT set, and its first log line (`process`); a
daemon thread, named, in a copy of its starter's context, so that the log fields bound there
(such as the vhost) are the thread's too (`daemon`)."""

import contextvars
import signal
import threading
from typing import Any, Callable, Union

import structlog

from gateway import health as health_http
from gateway import stopping
from gateway.health import Health, Parts
from gateway.metrics import Metrics
from gateway.settings import Settings
from gateway.urls import redact


def process(settings: Settings, metrics: Metrics, health: Union[Health, Parts], **fields: Any) -> threading.Event:
    """Serve /metrics, /healthz and /readyz (with --metrics-port), say `starting` (with
    `fields`), and return the event SIGTERM and SIGINT set."""
    if settings.metrics_port:
        health_http.serve(settings.metrics_port, metrics.registry, health)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stopping.setter(stop))
    c = settings.chain
    structlog.get_logger("gateway").info(
        "starting", role=settings.role, brokers=[redact(u) for u in settings.urls], prefix=c.prefix,
        max_level=c.max_level, resolution_ms=c.resolution_ms, queue_type=c.queue_type, zero_bits=c.zero_bits,
        **fields)
    return stop


def daemon(name: str, target: Callable[..., Any], *args: Any) -> threading.Thread:
    """`target(*args)` in a daemon thread called `name`, started."""
    thread = threading.Thread(target=contextvars.copy_context().run, args=(target, *args), name=name, daemon=True)
    thread.start()
    return thread
