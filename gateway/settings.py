"""Gateway settings: built once in main() from flags, with environment variables as defaults."""

import argparse
from dataclasses import dataclass, field
from typing import Mapping, Optional, Tuple
from urllib.parse import quote, urlsplit, urlunsplit

from topology import ChainSettings

ENV = "DELAY_GATEWAY_"
DEFAULT_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"
ROLES = ("all", "check-in", "distributor")


@dataclass(frozen=True)
class Tls:
    """For amqps:// URLs: the CA that signed the broker's certificate (None: the system's),
    and an optional client certificate (with its key, or the key in a file of its own)."""

    ca_file: Optional[str] = None
    cert_file: Optional[str] = None
    key_file: Optional[str] = None

    def __post_init__(self) -> None:
        if self.key_file and not self.cert_file:
            raise ValueError("--tls-key-file needs --tls-cert-file")


@dataclass(frozen=True)
class Settings:
    chain: ChainSettings = field(default_factory=ChainSettings)
    urls: Tuple[str, ...] = (DEFAULT_URL,)
    role: str = "all"
    lead_ms: int = 50
    prefetch: int = 1000
    distributor_prefetch: int = 10000
    declare: bool = True
    metrics_port: int = 0
    connect_timeout_s: float = 300.0
    log_level: str = "info"
    log_format: str = "auto"
    tls: Tls = field(default_factory=Tls)

    def __post_init__(self) -> None:
        if not self.urls:
            raise ValueError("at least one broker URL is needed")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.lead_ms < 0 or self.prefetch < 1 or self.distributor_prefetch < 1:
            raise ValueError("lead_ms must be >= 0 and prefetch counts >= 1")


