"""The status report as a pure model: queue counts and settings in, what waits where and when it falls due out.

It imports nothing that does I/O (the package's docstring says how counts bound due times).
"""

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from topology.names import Names
from topology.registry import ChainKey, Registry, chain_queues, level_queues
from topology.retirement import Observed
from topology.settings import MAX_LEVELS, QUEUE_TYPES

from gateway.times import duration

HORIZONS: Tuple[Tuple[str, int], ...] = (
    ("1 second", 1000), ("1 minute", 60_000), ("1 hour", 3_600_000), ("1 day", 86_400_000))


@dataclass(frozen=True)
class Row:
    name: str  # the queue's full name
    label: str  # what the table shows
    role: str
    messages: Optional[int]  # None: unknown (held without metrics) or the queue is missing
    exists: bool
    due_min_ms: Optional[int]  # from now; None with due_max_ms None: not scheduled (parking, parked)
    due_max_ms: Optional[int]  # None: no upper bound
    chain: Optional[str] = None  # the chain's generation
    level: Optional[int] = None
    note: str = ""
    carriers: Optional[int] = None  # the broker's count when `messages` is estimated from it

    @property
    def scheduled(self) -> bool:
        return self.due_min_ms is not None


@dataclass(frozen=True)
class Chain:
    key: ChainKey
    yours: bool  # the settings `status` was given
    declared: bool  # its gateways or meditation queue exist
    gateways: Optional[int]  # gateways connected with these settings (None: unknown)
    empty_by_ms: Optional[int]  # retiring: when its last sealed queue is empty


@dataclass(frozen=True)
class DueWithin:
    """How many messages fall due within a horizon: at least, at most (`status`'s due-within lines)."""

    within: str
    within_ms: Optional[int]  # None: later than the last horizon
    at_least: int
    at_most: int


@dataclass
class Report:
    prefix: str
    at_ms: int
    lead_ms: int
    rows: List[Row]
    chains: List[Chain]
    due_within: List[DueWithin]
    held_source: str  # "metrics" or why it is not known
    distributor_consumers: Optional[int]
    problems: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    # held (ids), window_ms, and what a cancel can promise here (docs/cancelling.md)
    cancellations: Optional[Dict[str, Any]] = None
    # per source queue: scheduled, delivered, gave_up (from --metrics-url; docs/retries.md)
    retries: Optional[Dict[str, Dict[str, int]]] = None
    # the publishers' messages that wait, from the index (gateway/core/index_records.py): total,
    # due_within (cumulative, by HORIZONS' labels and "later"), exact and why not; None: not read
    waiting: Optional[Dict[str, Any]] = None

    @property
    def missing(self) -> bool:
        """The gateway's fixed objects are not declared under this prefix."""
        return any(not r.exists for r in self.rows if r.role in ("check-in", "distributor"))

    @property
    def total(self) -> int:
        return sum(r.messages or 0 for r in self.rows if r.exists)


