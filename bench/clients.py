"""The benchmark's AMQP clients: a publisher with confirms, and a receiver in a process of its own.

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
from typing import Callable, Dict, List, Optional, Tuple

import pika

HEAD = struct.Struct("<qd")  # message number, due time (epoch ms)


def now_ms() -> float:
    return time.time() * 1000.0


def body(i: int, due_ms: float, size: int) -> bytes:
    return HEAD.pack(i, due_ms) + b"x" * max(0, size - HEAD.size)


def blocking(url: str, name: str = "delay-gateway bench") -> pika.BlockingConnection:
    params = pika.URLParameters(url)
    params.client_properties = {"connection_name": name}
    return pika.BlockingConnection(params)


class _Pending(dict):
    """An insertion-ordered dict of sequence numbers with a cheap 'pop the oldest'."""

    def popitem_first(self) -> int:
        key = next(iter(self))
        del self[key]
        return key


# make(i) -> (exchange, routing key, properties, body, due ms); called just before the publish
Make = Callable[[int], Tuple[str, str, pika.BasicProperties, bytes, float]]


class Publisher:
    """Publishes n messages with confirms, at most `window` unconfirmed, optionally at a
    fixed rate."""

    def __init__(self, url: str, n: int, make: Make, rate: Optional[float] = None, window: int = 2000,
                 confirm_timeout_s: float = 60.0) -> None:
        self.url, self.n, self.make, self.rate, self.window = url, n, make, rate, window
        self.confirm_timeout_s = confirm_timeout_s
        self._last_confirm = 0.0
        self._pending = _Pending()  # publish sequence numbers not yet confirmed, in order
        self.due: List[float] = []
        self.sent = 0
        self.acked = 0
        self.nacked = 0
        self.confirm_times: List[float] = []  # one per confirmed message, s since start (for the chart)
        self.start = self.end = 0.0
        self.error: Optional[str] = None

    def run(self) -> "Publisher":
        params = pika.URLParameters(self.url)
        params.client_properties = {"connection_name": "delay-gateway bench publisher"}
        self._conn = pika.SelectConnection(
            params, on_open_callback=self._on_open,
            on_open_error_callback=lambda c, e: self._fail(e), on_close_callback=lambda c, r: c.ioloop.stop())
        self._conn.ioloop.start()
        if self.error:
            raise RuntimeError(f"publisher failed: {self.error}")
        return self

    def _close(self) -> None:
        if self._conn.is_open:
            self._conn.close()

    def _fail(self, error) -> None:
        self.error = str(error)
        self._conn.ioloop.stop()

    def _on_open(self, conn) -> None:
        conn.channel(on_open_callback=self._on_channel)

    def _on_channel(self, ch) -> None:
        self._ch = ch
        ch.add_on_close_callback(self._on_channel_closed)
        ch.confirm_delivery(self._on_confirm, callback=lambda _: self._begin())

    def _on_channel_closed(self, ch, reason) -> None:
        if self.acked + self.nacked < self.n:
            self.error = f"channel closed: {reason}"
        self._close()

    def _begin(self) -> None:
        self.start = time.monotonic()
        self._tick()

    def _tick(self, timer: bool = True) -> None:
        allowed = self.n if self.rate is None else min(
            self.n, int((time.monotonic() - self.start) * self.rate) + 1)
        while self.sent < allowed and self.sent - self.acked - self.nacked < self.window:
            exchange, key, props, payload, due = self.make(self.sent)
            self._ch.basic_publish(exchange, key, payload, props)
            self.due.append(due)
            self.sent += 1
            self._pending[self.sent] = True  # delivery tags count from 1 on a channel
        if timer and self.sent < self.n:
            self._conn.ioloop.call_later(0.002, self._tick)
        elif timer:
            self._watch()

    def _watch(self) -> None:
        """All sent: give up on confirms that do not come (reported as unconfirmed)."""
        if self.acked + self.nacked >= self.n:
            return
        if time.monotonic() - max(self._last_confirm, self.start) > self.confirm_timeout_s:
            self.end = time.monotonic()
            self._close()
        else:
            self._conn.ioloop.call_later(0.5, self._watch)

    @property
    def unconfirmed(self) -> int:
        return self.sent - self.acked - self.nacked

    def _on_confirm(self, frame) -> None:
        m = frame.method
        self._last_confirm = time.monotonic()
        # Confirms may come out of order (a single ack for a later message before a
        # multiple ack that covers earlier ones): track each publish, never count by tag.
        if m.multiple:
            tags = []
            while self._pending and next(iter(self._pending)) <= m.delivery_tag:
                tags.append(self._pending.popitem_first())
        else:
            tags = [m.delivery_tag] if self._pending.pop(m.delivery_tag, False) else []
        count = len(tags)
        if isinstance(m, pika.spec.Basic.Ack):
            self.acked += count
            t = time.monotonic() - self.start
            self.confirm_times.extend([t] * count)
        else:
            self.nacked += count
        if self.acked + self.nacked >= self.n:
            self.end = time.monotonic()
            self._close()
        elif self.rate is None or self.sent >= self.n:
            self._tick(timer=False)

    @property
    def seconds(self) -> float:
        return self.end - self.start

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
