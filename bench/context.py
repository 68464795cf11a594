"""What a benchmark run is asked for (`Context`: the options of `python -m bench`), and what
is set up from it: the gateway targets of a load, and the system (the gateway, the plugin or
kombu's chain) that delays one target's messages."""

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from topology import ChainSettings

from gateway.settings import default

from .broker import Broker
from .systems import DELAY, DELIVER_AT, Gateway, Kombu, Plugin, Target, unique_prefix

GATEWAY_DEFAULT_LEAD_MS = default("lead_ms")  # the gateway's own default


@dataclass
class Context:
    """The options of one `python -m bench` command, handed to every scenario it runs."""

    url: str
    out_dir: str
    broker: Broker
    messages: Optional[int] = None  # overrides each scenario's default size
    rounds: int = 1
    plugin: bool = False  # run the plugin beside the gateway (--compare-plugin, and the broker has it)
    kombu: bool = False  # run Celery's native delayed delivery beside the gateway (--compare-kombu)
    headers: Sequence[str] = (DELAY, DELIVER_AT)
    queue_types: Sequence[str] = ("quorum",)
    zero_bits: Sequence[str] = ("queue",)
    rate: Optional[float] = None  # paced: overrides 1,000 msg/s
    rates: Sequence[int] = (1000, 2000, 4000, 6000, 8000)  # steady ladder
    duration_s: float = 20.0  # per steady step
    min_delay_ms: Optional[int] = None
    max_delay_ms: Optional[int] = None
    at_once_ms: int = 60_000
    size: int = 1024
    gateway_args: Sequence[str] = ()  # passed to every `run` process (e.g. --lead-ms 20)
    split_roles: bool = False  # one `run` process per role instead of one with both
    replicas: int = 1  # gateway processes (of each role, with split_roles), competing consumers
    receiver_queue_type: str = "quorum"
    max_level: int = 20
    resolution_ms: int = 1000
    max_in_memory_length: Optional[int] = None  # pending: set as a policy on the chain
    index_off: bool = False  # also each gateway load with the index of what waits off (--compare-index)
    idle_s: float = 2.0  # the idle broker's CPU is measured this long before each run
    log: Callable[[str], None] = print
    extra: Dict[str, object] = field(default_factory=dict)

    def n(self, default: int) -> int:
        return self.messages if self.messages is not None else default

    def delays(self, lo: int, hi: int) -> Tuple[int, int]:
        return (self.min_delay_ms if self.min_delay_ms is not None else lo,
                self.max_delay_ms if self.max_delay_ms is not None else hi)

    def chain(self, tag: str, queue_type: str, zero_bits: str) -> ChainSettings:
        return ChainSettings(prefix=unique_prefix(tag), max_level=self.max_level,
                             resolution_ms=self.resolution_ms, queue_type=queue_type, zero_bits=zero_bits)

    def topologies(self):
        for qt in self.queue_types:
            for zb in self.zero_bits:
                yield qt, zb

    @property
    def lead_ms(self) -> int:
        args = list(self.gateway_args)
        for i, a in enumerate(args):
            if a == "--lead-ms" and i + 1 < len(args):
                return int(args[i + 1])
            if a.startswith("--lead-ms="):
                return int(a.split("=", 1)[1])
        return GATEWAY_DEFAULT_LEAD_MS


def gateway_targets(ctx: Context, headers: Optional[Sequence[str]] = None) -> List[Target]:
    """Every gateway target the options ask for: each topology, delay header, and index on (and off)."""
    return [Target("gateway", h, qt, zb, index) for qt, zb in ctx.topologies() for h in (headers or ctx.headers)
            for index in ((True, False) if ctx.index_off else (True,))]


def open_system(ctx: Context, target: Target, tag: str):
    """What delays `target`'s messages, declared and (for the gateway) running, under a fresh prefix."""
    if target.system == "plugin":
        return Plugin(ctx.url, unique_prefix(tag))
    if target.system == "kombu":
        return Kombu(ctx.url, unique_prefix(tag), ctx.receiver_queue_type)
    args = [*ctx.gateway_args, *(() if target.index else ("--no-pending-index",))]
    return Gateway(ctx.url, ctx.chain(tag, target.queue_type, target.zero_bits), args, ctx.split_roles, ctx.replicas)
