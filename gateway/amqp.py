"""Connecting to the broker: parameters from URLs, and a blocking connection for one-off work."""

import contextlib
import ssl
from typing import Iterator, Optional

import pika

from .settings import Tls, redact


def parameters(url: str, name: str = "delay-gateway", tls: Optional[Tls] = None) -> pika.URLParameters:
    params = pika.URLParameters(url)
    params.client_properties = {"connection_name": name}
    # pika fills ssl_options for every amqps:// URL itself (system CAs), so this must not
    # depend on it being unset, or the CA and client certificate options would be ignored.
    if url.startswith("amqps://"):
        tls = tls or Tls()
        # Verifies the broker's certificate and host name, against tls.ca_file or the system's CAs.
        try:
            context = ssl.create_default_context(cafile=tls.ca_file)
            if tls.cert_file:
                context.load_cert_chain(tls.cert_file, tls.key_file)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"cannot load the TLS files: {exc}") from None
        params.ssl_options = pika.SSLOptions(context, params.host)
    return params


class BrokerUnreachable(pika.exceptions.AMQPConnectionError):
    """No broker at this URL (the message names the URL, never its password)."""


@contextlib.contextmanager
def blocking_channel(url: str, name: str = "delay-gateway", tls: Optional[Tls] = None) -> Iterator:
    try:
        connection = pika.BlockingConnection(parameters(url, name, tls))
    except pika.exceptions.AMQPConnectionError as exc:
        raise BrokerUnreachable(f"cannot connect to {redact(url)}: {exc!r}") from exc
    try:
        yield connection.channel()
    finally:
        if connection.is_open:
            connection.close()
