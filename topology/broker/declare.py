"""Declare (or delete) a topology on a broker through a pika BlockingChannel."""

import re
from typing import Optional

from pika.exceptions import ChannelClosedByBroker

from topology.model import Queue, Topology


class TopologyConflict(RuntimeError):
    """The broker holds an object of the same name declared with other arguments."""


class TopologyMissing(TopologyConflict):
    """An object of the topology is not on the broker."""


def declare(channel, topology: Topology) -> None:
    """Idempotent: declaring the same topology again changes nothing."""
    for what, name, call in _steps(channel, topology):
        try:
            call()
        except ChannelClosedByBroker as exc:
            if exc.reply_code == 406:
                raise TopologyConflict(
                    f"{what} {name!r} already exists with other arguments ({exc.reply_text}): "
                    "something else declared it, or an older version of the gateway did. Queue and "
                    "exchange arguments cannot change once declared: delete it once it is empty, or "
                    "use another --prefix"
                ) from exc
            raise


def verify(channel, topology: Topology) -> None:
    """For `run --no-declare`: every exchange of the topology exists. Queues need no check
    (consuming a missing one fails at once), but a missing exchange shows only when a message
    is dead-lettered to it; a definitions export of RabbitMQ 3.10 leaves out internal
    exchanges, so an import alone can lack the chain's `returning` entrance."""
    for e in topology.exchanges:
        try:
            channel.exchange_declare(e.name, passive=True)
        except ChannelClosedByBroker as exc:
            if exc.reply_code == 404:
                raise TopologyMissing(
                    f"exchange {e.name!r} does not exist on this broker: run `delay-gateway declare` with the same "
                    "settings (a definitions export can leave out internal exchanges), or run without --no-declare"
                ) from exc
            raise


def _steps(channel, topology: Topology):
    for e in topology.exchanges:
        yield "exchange", e.name, lambda e=e: channel.exchange_declare(
            e.name, e.type, durable=True, internal=e.internal, arguments=dict(e.arguments))
    for q in topology.queues:
        if q.declared_once:
            yield "queue", q.name, lambda q=q: _declare_once(channel, q)
        else:
            yield "queue", q.name, lambda q=q: channel.queue_declare(
                q.name, durable=True, arguments=dict(q.arguments))
    for b in topology.bindings:
        if b.destination_type == "queue":
            yield "binding", b.destination, lambda b=b: channel.queue_bind(
                b.destination, b.source, routing_key=b.routing_key)
        else:
            yield "binding", b.destination, lambda b=b: channel.exchange_bind(
                b.destination, b.source, routing_key=b.routing_key)


def _declare_once(channel, q: Queue) -> None:
    """Declare a queue with its arguments only if it does not exist (Queue.declared_once). A
    passive declare of a missing queue closes its channel: it goes on one of its own."""
    probe = channel.connection.channel()
    try:
        probe.queue_declare(q.name, passive=True)
        probe.close()
    except ChannelClosedByBroker as exc:
        if exc.reply_code != 404:
            raise
        channel.queue_declare(q.name, durable=True, arguments=dict(q.arguments))


_UNITS_S = {"Y": 365 * 86_400, "M": 30 * 86_400, "D": 86_400, "h": 3_600, "m": 60, "s": 1}


def max_age_s(text: str) -> Optional[float]:
    """A stream's x-max-age ('1209600s', '14D', ...; RabbitMQ 4 reports it in milliseconds,
    without a unit) in seconds; None if it cannot be read."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([YMDhms]?)", text.strip())
    if not match:
        return None
    return float(match.group(1)) * _UNITS_S[match.group(2)] if match.group(2) else float(match.group(1)) / 1000


def short_retention(channel, topology: Topology) -> Optional[str]:
    """What to say when a stream declared once (the cancellations) keeps less than this
    topology wants: its arguments cannot change, so a longer window set later applies to the
    gateways' memory, not to what the stream keeps. None when it keeps enough (or is new)."""
    for q in topology.queues:
        wanted = max_age_s(str(q.arguments.get("x-max-age", "")))
        if not q.declared_once or wanted is None:
            continue
        probe = channel.connection.channel()
        try:
            probe.queue_declare(q.name, durable=True, arguments=dict(q.arguments))
            probe.close()
            continue
        except ChannelClosedByBroker as exc:
            found = re.search(r"inequivalent arg 'x-max-age'.*current is '([^']+)'", exc.reply_text or "")
            kept = max_age_s(found.group(1)) if found else None
            if exc.reply_code != 406 or kept is None or kept >= wanted:
                continue
        return (f"the stream {q.name!r} keeps records for {kept:g} s (its x-max-age, fixed when it was first "
                f"declared), less than the {wanted:g} s the settings want: a cancel older than that is gone from "
                "it, and a gateway started later does not know it. To keep more, delete the stream while no "
                "cancel or rule matters (no message waits that one concerns), then start a gateway or run "
                "`delay-gateway declare`; or lower --cancel-retention to what it keeps")
    return None


def delete(channel, topology: Topology) -> None:
    """Remove every queue and exchange of the topology, with the messages they hold."""
    for q in topology.queues:
        channel.queue_delete(q.name)
    for e in topology.exchanges:
        channel.exchange_delete(e.name)
