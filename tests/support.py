"""Helpers for tests that talk to a real broker and run the real gateway process."""

import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import pika

from . import launcher
from .launcher import ROOT, chain_args, free_port  # noqa: F401 (tests import them from here)
from .wait import wait_until  # (the one way tests wait: they import it from here)
from gateway.broker.plumbing import wire_connection
from gateway.settings import DEFAULT_URL, default
from topology import ChainSettings, build
from topology.broker.declare import declare, delete


RMQ4 = ("rmq4.3", "rmq4.0")  # the 4.x brokers: 3.12+ features (the arrival stamp), Khepri, AMQP 1.0

# What a gateway says once at start about the broker it runs on (warnings, not troubles):
# tests that want no warning from a run leave these aside.
START_NOTICES = ("arrival_stamp_off", "cancels_need_one_check_in_consumer")

# The gateways tests start run the defaults: what is due within 10 s (--hold-within-ms) goes
# from check-in straight to the distributor, which holds it (the shorter path). A test about
# what waits in the chain's levels or meditation (a level's TTL, laps, the chain's exits,
# per-level counts) passes these flags, with a comment saying why: then only what is due
# within about a unit skips the chain.
CHAIN_PATH = ("--hold-within-ms", "0")

# The broker of the test running now (tests/conftest.py sets it from the `broker` fixture,
# which is parametrized over the broker versions); None means the main one.
_current_url: Optional[str] = None


def main_broker_url() -> str:
    """The shared RabbitMQ 3.10 node (or the user's own broker, DELAY_GATEWAY_URL)."""
    return os.environ.get("DELAY_GATEWAY_URL", DEFAULT_URL).split(",")[0]


def clock_env(offset: str = "", file: Optional[str] = None) -> Dict[str, str]:
    """The environment that runs a process with its wall clock moved by `offset` (libfaketime's
    FAKETIME: "-10s" behind, "+5s" ahead; scripts/bootstrap installs Debian's libfaketime), or
    by what `file` says at each reading (write "+5s" into it to step the clock), its monotonic
    clock left alone (timers, backoff)."""
    import glob
    found = sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1"))
    assert found, "libfaketime is missing: scripts/bootstrap test installs it (Debian's faketime)"
    env = {"LD_PRELOAD": found[0], "FAKETIME_DONT_FAKE_MONOTONIC": "1", "FAKETIME_NO_CACHE": "1"}
    env.update({"FAKETIME_TIMESTAMP_FILE": file} if file is not None else {"FAKETIME": offset})
    return env


def broker_url() -> str:
    return _current_url or main_broker_url()


def use_broker(url: Optional[str]) -> None:
    global _current_url
    _current_url = url


def examples(full: int) -> int:
    """A property test's budget: `full` examples in the test command (HYPOTHESIS_PROFILE=full,
    scripts/test), a tenth (at least 10) in the quick profile a developer runs by default."""
    return full if os.environ.get("HYPOTHESIS_PROFILE", "quick") == "full" else max(10, full // 10)


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


# A test that checks that nothing more arrives (a cancelled message, a duplicate, one that
# is parked) publishes a sentinel last, due after everything it expects, and waits for it
# instead of for a quiet moment: the distributor releases what it holds in due order, and
# the chain hands it each message a lead (and at most one resolution unit more) before its
# due time, so once the sentinel arrived nothing due before it can still come.
SENTINEL = "sentinel"
SENTINEL_MARGIN_MS = 200  # beyond the lead and a unit: replicas reading check-in side by side


def sentinel_after(last_ms: int, chain: ChainSettings, lead_ms: Optional[int] = None) -> int:
    """The sentinel's delay (or due time) for messages whose longest delay (or last due
    time) is `last_ms`: more than the gateway's lead (its default unless given) and one
    resolution unit of `chain` later."""
    return last_ms + (default("lead_ms") if lead_ms is None else lead_ms) + chain.resolution_ms + SENTINEL_MARGIN_MS


def publish_sentinel(chain: ChainSettings, last_ms: int, lead_ms: Optional[int] = None, absolute: bool = False,
                     routing_key: str = "sentinel", url: Optional[str] = None) -> int:
    """Publish (confirmed) the sentinel into check-in, after everything else: `last_ms` is
    the longest x-delay of what the test published before it (a delay counts from check-in,
    or from the broker's arrival stamp: both later for a message published later), or with
    `absolute` the last due time (epoch ms) of what it expects, and then the sentinel goes
    as x-deliver-at. Returns its x-delay or x-deliver-at. `routing_key` must reach the test's
    receiver; `Receiver.until_sentinel` waits for it."""
    when = sentinel_after(last_ms, chain, lead_ms)
    with connect(url) as connection:
        channel = connection.channel()
        channel.confirm_delivery()
        channel.basic_publish(chain.names.check_in, routing_key, b"sentinel", pika.BasicProperties(
            message_id=SENTINEL, delivery_mode=2, headers={"x-deliver-at" if absolute else "x-delay": when}),
            mandatory=True)
    return when


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
        self.sentinels = 0  # sentinels taken that no until_sentinel has waited for yet

    def take(self, limit: int = 10**9) -> List[Received]:
        """What has arrived by now (up to `limit` messages in all), added to `messages`; a
        sentinel is not kept, and ends the look (`until_sentinel`)."""
        while len(self.messages) < limit:
            method, properties, body = self.channel.basic_get(self.queue, auto_ack=True)
            if method is None:
                break
            if properties.message_id == SENTINEL:
                self.sentinels += 1
                break
            self.messages.append(Received(method.routing_key, properties, body, now_ms(), method.exchange))
        return self.messages

    def collect(self, count: int, timeout: float) -> List[Received]:
        """`messages` once it holds `count`, or when `timeout` s have passed (for a test that
        checks what came). Waiting for nothing more to come is no test: publish a sentinel
        instead and wait for it (`until_sentinel`)."""
        wait_until(lambda: len(self.take(count)) >= count, timeout, interval=0.002, fail=False,
                   sleep=self.connection.sleep)
        return self.messages

    def until_sentinel(self, timeout: float) -> List[Received]:
        """`messages` once the sentinel (`publish_sentinel`) arrived, a test failure if it did
        not within `timeout` s. The sentinel itself is not kept, and nothing after it is read:
        it was due after everything the test waits for, so all that came before it."""
        def arrived() -> bool:
            if not self.sentinels:
                self.take()
            return self.sentinels > 0
        wait_until(arrived, timeout, interval=0.002, sleep=self.connection.sleep, what="the sentinel at pick-up")
        self.sentinels -= 1
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


def next_message(channel, queue: str, timeout: float, what: str = "", auto_ack: bool = True) -> tuple:
    """(method, properties, body) of the next message in `queue`, or a test failure naming
    `what` when none came within `timeout` s."""
    def got():
        method, properties, body = channel.basic_get(queue, auto_ack=auto_ack)
        return method is not None and (method, properties, body)
    return wait_until(got, timeout, interval=0.02, what=what or f"a message in {queue}",
                      sleep=channel.connection.sleep)


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