def report(prefix: str, own: ChainKey, lead_ms: int, registry: Optional[Registry], chains: Iterable[ChainKey],
           observed: Observed, held: Optional[int], held_source: str, now_ms: int,
           carried: Optional[Dict[str, float]] = None) -> Report:
    """The status table from what passive declares found (`observed`) for every chain in
    `chains`, the registry (None: there is none), and the distributor's held messages if
    the gateways' metrics told them.

    A broker message in the chain may be a carrier of several of the publishers' messages
    (gateway/core/carrier.py). `carried` (from the gateways' metrics: messages per publish, by
    what was sent: "chain", "meditation", "distributor") turns the broker's counts of the
    chain's queues into estimates of the messages they hold; without it they are counts of
    broker messages, and a note says so."""
    fixed = Names(prefix)
    chains = sorted(set(chains) | {own})

    def count(name: str) -> Tuple[bool, Optional[int]]:
        c = observed.queues.get(name)
        return c is not None, (c.messages if c is not None else None)

    rows: List[Row] = []

    def add(name: str, label: str, role: str, lo: Optional[int], hi: Optional[int], note: str = "",
            chain: Optional[str] = None, level: Optional[int] = None, sent_as: Optional[str] = None) -> None:
        exists, messages = count(name)
        carriers = None
        ratio = (carried or {}).get(sent_as) if sent_as else None
        if messages and ratio and ratio > 1:
            carriers, messages = messages, round(messages * ratio)
        rows.append(Row(name, label, role, messages, exists, lo, hi, chain, level, note, carriers))

    add(fixed.check_in, "check-in", "check-in", 0, None, "any time: not read yet")
    add(fixed.retry, "retry", "retry", 0, None, "any time: failed messages, not read yet")
    add(fixed.returning, "returning", "returning", 0, None, "any time: back from meditation, planned again next")

    chain_rows, resolutions = _chains(prefix, own, lead_ms, registry, chains, observed, add)
    hold = max(resolutions or [own.resolution_ms]) + lead_ms
    add(fixed.distributor, "distributor ready", "distributor", 0, hold, sent_as="distributor")
    for queue_type in QUEUE_TYPES:  # the exits of chains of another queue type, where they exist
        if queue_type != "quorum" and observed.queues.get(fixed.exit_distributor(queue_type)) is not None:
            add(fixed.exit_returning(queue_type), f"returning ({queue_type} chains)", "returning", 0, None,
                "any time: back from meditation, planned again next", sent_as="meditation")
            add(fixed.exit_distributor(queue_type), f"distributor ready ({queue_type} chains)", "distributor", 0,
                hold, sent_as="chain")
    d = observed.queues.get(fixed.distributor)
    consumers = d.consumers if d is not None else None
    if held is None and consumers == 0:
        held, held_source = 0, "no consumer"  # nobody can hold a message
    rows.append(Row(fixed.distributor, "distributor held", "held", held, d is not None, 0, hold,
                    note="" if held is not None else f"not visible over AMQP: {held_source}"))
    add(fixed.parking, "parking", "parking", None, None, "being parked")
    add(fixed.parked, "parked", "parked", None, None, "until replayed (delay-gateway parked list)")

    problems, notes = _findings(prefix, own, registry, rows, chain_rows, held, consumers, carried)
    return Report(prefix, now_ms, lead_ms, rows, [c for c in chain_rows if c.declared or c.yours],
                  due_within(rows), "metrics" if held is not None else held_source, consumers, problems, notes)


Add = Callable[..., None]


def _chains(prefix: str, own: ChainKey, lead_ms: int, registry: Optional[Registry], chains: List[ChainKey],
            observed: Observed, add: Add) -> Tuple[List[Chain], List[int]]:
    """The rows of every chain's meditation and level queues (through `add`), each chain's
    line, and the resolutions of the chains present."""
    chain_rows: List[Chain] = []
    resolutions = []
    for gen in sorted({k.generation for k in chains}):
        keys = [k for k in chains if k.generation == gen]
        names = Names(prefix, gen)
        unit = keys[0].resolution_ms
        present = [k for k in keys if observed.queues.get(names.meditation(k.max_level)) is not None
                   or observed.queues.get(names.gateways(k.max_level)) is not None]
        for k in keys:
            declared = k in present
            seals = [e for e in (registry.seal(q, [k]) for q in chain_queues(k, names)) if e is not None] \
                if registry else []
            chain_rows.append(Chain(k, k == own, declared, observed.gateways(names, k.max_level) if declared else 0,
                                    max(seals) if seals else None))
        if not present and own.generation != gen:
            continue
        resolutions.append(unit)
        for k in sorted(keys, key=lambda k: -k.max_level):
            if k in present or k == own:
                chain_max = k.settings(prefix).meditation_ms
                add(names.meditation(k.max_level), f"{gen} meditation.{k.max_level:02d}", "meditation", unit, None,
                    f"at least 1 unit from now (entered with more than the chain's {duration(chain_max)})",
                    gen, k.max_level, "meditation")
        seen = [k + 1 for k in range(MAX_LEVELS) if observed.level_seen(names, keys[0], k)]
        top = max(seen + [own.max_level if own.generation == gen else 0])
        for level in range(top - 1, -1, -1):
            delay, *passing = level_queues(keys[0], names, level)
            add(delay, f"{gen} level {level:02d} delay", "delay", 0, (2 << level) * unit + lead_ms,
                chain=gen, level=level, sent_as="chain")
            for q in passing:
                add(q, f"{gen} level {level:02d} pass", "pass", 0, (1 << level) * unit + lead_ms,
                    chain=gen, level=level, sent_as="chain")

    return chain_rows, resolutions


