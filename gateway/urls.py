"""Broker URLs: the ones a command is given, with their virtual host and password, and redacted.

A command's --url (several, comma-separated), --vhost/--vhosts and --password-file become the
URLs it connects to (`urls_from`, `per_vhost`); a password read from a file never appears in
logs or errors (`redact`)."""

import argparse
from typing import Optional, Sequence, Tuple
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from gateway.exits import UsageError


def urls_from(args: argparse.Namespace, many: bool = False) -> Tuple[str, ...]:
    """The broker URLs, each with the one virtual host --vhost names (when it names one).
    `many`: a command that serves every vhost of --vhosts itself (the URLs are left as given);
    any other refuses a list of several."""
    urls = tuple(u.strip() for u in args.url.split(",") if u.strip())
    if not urls:
        raise UsageError("--url: no broker URL given")
    for url in urls:
        if urlsplit(url).scheme not in ("amqp", "amqps"):
            raise UsageError(f"--url: {redact(url)!r} is not an amqp:// or amqps:// URL")
    if getattr(args, "password_file", None):
        password = read_secret(args.password_file)
        urls = tuple(with_password(u, password) for u in urls)
    if getattr(args, "tls_ca_file", None) or getattr(args, "tls_cert_file", None):
        plain = [redact(u) for u in urls if not u.startswith("amqps://")]
        if plain:
            raise UsageError(f"TLS options given but not every URL is amqps://: {', '.join(plain)}")
    return urls if many else one_vhost(urls, getattr(args, "vhosts", ()))


def one_vhost(urls: Sequence[str], vhosts: Sequence[str]) -> Tuple[str, ...]:
    """The URLs of a command that works on one virtual host: each with the one `vhosts`
    names (none named: as given); several are refused."""
    if not vhosts:
        return tuple(urls)
    if len(vhosts) > 1:
        raise UsageError(f"--vhosts names {len(vhosts)} virtual hosts ({', '.join(vhosts)}; from DELAY_GATEWAY_VHOSTS "
                         "unless given as a flag) and this command works on one: name it with --vhost NAME")
    return tuple(with_vhost(u, vhosts[0]) for u in urls)


def per_vhost(urls: Sequence[str], vhosts: Sequence[str]) -> Tuple[Tuple[Optional[str], Tuple[str, ...]], ...]:
    """(vhost, the URLs with it) for each of `vhosts`; none named: (None, the URLs as given)."""
    if not vhosts:
        return ((None, tuple(urls)),)
    return tuple((v, tuple(with_vhost(u, v) for u in urls)) for v in vhosts)


def with_vhost(url: str, vhost: str) -> str:
    """`url` with `vhost` as its virtual host (its path), percent-encoded (/ is %2F)."""
    return urlunsplit(urlsplit(url)._replace(path="/" + quote(vhost, safe="")))


def vhost_of(url: str) -> str:
    """The virtual host an AMQP URL names: its path, decoded; / when it has none."""
    path = urlsplit(url).path
    return unquote(path[1:]) if len(path) > 1 else "/"


def user_of(url: str) -> str:
    """The user an AMQP URL logs in as: its user name, decoded; guest when it names none (as pika)."""
    user = urlsplit(url).username
    return unquote(user) if user else "guest"


def redact(url: str) -> str:
    """The URL without its password, for logs and errors."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def read_secret(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().rstrip("\r\n")
    except OSError as exc:  # the message names the file, never its content
        raise UsageError(f"cannot read the password file {path}: {exc.strerror}") from None


def with_password(url: str, password: str) -> str:
    """`url` with `password` as its password (percent-encoded), keeping its user name."""
    parts = urlsplit(url)
    userinfo, at, hostport = parts.netloc.rpartition("@")
    user = userinfo.partition(":")[0] if at else "guest"
    return urlunsplit(parts._replace(netloc=f"{user}:{quote(password, safe='')}@{hostport}"))
