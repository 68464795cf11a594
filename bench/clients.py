"""The benchmark's AMQP clients: a publisher with confirms, a receiver in a process of its own,
and the few queue operations every scenario uses (a depth, a delete).

Every message body starts with its number and its due time (epoch ms, a double, on the
publisher's clock): the publish time plus its `x-delay`, or its `x-deliver-at`. The
receiver notes the time each one arrives on the same host's clock; lateness is the
difference, exactly what a user of the gateway or of the plugin would measure.
"""

import json
import multiprocessing
import os
import signal
import struct
import time
import uuid
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import pika

from gateway.broker.tools.window import Outgoing, PublishError, WindowPublisher

HEAD = struct.Struct("<qd")  # message number, due time (epoch ms)


def now_ms() -> float:
    return time.time() * 1000.0


def body(i: int, due_ms: float, size: int) -> bytes:
    return HEAD.pack(i, due_ms) + b"x" * max(0, size - HEAD.size)


def blocking(url: str, name: str = "delay-gateway bench") -> pika.BlockingConnection:
    params = pika.URLParameters(url)
    params.client_properties = {"connection_name": name}
    return pika.BlockingConnection(params)


def queue_depth(url: str, *queues: str) -> int:
    """Ready messages in these queues, together (a passive declare of each)."""
    with blocking(url) as c:
        ch = c.channel()
        return sum(ch.queue_declare(q, passive=True).method.message_count for q in queues)


def delete_queue(url: str, queue: str) -> None:
    """Delete `queue` if the broker lets us: cleaning up after a run, never failing it."""
    try:
        with blocking(url) as c:
            c.channel().queue_delete(queue)
    except pika.exceptions.AMQPError:
        pass


# make(i) -> (exchange, routing key, properties, body, due ms); called just before the publish
Make = Callable[[int], Tuple[str, str, pika.BasicProperties, bytes, float]]


class Publisher:
    """Publishes n messages with confirms, at most `window` unconfirmed, optionally at a
    fixed rate: the gateway's own confirm-window publisher, noting each message's due time."""

    def __init__(self, url: str, n: int, make: Make, rate: Optional[float] = None, window: int = 2000,
                 confirm_timeout_s: float = 60.0) -> None:
        self.n = n
        self.due: List[float] = []

        def items() -> Iterator[Outgoing]:
            for i in range(n):
                exchange, key, props, payload, due = make(i)
                self.due.append(due)
                yield exchange, key, props, payload

        # a refused publish is not retried: it is what the benchmark counts as lost
        self._w = WindowPublisher([url], items(), "delay-gateway bench publisher", window=window,
                                  max_rate=rate or 0.0, mandatory=False, nack_attempts=0,
                                  confirm_timeout_s=confirm_timeout_s, tick_s=0.002)

    def run(self) -> "Publisher":
        try:
            self._w.run()
        except PublishError as exc:
            raise RuntimeError(f"publisher failed: {exc}") from None
        return self

    @property
    def sent(self) -> int:
        return self._w.sent

    @property
    def acked(self) -> int:
        return self._w.acked

    @property
    def nacked(self) -> int:
        return self._w.nacked

    @property
    def unconfirmed(self) -> int:
        return self._w.unconfirmed

    @property
    def confirm_times(self) -> List[float]:
        return self._w.confirm_times

    @property
    def seconds(self) -> float:
        return self._w.seconds

    @property
    def rate_achieved(self) -> float:
        return self.acked / self.seconds if self.seconds > 0 else 0.0


# -- receiver --------------------------------------------------------------------------
def declare_receiver_queue(url: str, queue: str, queue_type: str, exchange: str, key: str = "#") -> None:
    """A durable queue of the user's, bound to where delayed messages come out."""
    with blocking(url) as c:
        ch = c.channel()
        ch.queue_declare(queue, durable=True, arguments={"x-queue-type": queue_type})
        ch.queue_bind(queue, exchange, key)


def _receive(url: str, queue: str, out: str, ready, stop, expected: int, count) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = blocking(url, "delay-gateway bench receiver")
    ch = conn.channel()
    ids, dues, recv = [], [], []
    unpack, clock = HEAD.unpack_from, time.time

    def on_message(_ch, _m, _p, payload):
        t = clock() * 1000.0
        i, due = unpack(payload)
        ids.append(i)
        dues.append(due)
        recv.append(t)

    ch.basic_qos(prefetch_count=5000)
    ch.basic_consume(queue, on_message, auto_ack=True)
    ready.set()
    parent = os.getppid()
    while not stop.is_set() and len(ids) < expected and os.getppid() == parent:  # not orphaned
        conn.process_data_events(time_limit=0.05)
        count.value = len(ids)
    conn.close()
    with open(out, "w") as f:
        json.dump({"id": ids, "due": dues, "recv": recv}, f)


class Receiver:
    """A child process consuming `queue`; records (number, due, arrival time) of every message."""

    def __init__(self, url: str, queue: str, out_dir: str, expected: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.path = os.path.join(out_dir, f"recv-{uuid.uuid4().hex[:8]}.json")
        self.ready, self.stop_event = ctx.Event(), ctx.Event()
        self.count = ctx.Value("q", 0, lock=False)
        self.proc = ctx.Process(target=_receive, daemon=True, args=(
            url, queue, self.path, self.ready, self.stop_event, expected, self.count))
        self.proc.start()
        if not self.ready.wait(30):
            self.proc.kill()
            raise RuntimeError("receiver did not start")

    def wait(self, timeout: float, idle_s: float = 15.0) -> None:
        """Until everything arrived, or `timeout` has passed and nothing more arrived for
        `idle_s` (so a slow drain is measured as late, and only what never comes as lost)."""
        self.proc.join(timeout)
        last, last_change = self.count.value, time.monotonic()
        while self.proc.is_alive():
            self.proc.join(1.0)
            if self.count.value != last:
                last, last_change = self.count.value, time.monotonic()
            elif time.monotonic() - last_change > idle_s:
                break

    def stop(self) -> Dict[str, list]:
        self.stop_event.set()
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
        with open(self.path) as f:
            data = json.load(f)
        os.remove(self.path)
        return data
