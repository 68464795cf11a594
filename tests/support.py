"""Helpers for tests that talk to a real broker and run the real gateway process."""

import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple, TypeVar

import pika

from . import launcher
from .launcher import ROOT, chain_args, free_port  # noqa: F401 (tests import them from here)
from gateway.broker.plumbing import wire_connection
from gateway.settings import DEFAULT_URL
from topology import ChainSettings, build
from topology.broker.declare import declare, delete


RMQ4 = ("rmq4.3", "rmq4.0")  # the 4.x brokers: 3.12+ features (the arrival stamp), Khepri, AMQP 1.0

# What a gateway says once at start about the broker it runs on (warnings, not troubles):
# tests that want no warning from a run leave these aside.
START_NOTICES = ("arrival_stamp_off", "cancels_need_one_check_in_consumer")

# The broker of the test running now (tests/conftest.py sets it from the `broker` fixture,
# which is parametrized over the broker versions); None means the main one.
_current_url: Optional[str] = None


def main_broker_url() -> str:
    """The shared RabbitMQ 3.10 node (or the user's own broker, DELAY_GATEWAY_URL)."""
    return os.environ.get("DELAY_GATEWAY_URL", DEFAULT_URL).split(",")[0]


def broker_url() -> str:
    return _current_url or main_broker_url()


def use_broker(url: Optional[str]) -> None:
    global _current_url
    _current_url = url


def examples(full: int) -> int:
    """A property test's budget: `full` examples in the test command (HYPOTHESIS_PROFILE=full,
    scripts/test), a tenth (at least 10) in the quick profile a developer runs by default."""
    return full if os.environ.get("HYPOTHESIS_PROFILE", "quick") == "full" else max(10, full // 10)


T = TypeVar("T")


def wait_until(condition: Callable[[], T], timeout: float, interval: float = 0.05, what: str = "",
               fail: bool = True) -> T:
    """The first truthy value of `condition()`, asked every `interval` s. When none came
    within `timeout` s: a test failure naming `what`, or (fail=False) the last value, for a
    caller that checks it itself. The one way tests wait for something."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value or time.monotonic() > deadline:
            if not value and fail:
                raise AssertionError(f"{what or 'the condition'}: not within {timeout:g} s (last: {value!r})")
            return value
        time.sleep(interval)


def parked_report(chain: ChainSettings, count: int = 1, url: Optional[str] = None, timeout: float = 15) -> dict:
    """`delay-gateway parked list --json` once at least `count` messages are parked."""
    def enough() -> Optional[dict]:
        out = subprocess.run([sys.executable, "-m", "gateway", "parked", "list", "--json", *chain_args(chain),
                              "--url", url or broker_url()], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        report = json.loads(out.stdout)
        return report if report["count"] >= count else None
    return wait_until(enough, timeout, interval=0.2, what=f"{count} parked message(s)")


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def unique_prefix() -> str:
    return "t" + uuid.uuid4().hex[:10]


def connect(url: Optional[str] = None) -> pika.BlockingConnection:
    return wire_connection.blocking(pika.URLParameters(url or broker_url()))


def sent_headers(properties) -> dict:
    """Headers as the publisher sent them: without the arrival stamp RabbitMQ 3.12+ adds to
    every incoming message when its timestamp interceptor is on (`timestamp_in_ms`)."""
    return {k: v for k, v in (properties.headers or {}).items() if k != "timestamp_in_ms"}


def same_entries(got, sent) -> bool:
    """Two header tables (wire.Table) hold the same entries, each with its wire type and
    bytes, in any order, the broker's arrival stamp aside (RabbitMQ 4 re-encodes a table in
    name order when its timestamp interceptor adds to it)."""
    def entries(table, stamp_allowed):
        return sorted((e.name, e.kind, e.raw) for e in table.entries
                      if not (stamp_allowed and e.name == b"timestamp_in_ms"))
    return entries(got, "timestamp_in_ms" not in sent) == entries(sent, False) and got.tail == sent.tail


class GatewayProcess(launcher.GatewayProcess):
    """`delay-gateway run` in a subprocess (tests/launcher.py, shared with the benchmark),
    against the broker of the test running now unless `url` names another."""

    def __init__(self, chain: ChainSettings, *extra: str, url: Optional[str] = None,
                 env: Optional[Dict[str, str]] = None, cwd: Optional[str] = None) -> None:
        super().__init__(chain, *extra, url=url or broker_url(), env=env, cwd=cwd)


@dataclass
class Received:
    routing_key: str
    properties: pika.BasicProperties
    body: bytes
    at_ms: int
    exchange: str = ""


@dataclass
class Receiver:
    """A queue bound to pick-up; collects what arrives, with arrival times."""

    chain: ChainSettings
    pattern: str = "#"
    messages: List[Received] = field(default_factory=list)
    url: Optional[str] = None  # another broker than the main one

    def __post_init__(self) -> None:
        self.connection = connect(self.url)
        self.channel = self.connection.channel()
        self.queue = self.channel.queue_declare("", exclusive=True).method.queue
        self.channel.queue_bind(self.queue, self.chain.names.pick_up, self.pattern)

    def collect(self, count: int, timeout: float) -> List[Received]:
        deadline = time.monotonic() + timeout
        while len(self.messages) < count and time.monotonic() < deadline:
            method, properties, body = self.channel.basic_get(self.queue, auto_ack=True)
            if method is None:
                self.connection.sleep(0.002)
                continue
            self.messages.append(Received(method.routing_key, properties, body, now_ms(), method.exchange))
        return self.messages

    def close(self) -> None:
        if self.connection.is_open:
            self.connection.close()


def drain(channel, queue: str) -> List[tuple]:
    out = []
    while True:
        method, properties, body = channel.basic_get(queue, auto_ack=True)
        if method is None:
            return out
        out.append((method, properties, body))


def declared(chain: ChainSettings, url: Optional[str] = None) -> ChainSettings:
    with connect(url) as connection:
        declare(connection.channel(), build(chain))
    return chain


@contextlib.contextmanager
def chains(url: Optional[str] = None, cleanup: Callable[[], bool] = lambda: True):
    """A `make(**settings)` that declares a chain under a unique prefix; every chain made
    is deleted afterwards (when `cleanup()` says the broker is still there)."""
    made = []

    def make(**settings) -> ChainSettings:
        settings.setdefault("prefix", unique_prefix())
        made.append(declared(ChainSettings(**settings), url))
        return made[-1]

    yield make
    if cleanup():
        for chain in made:
            remove(chain, url)


def remove(chain: ChainSettings, url: Optional[str] = None) -> None:
    try:
        with connect(url) as connection:
            delete(connection.channel(), build(chain))
    except pika.exceptions.AMQPError:
        pass


# Figures the running test measured: tests/conftest.py attaches them to the test's report,
# so they reach pytest's terminal summary (one section each) from any xdist worker.
FIGURES: List[Tuple[str, str]] = []


def report_figures(section: str, line: str) -> None:
    FIGURES.append((section, line))
    print(line)
