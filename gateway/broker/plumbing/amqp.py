"""Connecting to the broker, and sorting what goes wrong into what heals and what does not.

Heals (retried with backoff): the connection lost or refused, CONNECTION_FORCED (a broker
restart, an operator closing connections), a quorum queue between leaders, resource
alarms. Does not heal (reported in one line that names the object and the fix, and the
process gives up after a few attempts): a refused login, a missing virtual host, a queue
or exchange that does not exist, missing permissions, a topology declared with other
arguments. Retrying those forever would only fill the logs.
"""

import contextlib
import socket
import ssl
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence, Tuple, Union

import pika
from pika.exceptions import (AMQPConnectionError, AuthenticationError, ChannelClosedByBroker,
                             ConnectionClosedByBroker, ProbableAccessDeniedError, ProbableAuthenticationError)

from topology.broker import permissions

from gateway.broker.plumbing import wire_connection
from gateway.exits import EXIT_NO_BROKER, EXIT_REFUSED, ExitCodeError
from gateway.settings import Tls, UsageError
from gateway.urls import redact


def parameters(url: str, name: str = "delay-gateway", tls: Optional[Tls] = None) -> pika.URLParameters:
    try:
        params = pika.URLParameters(url)
    except ValueError as exc:
        raise UsageError(f"--url {redact(url)!r}: {exc}") from None
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
            raise UsageError(f"cannot load the TLS files: {exc}") from None
        params.ssl_options = pika.SSLOptions(context, params.host)
    return params


@dataclass(frozen=True)
class Trouble:
    heals: bool
    message: str  # one line: what went wrong, naming the object, and the fix


class BrokerError(ExitCodeError):
    """A broker problem, already explained in one line."""

    def __init__(self, trouble: Trouble) -> None:
        super().__init__(trouble.message)
        self.trouble = trouble

    @property
    def exit_code(self) -> int:
        """None answered (it may heal): 1; refused (it will not): 3."""
        return EXIT_NO_BROKER if self.trouble.heals else EXIT_REFUSED


def classify(error: BaseException, url: str, role: Optional[str] = None) -> Trouble:
    """Pure: what `error` (an exception, or a connection or channel close reason) means.
    `role`: where docs/security.md gives the permissions the command needs (a refusal says)."""
    where = redact(url)
    user = pika.URLParameters(url).credentials.username if "://" in url else "?"
    if isinstance(error, (ProbableAuthenticationError, ProbableAccessDeniedError, AuthenticationError)):
        return Trouble(False, f"{where}: login refused for user {user!r} (or no access to the virtual "
                              "host): check the user name and password (--url, --password-file) and the "
                              "user's permissions on the virtual host")
    code = getattr(error, "reply_code", None)
    text = getattr(error, "reply_text", "") or str(error)
    if isinstance(error, ConnectionClosedByBroker):
        if code == 530:
            return Trouble(False, f"{where}: {text}: the virtual host does not exist or the user may not "
                                  "use it; check the URL's path (%2F is /)")
        if code == 403:
            return Trouble(False, f"{where}: {text}: check the user name and password")
        return Trouble(True, f"{where}: the broker closed the connection: {text}")
    if isinstance(error, ChannelClosedByBroker):
        if code == 404:
            return Trouble(False, f"{where}: {text}: the topology is not declared (with these settings): "
                                  "run `delay-gateway declare` with the same --prefix and chain settings (or let "
                                  "`run` declare it: without --no-declare)")
        if code == 403:
            return Trouble(False, refused(error, text, where, role))
        if code == 406 and "acknowledgement" in text and "timed out" in text:
            return Trouble(True, f"{where}: the broker closed a channel because a delivery was held unacknowledged "
                                 f"longer than its consumer_timeout ({text}): the gateway asks for a longer one for "
                                 "its consumers (x-consumer-timeout), which RabbitMQ 3.11.15 and later honour; on an "
                                 "older broker raise consumer_timeout in rabbitmq.conf above the longest hold "
                                 "(--hold-within-ms, or a resolution unit and the lead), default 30 min")
        if code == 406:
            return Trouble(False, f"{where}: {text}: an object of the same name exists with other "
                                  "arguments; keep its settings, or see `delay-gateway migrate`")
        return Trouble(True, f"{where}: the broker closed a channel: {text}")
    if isinstance(error, (AMQPConnectionError, OSError)):
        return Trouble(True, f"{where}: cannot connect: {unreachable(error)}")
    return Trouble(True, f"{where}: {error!r}")


