"""Publish many delayed messages, collect them at pick-up across faults, and count.

Every message carries its own id and the earliest moment it may arrive (the publisher's
clock read before the publish, plus the delay: the gateway's due time can only be later).
A message that arrives before that moment is early; one never received is lost.
"""

import random
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence

import pika
from pika.exceptions import AMQPError

from topology import ChainSettings

from ..support import now_ms, wait_until

SENT_AT = "x-test-sent-at"


def connect_any(urls: Sequence[str], attempts: int = 200, pause: float = 0.25) -> pika.BlockingConnection:
    """The first of `urls` that answers, retrying while brokers come back."""
    last = None
    for i in range(attempts):
        url = urls[i % len(urls)]
        try:
            params = pika.URLParameters(url)
            params.connection_attempts, params.socket_timeout = 1, 2
            return pika.BlockingConnection(params)
        except AMQPError as exc:
            last = exc
            time.sleep(pause)  # (a client's pause between attempts, as any client's: not a wait)
    raise RuntimeError(f"no broker answered at {urls}: {last!r}")


@dataclass
class Sent:
    message_id: str
    not_before_ms: int
    delay_ms: int


def publish(urls: Sequence[str], chain: ChainSettings, delays: Iterable[int], routing_key: str = "load",
            body: bytes = b"x", absolute: bool = False, rate: Optional[float] = None) -> List[Sent]:
    """Publish with confirms; a message counts as sent once the broker confirmed it (one it
    refuses is published again, with the same id). `absolute`: as `x-deliver-at`, so that
    the due time is exactly the one the test knows, not counted from check-in. `rate`: at
    most this many a second (`delays` may then be a generator that ends when the test says)."""
    sent: List[Sent] = []
    connection = connect_any(urls)
    channel = connection.channel()
    channel.confirm_delivery()
    started = time.monotonic()
    for n, delay in enumerate(delays):
        ahead = started + n / rate - time.monotonic() if rate else 0
        if ahead > 0:
            time.sleep(ahead)  # (pacing the load, as a publisher does: not a wait)
        message_id = uuid.uuid4().hex
        for _attempt in range(50):
            before = now_ms()
            when = {"x-deliver-at": before + delay} if absolute else {"x-delay": delay}
            try:
                channel.basic_publish(chain.names.check_in, routing_key, body, pika.BasicProperties(
                    message_id=message_id, delivery_mode=2, headers={**when, SENT_AT: before}),
                    mandatory=True)
                break
            except pika.exceptions.NackError:
                # Refused (a quorum queue between leaders): not sent; a publisher tries again.
                time.sleep(0.2)  # (its pause before it does)
        else:
            raise RuntimeError(f"the broker refused message {message_id} 50 times")
        sent.append(Sent(message_id, before + max(delay, 0), delay))
    connection.close()
    return sent


def mixed_delays(count: int, longest_ms: int, seed: int = 4) -> List[int]:
    """Delays from 0 to `longest_ms`: a tenth immediate, the rest spread evenly."""
    rng = random.Random(seed)
    return [0 if rng.random() < 0.1 else rng.randint(1, longest_ms) for _ in range(count)]


class Sink:
    """A durable queue bound to pick-up, consumed with manual acks, reconnecting to any of
    `urls` when its broker goes away (a redelivery then shows up as a duplicate, so the
    duplicate figure is an upper bound on the gateway's own)."""

    def __init__(self, urls: Sequence[str], chain: ChainSettings, pattern: str = "#",
                 queue_type: str = "quorum") -> None:
        self.urls, self.chain, self.pattern = list(urls), chain, pattern
        self.queue = f"{chain.prefix}.test-sink"
        self.arrivals: Dict[str, List[int]] = {}
        self.total = 0
        self.reconnects = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        with connect_any(self.urls) as connection:
            channel = connection.channel()
            channel.queue_declare(self.queue, durable=True, arguments={"x-queue-type": queue_type})
            channel.queue_bind(self.queue, chain.names.pick_up, pattern)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                connection = connect_any(self.urls)
                channel = connection.channel()
                channel.basic_qos(prefetch_count=500)
                channel.basic_consume(self.queue, self._on_message)
                while not self._stop.is_set():
                    connection.process_data_events(time_limit=0.05)
                connection.close()
            except (AMQPError, RuntimeError):
                self.reconnects += 1
                time.sleep(0.2)  # (a consumer's pause before it reconnects)

    def _on_message(self, channel, method, properties, body) -> None:
        at = now_ms()
        with self._lock:
            self.total += 1
            self.arrivals.setdefault(properties.message_id, []).append(at)
        channel.basic_ack(method.delivery_tag)

    def wait_for(self, ids: Sequence[str], timeout: float) -> bool:
        wanted = set(ids)

        def arrived() -> bool:
            with self._lock:
                return wanted <= self.arrivals.keys()
        return wait_until(arrived, timeout, interval=0.1, fail=False)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def delete(self) -> None:
        try:
            with connect_any(self.urls, attempts=4) as connection:
                connection.channel().queue_delete(self.queue)
        except (AMQPError, RuntimeError):
            pass


@dataclass
class Figures:
    name: str
    sent: int
    faults: int
    lost: int
    early: int
    duplicates: int
    extra: Dict[str, object] = field(default_factory=dict)
    lost_ids: List[str] = field(default_factory=list)
    early_ids: List[str] = field(default_factory=list)

    def line(self) -> str:
        more = "".join(f" {k}={v}" for k, v in self.extra.items())
        return (f"FAULTS {self.name}: sent={self.sent} faults={self.faults} lost={self.lost} "
                f"early={self.early} dup={self.duplicates}{more}")


def count(name: str, sent: Sequence[Sent], sink: Sink, faults: int, **extra) -> Figures:
    with sink._lock:
        arrivals = {k: list(v) for k, v in sink.arrivals.items()}
    lost = [s.message_id for s in sent if s.message_id not in arrivals]
    early = [s.message_id for s in sent if s.message_id in arrivals
             and min(arrivals[s.message_id]) < s.not_before_ms]
    ids = {s.message_id for s in sent}
    duplicates = sum(len(v) - 1 for k, v in arrivals.items() if k in ids)
    return Figures(name, len(sent), faults, len(lost), len(early), duplicates, dict(extra),
                   lost[:10], early[:10])


def where_are_they(urls: Sequence[str], chain: ChainSettings) -> dict:
    """Depths of the chain's queues and the reasons of parked messages: for failure messages."""
    from topology import build
    out: Dict[str, object] = {}
    try:
        with connect_any(urls, attempts=4) as connection:
            for q in build(chain).queues:
                channel = connection.channel()
                depth = channel.queue_declare(q.name, passive=True).method.message_count
                if depth:
                    out[q.name] = depth
            channel = connection.channel()
            reasons: Dict[str, int] = {}
            while True:
                method, properties, _ = channel.basic_get(chain.names.parked)
                if method is None:
                    break
                reason = str((properties.headers or {}).get("x-gateway-error"))
                reasons[reason] = reasons.get(reason, 0) + 1
            out["parked reasons"] = reasons  # unacked: they go back when the channel closes
    except (AMQPError, RuntimeError) as exc:
        out["error"] = repr(exc)
    return out