def _findings(prefix: str, own: ChainKey, registry: Optional[Registry], rows: List[Row], chain_rows: List[Chain],
              held: Optional[int], consumers: Optional[int],
              carried: Optional[Dict[str, float]]) -> Tuple[List[str], List[str]]:
    """What is wrong (problems), and what is worth knowing (notes)."""
    fixed = Names(prefix)
    problems: List[str] = []
    notes: List[str] = []
    if any(not r.exists for r in rows if r.role in ("check-in", "distributor")):
        problems.append(f"the topology is not declared under prefix {prefix!r} (no queue {fixed.check_in!r}): "
                        "run `delay-gateway declare` with your settings, or check --prefix and --url")
    else:
        if registry is None:
            problems.append(f"no chain registry {fixed.registry!r} (declared by an older version): only the chain of "
                            "your settings is shown, and old chains are not retired; `delay-gateway declare` "
                            "creates it")
        mine = next(c for c in chain_rows if c.yours)
        others = [c for c in chain_rows if not c.yours and c.declared]
        if not mine.declared:
            used = ", ".join(f"{c.key.describe()} ({gateways_text(c.gateways)})" for c in others) or "none"
            problems.append(f"your settings ({own.describe()}) are not declared here; chains declared: {used}. "
                            "Give status the gateways' --max-level, --resolution-ms, --queue-type and --zero-bits")
        if others:
            notes.append(f"{len(others) + (1 if mine.declared else 0)} chains exist: messages in older ones keep "
                         "their due times and the older chains are removed once empty "
                         "(docs/operating.md: Changing the chain)")
        if held is None and consumers:
            notes.append(f"the distributor's {consumers} consumer(s) may each hold up to their prefetch "
                         "(--distributor-prefetch) messages; --metrics-url shows how many")
        if carried is None:
            notes.append("counts in the chain are of broker messages: gateways send messages going the same "
                         "way as one carrier (--carrier-messages), so each may hold several; --metrics-url "
                         "estimates how many")
        elif any(r.carriers is not None for r in rows):
            notes.append("≈: messages estimated from the broker's count of carriers and the gateways' "
                         "messages per carrier so far (their /metrics)")

    return problems, notes


def due_within(rows: Sequence[Row]) -> List[DueWithin]:
    """Cumulative: how many messages are certainly (at least) and possibly (at most) due
    within each horizon; 'later': beyond the last one."""
    counted = [r for r in rows if r.scheduled and r.exists and r.messages]
    out = []
    for label, ms in HORIZONS:
        at_least = sum(r.messages or 0 for r in counted if r.due_max_ms is not None and r.due_max_ms <= ms)
        at_most = sum(r.messages or 0 for r in counted if (r.due_min_ms or 0) < ms)
        out.append(DueWithin(label, ms, at_least, at_most))
    last = HORIZONS[-1][1]
    out.append(DueWithin("later", None, sum(r.messages or 0 for r in counted if (r.due_min_ms or 0) >= last),
                         sum(r.messages or 0 for r in counted if r.due_max_ms is None or r.due_max_ms > last)))
    return out


def gateways_text(n: Optional[int]) -> str:
    return "gateways: unknown" if n is None else f"{n} gateway{'s' if n != 1 else ''}"




