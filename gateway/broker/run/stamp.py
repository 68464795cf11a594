"""Whether the broker stamps arrival times: asked once, when the gateway starts.

RabbitMQ 3.12+ can stamp every incoming publish with the moment it arrived (the message
interceptor `set_header_timestamp`, off by default); `x-delay` then counts from that moment.
Without it `x-delay` counts from when the check-in consumer reads the message, which a
backlog makes later. A gateway on a 3.12+ broker without the stamp says so once, at start,
with the configuration line that turns it on: `arrival_stamp_off`.

The broker's version comes from the connection's server properties; whether the stamp is on
from a probe: one message published to an exchange and an exclusive queue of the gateway's
own prefix (the only names a least-privileged gateway may use), read back and deleted.
"""

import os
import re
from typing import Mapping, Optional, Tuple

import pika
import structlog
from pika.exceptions import AMQPError

from gateway.broker.plumbing.amqp import blocking_channel
from gateway.core.envelope import ARRIVED
from gateway.settings import Settings

STAMP_CONFIG = "message_interceptors.incoming.set_header_timestamp.overwrite = false"
FIRST_WITH_STAMP = (3, 12)
PROBE_WAIT_S = 5.0


def version_of(server_properties: Optional[Mapping]) -> Optional[Tuple[int, int]]:
    """(major, minor) from a broker's server properties; None when it does not say."""
    raw = (server_properties or {}).get("version")
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw or "")
    found = re.match(r"(\d+)\.(\d+)", text)
    return (int(found.group(1)), int(found.group(2))) if found else None


def probe(channel, prefix: str) -> bool:
    """Whether a message published now arrives with the broker's stamp."""
    name = f"{prefix}.stamp-probe.{os.urandom(6).hex()}"
    channel.exchange_declare(name, "fanout", durable=False, auto_delete=True)
    try:
        channel.queue_declare(name, exclusive=True, auto_delete=True)
        channel.queue_bind(name, name)
        channel.confirm_delivery()
        channel.basic_publish(name, "", b"", pika.BasicProperties(delivery_mode=1))
        # Confirmed, so it is in the queue: the first get finds it (the loop is for safety).
        for _ in range(int(PROBE_WAIT_S / 0.05)):
            method, properties, _ = channel.basic_get(name, auto_ack=True)
            if method is not None:
                return ARRIVED in (properties.headers or {})
            channel.connection.sleep(0.05)
        raise TimeoutError(f"the probe message did not arrive within {PROBE_WAIT_S:.0f} s")
    finally:
        if channel.is_open:
            channel.queue_delete(name)
            channel.exchange_delete(name)


# What a cancel can promise (docs/cancelling.md), by whether the broker stamps arrivals.
EXACT = "exact"  # the stamp: any number of check-in consumers
ONE_CONSUMER = "one check-in consumer"  # no stamp: exact while one process consumes check-in


def guarantee(stamp_on: Optional[bool]) -> str:
    return EXACT if stamp_on else ONE_CONSUMER


def cancel_fix(version: Optional[Tuple[int, int]]) -> str:
    """What removes the limit of cancels without the stamp, on this broker."""
    if version is not None and version >= FIRST_WITH_STAMP:
        return f"add `{STAMP_CONFIG}` to rabbitmq.conf, or run one gateway that consumes check-in"
    return ("run one gateway that consumes check-in (the others with --role distributor), or RabbitMQ 3.12+ "
            f"with `{STAMP_CONFIG}`")


def state(channel, prefix: str) -> Tuple[Optional[Tuple[int, int]], Optional[bool]]:
    """(the broker's version, whether it stamps arrivals: None when that cannot be known)."""
    # pika keeps the server properties on the connection beneath the blocking one.
    version = version_of(getattr(channel.connection._impl, "server_properties", None))
    if version is None or version < FIRST_WITH_STAMP:
        return version, False
    return version, probe(channel, prefix)


def check(url: str, settings: Settings, log: structlog.stdlib.BoundLogger) -> None:
    """Log what the broker does about arrival times (only where x-delay is read: check-in),
    and once what that means for cancels. A broker that cannot be reached raises
    BrokerError: the caller asks again on its next connection. Anything else the probe meets
    makes the answer "unknown", never a failure."""
    if settings.role not in ("all", "check-in"):
        return
    with blocking_channel(url, "delay-gateway arrival stamp probe", settings.tls) as channel:
        version = version_of(getattr(channel.connection._impl, "server_properties", None))
        try:
            _, stamped = state(channel, settings.chain.prefix)
        except (AMQPError, TimeoutError) as exc:
            log.info("arrival_stamp", state="unknown", reason=str(exc) or type(exc).__name__)
            stamped = None
    shown = version and "{}.{}".format(*version)
    if stamped:
        log.info("arrival_stamp", state="on", broker_version=shown, x_delay_counts_from="arrival",
                 cancels=EXACT)
        return
    if version is None or version < FIRST_WITH_STAMP:
        log.info("arrival_stamp", state="unavailable", broker_version=shown, x_delay_counts_from="check-in")
    elif stamped is False:
        log.warning("arrival_stamp_off", broker_version=shown, x_delay_counts_from="check-in",
                    fix=f"add `{STAMP_CONFIG}` to rabbitmq.conf to count x-delay from the broker's arrival time")
    log.warning("cancels_need_one_check_in_consumer", cancels=ONE_CONSUMER,
                limit="without the broker's arrival stamp, a cancel is exact only while one gateway process "
                      "consumes check-in; with several, a message and its cancel read by different ones can be "
                      "read in either order (docs/cancelling.md, Limits)", fix=cancel_fix(version))