def redact(url: str) -> str:
    """The URL without its password, for logs and errors."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def _env(environ: Mapping[str, str], name: str, default):
    return environ.get(ENV + name, default)


def add_broker_options(p: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    g = p.add_argument_group("broker")
    g.add_argument("--url", default=_env(environ, "URL", DEFAULT_URL),
                   help="AMQP URL; several, comma-separated, for a cluster [DELAY_GATEWAY_URL]")
    g.add_argument("--password-file", default=_env(environ, "PASSWORD_FILE", None), metavar="PATH",
                   help="read the password from this file (a mounted secret) instead of the URL; "
                        "it replaces the password of every URL [DELAY_GATEWAY_PASSWORD_FILE]")
    g.add_argument("--tls-ca-file", default=_env(environ, "TLS_CA_FILE", None), metavar="PATH",
                   help="for amqps:// URLs: CA certificates (PEM) to verify the broker; default: "
                        "the system's [DELAY_GATEWAY_TLS_CA_FILE]")
    g.add_argument("--tls-cert-file", default=_env(environ, "TLS_CERT_FILE", None), metavar="PATH",
                   help="client certificate (PEM, may include the key) [DELAY_GATEWAY_TLS_CERT_FILE]")
    g.add_argument("--tls-key-file", default=_env(environ, "TLS_KEY_FILE", None), metavar="PATH",
                   help="client key (PEM), if not in the certificate file [DELAY_GATEWAY_TLS_KEY_FILE]")
    g.add_argument("--log-level", default=_env(environ, "LOG_LEVEL", "info"),
                   choices=["debug", "info", "warning", "error"], help="[DELAY_GATEWAY_LOG_LEVEL]")
    g.add_argument("--log-format", default=_env(environ, "LOG_FORMAT", "auto"),
                   choices=["auto", "json", "console"],
                   help="auto: JSON unless stderr is a terminal [DELAY_GATEWAY_LOG_FORMAT]")


def add_chain_options(p: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    d = ChainSettings()
    g = p.add_argument_group("topology (must match across every gateway and declare)")
    g.add_argument("--prefix", default=_env(environ, "PREFIX", d.prefix), help="[DELAY_GATEWAY_PREFIX]")
    g.add_argument("--max-level", type=int, default=int(_env(environ, "MAX_LEVEL", d.max_level)),
                   help="number of binary delay levels; level k waits 2^k x resolution [DELAY_GATEWAY_MAX_LEVEL]")
    g.add_argument("--resolution-ms", type=int, default=int(_env(environ, "RESOLUTION_MS", d.resolution_ms)),
                   help="the chain's unit in ms [DELAY_GATEWAY_RESOLUTION_MS]")
    g.add_argument("--queue-type", default=_env(environ, "QUEUE_TYPE", d.queue_type),
                   choices=["quorum", "classic"], help="[DELAY_GATEWAY_QUEUE_TYPE]")
    g.add_argument("--zero-bits", default=_env(environ, "ZERO_BITS", d.zero_bits),
                   choices=["queue", "exchange"],
                   help="a 0 bit passes a 1 ms queue, or an exchange-to-exchange binding [DELAY_GATEWAY_ZERO_BITS]")


def add_run_options(p: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    d = Settings()
    g = p.add_argument_group("consumers")
    g.add_argument("--role", default=_env(environ, "ROLE", d.role), choices=ROLES, help="[DELAY_GATEWAY_ROLE]")
    g.add_argument("--prefetch", type=int, default=int(_env(environ, "PREFETCH", d.prefetch)),
                   help="unacked messages per check-in and parking consumer [DELAY_GATEWAY_PREFETCH]")
    g.add_argument("--distributor-prefetch", type=int,
                   default=int(_env(environ, "DISTRIBUTOR_PREFETCH", d.distributor_prefetch)),
                   help="unacked messages the distributor may hold; must exceed rate x resolution "
                        "[DELAY_GATEWAY_DISTRIBUTOR_PREFETCH]")
    g.add_argument("--lead-ms", type=int, default=int(_env(environ, "LEAD_MS", d.lead_ms)),
                   help="ms the chain leaves to the distributor to absorb hop latency [DELAY_GATEWAY_LEAD_MS]")
    g.add_argument("--no-declare", dest="declare", action="store_false",
                   default=_env(environ, "DECLARE", "true").lower() not in ("0", "false", "no"),
                   help="do not declare the topology at start (it must exist) [DELAY_GATEWAY_DECLARE]")
    g.add_argument("--metrics-port", type=int, default=int(_env(environ, "METRICS_PORT", d.metrics_port)),
                   help="serve Prometheus metrics on this port; 0: off [DELAY_GATEWAY_METRICS_PORT]")
    g.add_argument("--connect-timeout", type=float, dest="connect_timeout_s",
                   default=float(_env(environ, "CONNECT_TIMEOUT", d.connect_timeout_s)),
                   help="give up after this many seconds without a broker [DELAY_GATEWAY_CONNECT_TIMEOUT]")


def chain_from(args: argparse.Namespace) -> ChainSettings:
    return ChainSettings(prefix=args.prefix, max_level=args.max_level, resolution_ms=args.resolution_ms,
                         queue_type=args.queue_type, zero_bits=args.zero_bits)


def urls_from(args: argparse.Namespace) -> Tuple[str, ...]:
    urls = tuple(u.strip() for u in args.url.split(",") if u.strip())
    if getattr(args, "password_file", None):
        password = read_secret(args.password_file)
        urls = tuple(with_password(u, password) for u in urls)
    if getattr(args, "tls_ca_file", None) or getattr(args, "tls_cert_file", None):
        plain = [redact(u) for u in urls if not u.startswith("amqps://")]
        if plain:
            raise ValueError(f"TLS options given but not every URL is amqps://: {', '.join(plain)}")
    return urls


def tls_from(args: argparse.Namespace) -> Tls:
    return Tls(getattr(args, "tls_ca_file", None), getattr(args, "tls_cert_file", None),
               getattr(args, "tls_key_file", None))


def read_secret(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().rstrip("\r\n")
    except OSError as exc:  # the message names the file, never its content
        raise ValueError(f"cannot read the password file {path}: {exc.strerror}") from None


def with_password(url: str, password: str) -> str:
    """`url` with `password` as its password (percent-encoded), keeping its user name."""
    parts = urlsplit(url)
    userinfo, at, hostport = parts.netloc.rpartition("@")
    user = userinfo.partition(":")[0] if at else "guest"
    return urlunsplit(parts._replace(netloc=f"{user}:{quote(password, safe='')}@{hostport}"))


def settings_from(args: argparse.Namespace) -> Settings:
    fields = {f: getattr(args, f) for f in ("role", "lead_ms", "prefetch", "distributor_prefetch",
                                            "declare", "metrics_port", "connect_timeout_s",
                                            "log_level", "log_format") if hasattr(args, f)}
    return Settings(chain=chain_from(args), urls=urls_from(args), tls=tls_from(args), **fields)
