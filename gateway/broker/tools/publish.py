"""Publishing delayed messages and watching pick-up: what `publish` and `demo` use."""

import json
from typing import Iterable, Optional

import pika

from topology import ChainSettings

from gateway.broker.plumbing import lazy_properties
from gateway.core.envelope import DELAY, DELIVER_AT


class Publisher:
    """A confirming publisher to check-in: `send` returns once the broker has the message."""

    def __init__(self, channel, chain: ChainSettings) -> None:
        self.channel, self.exchange = channel, chain.names.check_in
        channel.confirm_delivery()

    def send(self, body: bytes, routing_key: str = "", delay_ms: Optional[int] = None,
             deliver_at_ms: Optional[int] = None, headers: Optional[dict] = None,
             **properties) -> None:
        headers = dict(headers or {})
        if delay_ms is not None:
            headers[DELAY] = delay_ms
        if deliver_at_ms is not None:
            headers[DELIVER_AT] = deliver_at_ms
        properties.setdefault("delivery_mode", 2)
        # mandatory: if check-in is not declared the publish fails here, not silently.
        # (lazy_properties.encoded: a float header, e.g. --header f=1.5, goes as an AMQP double)
        self.channel.basic_publish(self.exchange, routing_key, body,
                                   lazy_properties.encoded(pika.BasicProperties(headers=headers or None, **properties)),
                                   mandatory=True)


def parse_headers(pairs: Iterable[str]) -> dict:
    headers = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"--header {pair!r}: expected NAME=VALUE")
        try:
            headers[name] = json.loads(value)
        except json.JSONDecodeError:
            headers[name] = value
    return headers
