"""Run the consumers: connect, declare, consume; reconnect with backoff; stop on SIGTERM."""

import functools
import itertools
import threading
from typing import List

import pika
import structlog
from pika.exceptions import AMQPConnectionError
from tenacity import (RetryError, Retrying, retry_if_exception_type, stop_after_delay, stop_any,
                      wait_exponential_jitter)

from topology import build
from topology.declare import declare

from .amqp import blocking_channel, parameters
from .consumer import Pipe, wall_ms
from .handlers import CheckIn, Distributor, Parking, park_unencodable
from .metrics import Metrics
from .settings import Settings, redact

STOP_POLL_S = 0.2
STOP_GRACE_S = 10.0


class Session:
    """One connection, from open to close, with the pipes of the chosen role."""

    def __init__(self, url: str, settings: Settings, metrics: Metrics, stop: threading.Event) -> None:
        self.url, self.settings, self.metrics, self.stop_event = url, settings, metrics, stop
        self.log = structlog.get_logger("gateway").bind(broker=redact(url))
        self.open_error = None
        self.pipes: List[Pipe] = []
        self._stopping = False

    def run(self) -> None:
        """Returns when the connection closes; raises AMQPConnectionError if it never opened."""
        self.connection = pika.SelectConnection(
            parameters(self.url, f"delay-gateway {self.settings.role}", self.settings.tls),
            on_open_callback=self._on_open, on_open_error_callback=self._on_open_error,
            on_close_callback=self._on_close)
        self.connection.ioloop.start()
        if self.open_error is not None:
            raise AMQPConnectionError(f"cannot connect to {redact(self.url)}: {self.open_error!r}")

    def _on_open(self, connection) -> None:
        self.log.info("connected")
        s, chain, names = self.settings, self.settings.chain, self.settings.chain.names
        fallback = functools.partial(park_unencodable, names)
        if s.role in ("all", "check-in"):
            self.pipes.append(Pipe(connection, names.check_in, CheckIn(chain, s.lead_ms, wall_ms),
                                   s.prefetch, self.metrics, fallback=fallback))
        if s.role in ("all", "distributor"):
            self.pipes.append(Pipe(connection, names.distributor, Distributor(chain, s.lead_ms, wall_ms),
                                   s.distributor_prefetch, self.metrics, fallback=fallback))
            self.pipes.append(Pipe(connection, names.parking, Parking(names, wall_ms),
                                   s.prefetch, self.metrics, fallback=fallback))
        for pipe in self.pipes:
            pipe.open()
        self._watch_stop()

    def _watch_stop(self) -> None:
        # Polled rather than signalled: a signal handler must not take pika's locks.
        if self.stop_event.is_set():
            self._begin_stop()
        else:
            self.connection.ioloop.call_later(STOP_POLL_S, self._watch_stop)

    def _begin_stop(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        self.log.info("stopping: no new messages; returning held ones, waiting for confirms")
        remaining = len(self.pipes)

        def one_stopped() -> None:
            nonlocal remaining
            remaining -= 1
            if remaining == 0 and self.connection.is_open:
                self.connection.close()

        for pipe in self.pipes:
            pipe.stop(one_stopped)
        if not self.pipes and self.connection.is_open:
            self.connection.close()
        self.connection.ioloop.call_later(STOP_GRACE_S, self._close_now)

    def _close_now(self) -> None:
        if self.connection.is_open:
            self.log.warning("confirms still outstanding after grace period; closing (they will be redelivered)")
            self.connection.close()

    def _on_open_error(self, connection, error) -> None:
        self.open_error = error
        connection.ioloop.stop()

    def _on_close(self, connection, reason) -> None:
        if not self._stopping:
            self.log.warning("connection lost", reason=str(reason))
        connection.ioloop.stop()


def run(settings: Settings, stop: threading.Event, metrics: Metrics) -> int:
    """The consumers until `stop` is set (0), or until no broker answers for too long (1)."""
    log = structlog.get_logger("gateway")
    urls = itertools.cycle(settings.urls)
    declared = not settings.declare

    def attempt() -> None:
        nonlocal declared
        url = next(urls)
        if not declared:
            with blocking_channel(url, tls=settings.tls) as channel:
                declare(channel, build(settings.chain))
            log.info("topology declared", prefix=settings.chain.prefix, max_level=settings.chain.max_level)
            declared = True
        Session(url, settings, metrics, stop).run()

    while not stop.is_set():
        retrying = Retrying(
            retry=retry_if_exception_type(AMQPConnectionError),
            wait=wait_exponential_jitter(initial=0.2, max=10),
            stop=stop_any(stop_after_delay(settings.connect_timeout_s), lambda _: stop.is_set()),
            sleep=stop.wait,
            before_sleep=lambda rs: log.warning("broker unreachable; retrying",
                                                attempt=rs.attempt_number, error=str(rs.outcome.exception())),
        )
        try:
            retrying(attempt)
        except RetryError as exc:
            if stop.is_set():
                break
            log.error("giving up: no broker answered", seconds=settings.connect_timeout_s,
                      error=str(exc.last_attempt.exception()))
            return 1
        if not stop.is_set():
            stop.wait(0.2)  # lost after it was open: reconnect promptly, with a fresh backoff
    log.info("stopped")
    return 0