def refused(error: BaseException, text: str, where: str, role: Optional[str] = None) -> str:
    """A refusal (403) in one line: who may not do what to which object, and the one
    permission to grant. RabbitMQ 4 names the permission; for 3.10 the operation does
    (topology/broker/permissions.needing wraps it and raises Refused)."""
    doc = f"(docs/security.md: {role or 'Least privilege'})"
    found = permissions.refusal(text)
    if found is None:
        return f"{where}: {text}: the user lacks a permission on this object {doc}"
    said, kind, name, vhost, user = found
    permission = said or getattr(error, "permission", None)
    if permission is None:
        return (f"user {user!r} may not use {kind} {name!r} in vhost {vhost!r}: grant it the permission the operation "
                f"needs on that name (configure to declare, write to publish, read to consume) {doc}")
    verb = {"read": "read", "write": "write to", "configure": "configure"}[permission]
    return f"user {user!r} may not {verb} {kind} {name!r} in vhost {vhost!r}: grant it {permission} permission " \
           f"on that name {doc}"


def login_user(connection: object) -> Optional[str]:
    """The user a connection (blocking or not) logged in as; None where the credentials name
    none (EXTERNAL: a client certificate's)."""
    impl = getattr(connection, "_impl", connection)
    credentials = getattr(getattr(impl, "params", None), "credentials", None)
    user = getattr(credentials, "username", None)
    return user if isinstance(user, str) and user else None


def unreachable(error: BaseException) -> str:
    """Why a connection could not be made, in words (pika nests the socket's error in its own)."""
    cause: BaseException = error
    for _ in range(5):  # AMQPConnectionError(AMQPConnectorSocketConnectError(exception=OSError))
        inner = getattr(cause, "exception", None)
        if isinstance(inner, BaseException):
            cause = inner
            continue
        first = cause.args[0] if cause.args else None
        if isinstance(first, BaseException):
            cause = first
            continue
        break
    if isinstance(cause, ConnectionRefusedError):
        return "connection refused (no RabbitMQ listening there: check the host and port, and that it runs)"
    if isinstance(cause, socket.gaierror):
        return f"unknown host ({cause.strerror}): check the URL's host name"
    if isinstance(cause, (socket.timeout, TimeoutError)):
        return "timed out (a firewall, or the host is down): check the host and port"
    if isinstance(cause, ssl.SSLError):
        return f"TLS failed ({cause.reason or cause}): check --tls-ca-file and the broker's certificate"
    if isinstance(cause, OSError) and cause.strerror:
        return f"{cause.strerror.lower()}: check the host and port"
    text = str(cause).strip() or type(cause).__name__
    return text.replace("\n", " ")


def connect(urls: Union[str, Sequence[str]], name: str = "delay-gateway",
            tls: Optional[Tls] = None) -> Tuple[pika.BlockingConnection, str]:
    """A connection to the first of `urls` that answers, and its URL, as `run` moves on to
    the next node. Raises BrokerError: a refusal (login, virtual host) if any node refused,
    since another node of the same cluster would refuse alike; else why none answered."""
    urls = (urls,) if isinstance(urls, str) else tuple(urls)
    troubles: List[Trouble] = []
    for url in urls:
        params = parameters(url, name, tls)
        try:
            return wire_connection.blocking(params), url
        except (AMQPConnectionError, OSError) as exc:
            trouble = classify(exc, url)
            if not trouble.heals:
                raise BrokerError(trouble) from None
            troubles.append(trouble)
    if len(troubles) == 1:
        raise BrokerError(troubles[0])
    raise BrokerError(Trouble(True, f"none of the {len(troubles)} brokers answered: "
                                    + "; ".join(t.message for t in troubles)))


@contextlib.contextmanager
def blocking_channel(urls: Union[str, Sequence[str]], name: str = "delay-gateway",
                     tls: Optional[Tls] = None, role: Optional[str] = None) -> Iterator:
    """A channel for one-off work, on the first of `urls` that answers; any broker error is a
    BrokerError with its explanation (a refusal names `role`'s permissions in docs/security.md)."""
    connection, url = connect(urls, name, tls)
    try:
        yield connection.channel()
    except (ChannelClosedByBroker, ConnectionClosedByBroker) as exc:
        raise BrokerError(classify(exc, url, role)) from None
    except AMQPConnectionError as exc:  # lost mid-way (a node stopping)
        raise BrokerError(classify(exc, url, role)) from None
    finally:
        if connection.is_open:
            connection.close()

