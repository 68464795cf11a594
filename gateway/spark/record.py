"""`delay-gateway record`: one JSON line per delivery at pick-up, for `report`.

A consumer like any other: its queue is bound to `<prefix>.pick-up` with a routing-key
pattern. Each line holds the message id, routing key, due time, arrival time (this
process's clock when the delivery was read), whether the broker flagged it redelivered,
and what is known of when it was published and with which delay. A delivery is
acknowledged only after its line was written and flushed, so a crash can repeat a line
(the report counts repeated message ids) but never lose one.

The due time comes from the header `x-gateway-due-at`, which the gateway adds only when
it runs with `--stamp-due-at`; without it, the publisher's own `x-deliver-at` is used if
the message has one.
"""

import argparse
import json
import signal
import sys
import threading
import time
import uuid
from typing import Any, Dict, IO, Optional, Sequence, Union

import pika
import structlog

from gateway import stopping
from gateway.broker.plumbing.amqp import BrokerError, classify, connect
from gateway.clock import wall_ms
from gateway.settings import Settings

log = structlog.get_logger("record")

STAMP = "x-gateway-due-at"
DELIVER_AT = "x-deliver-at"
DELAY = "x-delay"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="-", metavar="PATH", help="append the lines to this file (default: stdout)")
    p.add_argument("--routing-key-pattern", default="#", metavar="PATTERN",
                   help="bind to pick-up with this pattern (default #: everything)")
    p.add_argument("--queue", metavar="NAME", help="a durable queue of this name, kept after exit so nothing is "
                   "missed between runs (default: an exclusive queue <prefix>.record.<random>, gone at exit)")
    p.add_argument("--count", type=int, default=0, metavar="N", help="stop after N deliveries (default: run "
                   "until SIGINT or SIGTERM)")
    p.add_argument("--idle-timeout", type=float, default=0, metavar="SECONDS",
                   help="stop after this long without a delivery (default 0: never)")
    p.add_argument("--prefetch", dest="record_prefetch", type=int, default=1000, metavar="N",
                   help="unacknowledged deliveries (default 1000)")


def line(method, properties, arrived_ms: int) -> Dict[str, Any]:
    """The record of one delivery (pure)."""
    headers = properties.headers or {}
    stamp, deliver_at, delay = headers.get(STAMP), headers.get(DELIVER_AT), headers.get(DELAY)
    due, source = None, None
    if _ms(stamp) is not None:
        due, source = _ms(stamp), "stamp"
    elif _ms(deliver_at) is not None:
        due, source = _ms(deliver_at), DELIVER_AT
    published = properties.timestamp * 1000 if isinstance(properties.timestamp, int) else None
    if _ms(delay) is not None:
        delay_ms = max(_ms(delay) or 0, 0)
    elif due is not None and published is not None:
        delay_ms = due - published  # AMQP timestamps are whole seconds: within a second
    else:
        delay_ms = None
    key = method.routing_key
    return {"message_id": properties.message_id,
            "routing_key": key.decode("utf-8", "backslashreplace") if isinstance(key, bytes) else key,
            "due_at": due, "due_source": source, "arrived_at": arrived_ms,
            "redelivered": bool(method.redelivered), "published_at": published, "delay_ms": delay_ms}


def _ms(value: Any) -> Optional[int]:
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value


class DeliveryRecorder:
    """Consumes from a queue bound to pick-up and writes lines to `out` until stopped."""

    def __init__(self, urls: Union[str, Sequence[str]], pick_up: str, out: IO[str], pattern: str = "#",
                 queue: Optional[str] = None, prefix: str = "delay", prefetch: int = 1000, tls=None) -> None:
        self.urls, self.pick_up, self.out, self.pattern = urls, pick_up, out, pattern
        self.durable = queue is not None
        self.queue = queue or f"{prefix}.record.{uuid.uuid4().hex[:8]}"
        self.prefetch, self.tls = prefetch, tls
        self.count = 0
        self.without_stamp = 0
        self.ready = threading.Event()
        self.stopping = threading.Event()

    def run(self, limit: int = 0, idle_timeout: float = 0) -> int:
        connection, url = connect(self.urls, "delay-gateway record", self.tls)
        try:
            channel = connection.channel()
            channel.queue_declare(self.queue, durable=self.durable, exclusive=not self.durable,
                                  auto_delete=not self.durable)
            channel.queue_bind(self.queue, self.pick_up, self.pattern)
            channel.basic_qos(prefetch_count=self.prefetch)
            log.info("record_consuming", queue=self.queue, pick_up=self.pick_up, pattern=self.pattern)
            self.ready.set()
            self._consume(channel, limit, idle_timeout)
        except (pika.exceptions.ChannelClosedByBroker, pika.exceptions.ConnectionClosedByBroker) as exc:
            raise BrokerError(classify(exc, url)) from None
        finally:
            if connection.is_open:
                connection.close()
        return self.count

    def _consume(self, channel, limit: int, idle_timeout: float) -> None:
        last = time.monotonic()
        batch, tag = [], None
        for method, properties, _body in channel.consume(self.queue, inactivity_timeout=0.2):
            if method is not None:
                record = line(method, properties, wall_ms())
                if record["due_source"] != "stamp":
                    self.without_stamp += 1
                batch.append(json.dumps(record, separators=(",", ":")))
                tag = method.delivery_tag
                last = time.monotonic()
            full = limit and self.count + len(batch) >= limit
            if batch and (method is None or len(batch) >= 500 or full):
                self.out.write("\n".join(batch) + "\n")
                self.out.flush()
                channel.basic_ack(tag, multiple=True)  # only once the lines are written
                self.count += len(batch)
                batch = []
            if full or self.stopping.is_set() or (idle_timeout and time.monotonic() - last > idle_timeout):
                break
        channel.cancel()  # unacknowledged deliveries go back to the queue

    def stop(self) -> None:
        self.stopping.set()


def run(settings: Settings, out: str, routing_key_pattern: str, queue: Optional[str], count: int,
        idle_timeout: float, record_prefetch: int) -> int:
    """`delay-gateway record` (its --prefetch is `record_prefetch`: not the gateway's setting)."""
    chain = settings.chain
    into = sys.stdout if out == "-" else open(out, "a", encoding="utf-8")
    recorder = DeliveryRecorder(settings.one_vhost_urls, chain.names.pick_up, into, routing_key_pattern, queue,
                                chain.prefix, record_prefetch, settings.tls)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stopping.setter(recorder.stopping))
    try:
        recorded = recorder.run(count, idle_timeout)
    finally:
        if into is not sys.stdout:
            into.close()
    print(f"recorded {recorded} deliveries" + (f" to {out}" if out != "-" else ""), file=sys.stderr)
    if recorded and recorder.without_stamp == recorded:
        print("note: no delivery carried x-gateway-due-at: run the gateway with --stamp-due-at for due times",
              file=sys.stderr)
    return 0
