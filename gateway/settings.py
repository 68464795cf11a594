"""Every setting of the gateway, in one table, and the Settings built from it once in main().

Each `Option` is a command-line flag, an environment variable (DELAY_GATEWAY_ + its env
name) and, where it is deployment configuration, a Helm value: the parser, the Settings
dataclass, the settings table in docs/operating.md and the chart's values all come from this table.
Environment values are read when the parser is built and checked by the same function as
the flag, so a bad value is one line naming the variable, and exit 2.
"""

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Dict, Iterable, Mapping, Optional, Sequence, Tuple
from urllib.parse import urlsplit

from topology import ChainSettings

from gateway.core.retries import BadPolicy, Policy, policies
from gateway.exits import UsageError
from gateway.urls import one_vhost, redact, urls_from, user_of
from topology.model import cancel_window_ms
from topology.settings import QUEUE_TYPES, ZERO_BITS

ENV = "DELAY_GATEWAY_"
DEFAULT_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"
ROLES = ("all", "check-in", "distributor")
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("auto", "json", "console")


# -- value parsers: each raises ValueError with a message that reads after the name -------
def integer(low: Optional[int] = None, high: Optional[int] = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(str(text).strip())
        except ValueError:
            raise ValueError(f"{text!r} is not an integer") from None
        if low is not None and value < low or high is not None and value > high:
            bounds = f"from {low}" + (f" to {high}" if high is not None else " up")
            raise ValueError(f"{value} is out of range ({bounds})")
        return value
    parse.__name__ = "integer"
    return parse


def number(low: float = 0.0, above: bool = False) -> Callable[[str], float]:
    """A number of at least `low` (above it, with `above`)."""
    def parse(text: str) -> float:
        try:
            value = float(str(text).strip())
        except ValueError:
            raise ValueError(f"{text!r} is not a number") from None
        if value < low or above and value == low:
            raise ValueError(f"{value} must be above {low:g}" if above else f"{value} is below {low}")
        return value
    parse.__name__ = "number"
    return parse


def argument(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """One of these parsers as an argparse type, for a command's own flags: its message,
    not argparse's own."""
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    convert.__name__ = parse.__name__
    return convert


def one_of(choices: Sequence[str]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError(f"{text!r} is not one of {', '.join(choices)}")
        return text
    parse.__name__ = "choice"
    return parse


def boolean(text: str) -> bool:
    value = str(text).strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{text!r} is not true or false (1, yes, on / 0, no, off)")


def text(value: str) -> str:
    return value


VHOST_MAX_BYTES = 255  # connection.open's virtual host is an AMQP short string


def vhost_list(value: str) -> Tuple[str, ...]:
    """Virtual host names, comma-separated (empty: the URL's own)."""
    if not value.strip():
        return ()
    names = tuple(v.strip() for v in value.split(","))
    for name in names:
        if not name:
            raise ValueError(f"{value!r} has an empty name: separate the virtual hosts with single commas")
        if len(name.encode("utf-8")) > VHOST_MAX_BYTES:
            raise ValueError(f"{name[:20]!r}... is longer than {VHOST_MAX_BYTES} bytes, which no virtual host can be")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"{', '.join(map(repr, twice))} named twice: name each virtual host once")
    return names


def optional_path(value: str) -> Optional[str]:
    return value or None


def http_url(value: str) -> Optional[str]:
    """An http:// or https:// URL with a host (empty: none)."""
    if not value.strip():
        return None
    parts = urlsplit(value.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{redact(value)!r} is not an http:// or https:// URL with a host (http://HOST:15672)")
    return value.strip()


def optional_text(value: str) -> Optional[str]:
    return value.strip() or None


@dataclass(frozen=True)
class Option:
    name: str  # the Settings field, and the flag: max_level -> --max-level
    default: Any
    parse: Callable[[str], Any]
    help: str
    group: str  # which commands take it: see GROUPS
    helm: Optional[str] = None  # the chart's value name, where the chart sets it
    metavar: Optional[str] = None
    choices: Optional[Sequence[str]] = None
    aliases: Tuple[str, ...] = ()  # more flags for the same setting

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV + self.name.upper()


_CHAIN = ChainSettings()  # the chain's defaults are topology's

OPTIONS: Tuple[Option, ...] = (
    # broker: every command that talks to RabbitMQ
    Option("url", DEFAULT_URL, text, "AMQP URL; several, comma-separated, for a cluster", "broker", metavar="URL"),
    Option("password_file", None, optional_path,
           "read the password from this file (a mounted secret); it replaces the password of every URL",
           "broker", metavar="PATH"),
    Option("vhosts", (), vhost_list,
           "virtual hosts, comma-separated: `run`, `declare` and `selftest` serve each, with its own topology "
           "under the prefix; the other commands work on one (--vhost NAME); empty: the URL's own", "broker", "vhosts",
           metavar="NAMES", aliases=("--vhost",)),
    Option("tls_ca_file", None, optional_path,
           "for amqps:// URLs: CA certificates (PEM) that signed the broker's certificate; default: the system's",
           "broker", metavar="PATH"),
    Option("tls_cert_file", None, optional_path, "client certificate (PEM; may also hold the key)", "broker",
           metavar="PATH"),
    Option("tls_key_file", None, optional_path, "client key (PEM), if not in the certificate file", "broker",
           metavar="PATH"),
    Option("gateway_user", None, optional_text,
           "the user the gateways log in as: readers of the cancellations and waiting streams trust only the records "
           "it signed (their user_id), the gateway's own included; default: the user of the first URL (guest when "
           "it names none)", "broker", "gatewayUser", metavar="USER"),
    # management: what AMQP cannot see (RabbitMQ 3.x's file handles)
    Option("management_url", None, http_url,
           "the broker's management API (http://HOST:15672; user and password: its own, else the first URL's; the "
           "user needs the monitoring tag): on RabbitMQ 3.x `declare` refuses a prefix whose quorum queues would "
           "fill a node's file handles, and `status` shows each node's; unset: not checked", "management",
           "managementUrl", metavar="URL"),
    # chain: the topology, the same for every gateway and for declare
    Option("prefix", _CHAIN.prefix, text, "first part of every exchange and queue name", "chain",
           "prefix"),
    Option("max_level", _CHAIN.max_level, integer(1, 40), "binary delay levels; level k waits 2^k x resolution",
           "chain", "maxLevel", metavar="N"),
    Option("resolution_ms", _CHAIN.resolution_ms, integer(1), "the chain's unit, in ms", "chain", "resolutionMs",
           metavar="MS"),
    Option("queue_type", _CHAIN.queue_type, one_of(QUEUE_TYPES),
           "the chain's queues: quorum (replicated, at-least-once dead-lettering) or classic", "chain",
           "queueType", choices=QUEUE_TYPES),
    Option("zero_bits", _CHAIN.zero_bits, one_of(ZERO_BITS),
           "a 0 bit passes a 1 ms queue (queue), or an exchange-to-exchange binding (exchange: fewer hops)",
           "chain", "zeroBits", choices=ZERO_BITS),
    # run: the consumers
    Option("role", "all", one_of(ROLES), "which consumers this process runs", "run", choices=ROLES),
    Option("prefetch", 1000, integer(1, 65535),
           "unacked messages per check-in and parking consumer (check-in sends its carriers once half of it "
           "waits in them)", "run", "prefetch", metavar="N"),
    Option("distributor_prefetch", 10000, integer(1, 65535),
           "deliveries (messages, or carriers of them) the distributor may hold; keep it above what reaches it "
           "within one unit at your peak, plus --hold-messages per check-in consumer",
           "run",
           "distributorPrefetch", metavar="N"),
    Option("catch_up_rate", 0, number(0),
           "release messages that reach the distributor overdue (after an outage) at most this many a second per "
           "distributor consumer, most overdue first, while the rest go out on time; 0: all at once",
           "run", "catchUpRate", metavar="MSG/S"),
    Option("due_gauges_every", 60.0, number(0),
           "read the index of what waits this often, at most, for the due-time gauges (messages and bytes by when "
           "they fall due, the next due time, the oldest overdue); each reading waits 99 times as long as the last "
           "took, so they cost at most 1 % of a core however much waits; 0: off",
           "run", "dueGaugesEvery", metavar="SECONDS"),
    Option("hold_within_ms", 10_000, integer(0, 60_000),
           "a message due within this long goes from check-in straight to the distributor, which holds it until due, "
           "instead of down the chain (0: only what is due within the lead and one unit)", "lead", "holdWithinMs",
           metavar="MS"),
    Option("hold_messages", 1000, integer(1, 1_000_000),
           "the shorter path holds about this many per consumer at most: at higher rates it takes only what is due "
           "sooner",
           "lead", "holdMessages", metavar="N"),
    Option("lead_ms", 50, integer(0), "how much earlier than due the chain hands a message to the distributor, "
           "to absorb hop latency", "lead", "leadMs", metavar="MS"),
    Option("carrier_messages", 1000, integer(1, 100_000),
           "carry up to this many messages going the same way through the chain as one (1: each alone)",
           "lead", "carrierMessages", metavar="N"),
    Option("carrier_wait_ms", 200, integer(0, 10_000),
           "wait at most this long for messages going the same way (0: send each at once)", "lead",
           "carrierWaitMs", metavar="MS"),
    Option("carrier_bytes", 1_048_576, integer(1024, 8 * 1_048_576),
           "and at most this many bytes in one carrier (a bigger message travels alone)", "lead",
           "carrierBytes", metavar="BYTES"),
    Option("stamp_due_at", False, boolean,
           "add the header x-gateway-due-at (epoch ms) to every delivered message (for `record`)", "run",
           "stampDueAt"),
    Option("declare", True, boolean, "declare the topology at start (--no-declare: it must exist)", "run"),
    Option("metrics_port", 0, integer(0, 65535),
           "serve /metrics (Prometheus), /healthz and /readyz on this port; 0: off", "run", "metricsPort",
           metavar="PORT"),
    Option("connect_timeout", 300.0, number(0), "seconds without a broker before giving up (exit 1)", "run",
           metavar="SECONDS"),
    Option("confirm_timeout", 15.0, number(0),
           "reconnect (to the next URL) when a publish waits this long for the broker's confirm, e.g. on a node "
           "cut off from its cluster; not during a resource alarm; 0: never", "run", "confirmTimeoutSeconds",
           metavar="SECONDS"),
    Option("retire", True, boolean, "remove chains of other settings once no gateway uses them and they are "
           "empty (docs/operating.md: Changing the chain)", "run", "retire"),
    Option("pending_index", True, boolean, "write down each message sent on to wait, and each that leaves, in "
           "the waiting streams: what `delay-gateway pending list` shows (off: it shows nothing this gateway sends on)",
           "run", "pendingIndex"),
    # retire: old chains
    Option("retire_after", 600.0, number(0),
           "safety margin: a chain is retired after no gateway has used it for this long, and each of its "
           "queues this long after it must be empty", "retire", "retireAfterSeconds", metavar="SECONDS"),
    # cancel: cancelling scheduled messages (docs/cancelling.md)
    Option("cancel_retention", 0.0, number(0),
           "how long cancels are kept (the stream's x-max-age when it is first declared, and each gateway's "
           "memory); 0: 2^max_level x resolution (the longest a message goes without passing a gateway) "
           "plus one day", "cancel", metavar="SECONDS"),
    # retry: failed messages sent back to their queue later (docs/retries.md)
    Option("retry_base_ms", 1000, integer(1, 315_360_000_000), "the first retry's delay", "retry", "retryBaseMs",
           metavar="MS"),
    Option("retry_factor", 2.0, number(1.0), "each retry's delay is the one before times this", "retry",
           "retryFactor", metavar="X"),
    Option("retry_cap_ms", 3_600_000, integer(1, 315_360_000_000), "no retry waits longer than this (before jitter)",
           "retry", "retryCapMs", metavar="MS"),
    Option("retry_attempts", 10, integer(0, 1000), "retries before a message is parked with the reason", "retry",
           "retryAttempts", metavar="N"),
    Option("retry_jitter", 0.2, number(0.0),
           "each delay grows by a random share of itself up to this (0.2: up to 20 % more; never less)", "retry",
           "retryJitter", metavar="SHARE"),
    Option("retry_policies", "", text,
           'per-queue policies, first match wins: a JSON list like [{"queue": "orders.*", "base_ms": 500, '
           '"attempts": 5}] (queue: a name or shell-style pattern; base_ms, factor, cap_ms, attempts, jitter '
           "default to the settings above)", "retry", "retryPolicies", metavar="JSON"),
    Option("retry_queues", "*", text,
           "the queues retries may go back to, comma-separated names or shell-style patterns: whoever may publish "
           "to <prefix>.retry can have the gateway put a message into these", "retry", "retryQueues",
           metavar="PATTERNS"),
    # log: every command
    Option("log_level", "info", one_of(LOG_LEVELS), "how much to log", "log", "logLevel", choices=LOG_LEVELS),
    Option("log_format", "auto", one_of(LOG_FORMATS), "auto: JSON unless stderr is a terminal", "log",
           "logFormat", choices=LOG_FORMATS),
)
BY_NAME: Dict[str, Option] = {o.name: o for o in OPTIONS}
GROUP_TITLES = {"broker": "broker", "chain": "topology (the same for every gateway and for declare)",
                "run": "consumers", "lead": "timing", "retire": "retiring old chains", "log": "logging",
                "cancel": "cancelling", "retry": "retrying failed messages",
                "management": "the management API (RabbitMQ 3.x file handles)"}


def add_options(parser: argparse.ArgumentParser, groups: Iterable[str], environ: Mapping[str, str],
                only: Optional[Collection[str]] = None) -> None:
    """Add every option of `groups` (or only those named in `only`), its default taken from
    the environment when set there."""
    for group in groups:
        g = parser.add_argument_group(GROUP_TITLES[group])
        for o in OPTIONS:
            if o.group != group or (only is not None and o.name not in only):
                continue
            raw = environ.get(o.env)
            # argparse formats help with %: the default URL's %2F would break every --help.
            help = f"{o.help} [{o.env}; default {_shown(o.default)}]".lstrip().replace("%", "%%")
            if o.parse is boolean:
                # --declare / --no-declare; the environment is checked here, the flag cannot be bad
                default = o.default if raw is None else _checked(o, o.env, UsageError)(raw)
                g.add_argument(o.flag, dest=o.name, action=argparse.BooleanOptionalAction,
                               default=default, help=help)
                continue
            kwargs: Dict[str, Any] = dict(dest=o.name, type=_checked(o, None), metavar=o.metavar, help=help)
            if o.choices:
                kwargs["metavar"] = "{" + ",".join(o.choices) + "}"
            if raw is None:
                kwargs["default"] = o.default
            else:
                # argparse converts a string default with `type` only when the flag is absent,
                # so a flag beats a bad environment value and the error names the variable.
                kwargs["default"] = raw
                kwargs["type"] = _checked(o, o.env)
            g.add_argument(o.flag, *o.aliases, **kwargs)


def _checked(o: Option, env: Optional[str], error=argparse.ArgumentTypeError) -> Callable[[str], Any]:
    def convert(value: str) -> Any:
        try:
            return o.parse(value)
        except ValueError as exc:
            raise error(f"{env}: {exc}: set it to one, or unset it" if error is UsageError else
                        f"{exc} (from {env})" if env else str(exc)) from None
    convert.__name__ = o.parse.__name__
    return convert


def _shown(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(value)
    return "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def settings_table() -> str:
    """The settings table of docs/operating.md (a test keeps the guide equal to it)."""
    rows = ["| flag | environment | default | meaning |", "| --- | --- | --- | --- |"]
    for o in OPTIONS:
        meaning = o.help or "debug, info, warning or error"
        rows.append(f"| `{o.flag}` | `{o.env}` | `{_shown(o.default)}` | {meaning} |")
    return "\n".join(rows) + "\n"


# -- the settings of one process -------------------------------------------------------------
@dataclass(frozen=True)
class Tls:
    """For amqps:// URLs: the CA that signed the broker's certificate (None: the system's),
    and an optional client certificate (with its key, or the key in a file of its own)."""

    ca_file: Optional[str] = None
    cert_file: Optional[str] = None
    key_file: Optional[str] = None

    def __post_init__(self) -> None:
        if self.key_file and not self.cert_file:
            raise UsageError("--tls-key-file needs --tls-cert-file")


def default(name: str) -> Any:
    """An option's default: OPTIONS is the one place each is written."""
    return next(o.default for o in OPTIONS if o.name == name)


@dataclass(frozen=True)
class Settings:
    chain: ChainSettings = field(default_factory=ChainSettings)
    urls: Tuple[str, ...] = (DEFAULT_URL,)
    vhosts: Tuple[str, ...] = ()  # empty: the URL's own, served as before
    tls: Tls = field(default_factory=Tls)
    gateway_user: Optional[str] = default("gateway_user")  # None: the first URL's (`trusted_user`)
    management_url: Optional[str] = default("management_url")
    role: str = default("role")
    prefetch: int = default("prefetch")
    distributor_prefetch: int = default("distributor_prefetch")
    hold_within_ms: int = default("hold_within_ms")
    hold_messages: int = default("hold_messages")
    catch_up_rate: float = default("catch_up_rate")
    due_gauges_every: float = default("due_gauges_every")
    lead_ms: int = default("lead_ms")
    carrier_messages: int = default("carrier_messages")
    carrier_wait_ms: int = default("carrier_wait_ms")
    carrier_bytes: int = default("carrier_bytes")
    stamp_due_at: bool = default("stamp_due_at")
    declare: bool = default("declare")
    metrics_port: int = default("metrics_port")
    connect_timeout: float = default("connect_timeout")
    confirm_timeout: float = default("confirm_timeout")
    retire: bool = default("retire")
    pending_index: bool = default("pending_index")
    retire_after: float = default("retire_after")
    cancel_retention: float = default("cancel_retention")
    retry_base_ms: int = default("retry_base_ms")
    retry_factor: float = default("retry_factor")
    retry_cap_ms: int = default("retry_cap_ms")
    retry_attempts: int = default("retry_attempts")
    retry_jitter: float = default("retry_jitter")
    retry_policies: str = default("retry_policies")
    retry_queues: str = default("retry_queues")
    log_level: str = default("log_level")
    log_format: str = default("log_format")

    def __post_init__(self) -> None:
        if not self.urls:
            raise UsageError("at least one broker URL is needed")
        self.retry_rules()  # refused at start, in one line
        try:
            cancel_window_ms(self.chain, self.cancel_retention)
        except ValueError as exc:
            raise UsageError(str(exc)) from None

    # -- values derived from the settings, the same for every command that needs them ----------
    @property
    def one_vhost_urls(self) -> Tuple[str, ...]:
        """The URLs of a command that works on one virtual host (gateway/urls.one_vhost):
        raises UsageError when --vhosts names several."""
        return one_vhost(self.urls, self.vhosts)

    @property
    def trusted_user(self) -> str:
        """The user whose records in the streams readers trust (gateway/core/writers.py):
        --gateway-user, else the user of the first URL (guest when it names none)."""
        return self.gateway_user or user_of(self.urls[0])

    @property
    def cancel_window_ms(self) -> int:
        """How long a cancel is kept (topology.model.cancel_window_ms): the retention of the
        cancellations stream, and of a gateway's store of cancels."""
        return cancel_window_ms(self.chain, self.cancel_retention)

    def retry_rules(self) -> Tuple[Policy, ...]:
        """The retry policies: per queue, then the default (retries.py). Raises UsageError."""
        try:
            default_policy = Policy(self.retry_base_ms, self.retry_factor, self.retry_cap_ms, self.retry_attempts,
                                    self.retry_jitter)
            return policies(default_policy, self.retry_policies)
        except BadPolicy as exc:
            raise UsageError(str(exc)) from None


def chain_from(args: argparse.Namespace) -> ChainSettings:
    d = ChainSettings()
    values = {f: getattr(args, f, getattr(d, f)) for f in ("prefix", "max_level", "resolution_ms",
                                                           "queue_type", "zero_bits")}
    try:
        return ChainSettings(**values)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def settings_from(args: argparse.Namespace) -> Settings:
    own = {f.name for f in dataclasses.fields(Settings)} - {"chain", "urls", "tls", "vhosts"}
    chain = chain_from(args)  # (its errors first, then the URLs')
    # (a command without the broker options, as render: the default URL, never used)
    urls = urls_from(args, many=True) if hasattr(args, "url") else (DEFAULT_URL,)
    return Settings(chain=chain, urls=urls, tls=tls_from(args),
                    vhosts=getattr(args, "vhosts", ()),
                    **{name: getattr(args, name) for name in own if hasattr(args, name)})


def tls_from(args: argparse.Namespace) -> Tls:
    return Tls(getattr(args, "tls_ca_file", None), getattr(args, "tls_cert_file", None),
               getattr(args, "tls_key_file", None))
