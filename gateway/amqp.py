"""Connecting to the broker: parameters from URLs, and a blocking connection for one-off work."""

import contextlib
import ssl
from typing import Iterator

import pika

from .settings import redact


def parameters(url: str, name: str = "delay-gateway") -> pika.URLParameters:
    params = pika.URLParameters(url)
    params.client_properties = {"connection_name": name}
    if url.startswith("amqps://") and params.ssl_options is None:
        params.ssl_options = pika.SSLOptions(ssl.create_default_context(), params.host)
    return params


class BrokerUnreachable(pika.exceptions.AMQPConnectionError):
    """No broker at this URL (the message names the URL, never its password)."""


@contextlib.contextmanager
def blocking_channel(url: str, name: str = "delay-gateway") -> Iterator:
    try:
        connection = pika.BlockingConnection(parameters(url, name))
    except pika.exceptions.AMQPConnectionError as exc:
        raise BrokerUnreachable(f"cannot connect to {redact(url)}: {exc!r}") from exc
    try:
        yield connection.channel()
    finally:
        if connection.is_open:
            connection.close()
