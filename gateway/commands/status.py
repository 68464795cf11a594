"""`delay-gateway status`: what waits where, and when it falls due.

The core (`report`, `text`, `as_json`) is pure: queue counts and settings in, a table out.
It never reads a message: a message's place in the chain bounds its due time, so counts
alone answer "when", at any number of messages. A message in level k's delay queue waits
at most 2^k units there and at most 2^k - 1 more in the levels below, then at most one unit
plus the lead in the distributor: it is due within 2^(k+1) units plus the lead. One in a
pass-through queue is due within 2^k units plus the lead; one in meditation needed more
than the chain's maximum when it entered, and is due at least one unit from now.

What AMQP cannot show is said so: the distributor's held messages (delivered to it and not
yet acknowledged) are not in any count a passive declare returns; `--metrics-url` reads
them from the gateways' /metrics.
"""

import json
import signal
import sys
import threading
import urllib.request
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from pika.exceptions import AMQPError

from topology.broker.inventory import Look, Prober, look_at_generation, read_registry
from topology.names import Names
from topology.registry import ChainKey, Registry, chain_queues, fold, level_queues
from topology.retirement import Observed
from topology.settings import MAX_LEVELS, QUEUE_TYPES

from gateway import stopping
from gateway.broker import cancelling, stamp
from gateway.broker import waiting as index
from gateway.core import cancels, waiting
from gateway.settings import default

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
class Window:
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
    due_within: List[Window]
    held_source: str  # "metrics" or why it is not known
    distributor_consumers: Optional[int]
    problems: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    # held (ids), window_ms, and what a cancel can promise here (docs/cancelling.md)
    cancellations: Optional[Dict[str, Any]] = None
    # per source queue: scheduled, delivered, gave_up (from --metrics-url; docs/retries.md)
    retries: Optional[Dict[str, Dict[str, int]]] = None
    # the publishers' messages that wait, from the index (gateway/core/waiting.py): total,
    # due_within (cumulative, by HORIZONS' labels and "later"), exact and why not; None: not read
    waiting: Optional[Dict[str, Any]] = None

    @property
    def missing(self) -> bool:
        """The gateway's fixed objects are not declared under this prefix."""
        return any(not r.exists for r in self.rows if r.role in ("check-in", "distributor"))

    @property
    def total(self) -> int:
        return sum(r.messages or 0 for r in self.rows if r.exists)


# -- the pure core ---------------------------------------------------------------------------
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
                    f"at least 1 unit from now (entered with more than the chain's {human_ms(chain_max)})",
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
            used = ", ".join(f"{c.key.describe()} ({_gateways(c.gateways)})" for c in others) or "none"
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



def due_within(rows: Sequence[Row]) -> List[Window]:
    """Cumulative: how many messages are certainly (at least) and possibly (at most) due
    within each horizon; 'later': beyond the last one."""
    counted = [r for r in rows if r.scheduled and r.exists and r.messages]
    out = []
    for label, ms in HORIZONS:
        at_least = sum(r.messages or 0 for r in counted if r.due_max_ms is not None and r.due_max_ms <= ms)
        at_most = sum(r.messages or 0 for r in counted if (r.due_min_ms or 0) < ms)
        out.append(Window(label, ms, at_least, at_most))
    last = HORIZONS[-1][1]
    out.append(Window("later", None, sum(r.messages or 0 for r in counted if (r.due_min_ms or 0) >= last),
                      sum(r.messages or 0 for r in counted if r.due_max_ms is None or r.due_max_ms > last)))
    return out


def _gateways(n: Optional[int]) -> str:
    return "gateways: unknown" if n is None else f"{n} gateway{'s' if n != 1 else ''}"


def human_ms(ms: int) -> str:
    for unit, size in (("years", 31_557_600_000), ("d", 86_400_000), ("h", 3_600_000), ("min", 60_000), ("s", 1000)):
        if ms >= size:
            value = ms / size
            return f"{value:.3g} {unit}"
    return f"{ms} ms"


def _window(r: Row) -> str:
    if r.note and not r.scheduled:
        return r.note
    if r.due_max_ms is None:
        return r.note or f"in {human_ms(r.due_min_ms or 0)} or later"
    text = f"within {human_ms(r.due_max_ms)}"
    return f"{text} ({r.note})" if r.note else text


def clock_text(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def text(r: Report) -> str:
    lines = [f"prefix {r.prefix!r} at {clock_text(r.at_ms)}; lead {r.lead_ms} ms"]
    if r.missing:  # every row would say "missing": only what to do
        return "\n".join(lines + [f"problem: {p}" for p in r.problems]) + "\n"
    if r.chains:
        lines.append("chains:")
        width = max(len(c.key.describe()) for c in r.chains)
        for c in r.chains:
            state = [] if c.declared else ["not declared"]
            if c.yours:
                state.insert(0, "your settings")
            if c.declared:
                state.append(_gateways(c.gateways))
            if c.empty_by_ms is not None:
                state.append(f"retiring, empty by {clock_text(c.empty_by_ms)}")
            lines.append(f"  {c.key.describe():<{width}}  {', '.join(state)}")
    width = max(len(row.label) for row in r.rows)
    lines += ["", f"{'waiting':<{width}}  {'messages':>9}  falls due"]
    for row in r.rows:
        if not row.exists and row.role in ("delay", "pass", "meditation"):
            shown = "missing"
        elif row.messages is None:
            shown = "?" if row.exists else "missing"
        else:
            shown = ("≈" if row.carriers is not None else "") + str(row.messages)
        lines.append(f"{row.label:<{width}}  {shown:>9}  {_window(row)}")
    held = next(row for row in r.rows if row.role == "held")
    total = f"{r.total}" + ("" if held.messages is not None else " + held")
    lines.append(f"{'total':<{width}}  {total:>9}")
    counted = (r.waiting or {}).get("due_within")
    lines += ["", f"{'due within':<12} {'at least':>9} {'at most':>9}" + (f" {'messages':>9}" if counted else "")]
    for w in r.due_within:
        lines.append(f"{w.within:<12} {w.at_least:>9} {w.at_most:>9}" + (f" {counted[w.within]:>9}" if counted else ""))
    if r.waiting is not None:
        lines.append(_waiting_line(r.waiting))
    if r.cancellations is not None:
        lines += ["", f"cancellations: {r.cancellations['held']} message id(s) cancelled within the retention "
                      f"window of {human_ms(r.cancellations['window_ms'])}",
                  f"cancels: {_promise(r.cancellations)}"]
    if r.retries:
        lines += ["", "retries by queue (the gateways' counts since they started): waiting ≈ scheduled - delivered"]
        for queue, counts in sorted(r.retries.items()):
            lines.append(f"  {queue}: {counts['scheduled']} scheduled, {counts['delivered']} delivered back, "
                         f"{counts['gave_up']} gave up (parked)"
                         + (f", {counts['parked']} parked (the queue was gone, or the broker refused it)"
                            if counts.get("parked") else ""))
    for note in r.notes:
        lines.append(f"note: {note}")
    for problem in r.problems:
        lines.append(f"problem: {problem}")
    return "\n".join(lines) + "\n"


def _waiting_line(w: Dict[str, Any]) -> str:
    if w.get("total") is None:
        return f"messages: {w['why']}"
    how = "exact" if w["exact"] else f"not exact: {w['why']}"
    return (f"messages: {w['total']} waiting, counted one by one from the index of what waits ({how}; "
            "`delay-gateway pending` lists them)")


def _promise(c: Dict[str, Any]) -> str:
    if c.get("arrival_stamp"):
        return "exact with any number of gateways (the broker stamps arrival times)"
    consumers = c.get("check_in_consumers")
    now = "" if consumers is None else f"; {consumers} now"
    why = "it does not stamp arrival times" if c.get("arrival_stamp") is False else "whether it stamps is unknown"
    return f"exact while one gateway consumes check-in ({why}{now})"


def as_json(r: Report, indent: Optional[int] = 2) -> str:
    def chain(c: Chain) -> dict:
        d = asdict(c)
        d["key"] = asdict(c.key)
        d["key"]["generation"] = c.key.generation
        d["chain"] = d.pop("key")
        return d

    doc = {"prefix": r.prefix, "at_ms": r.at_ms, "lead_ms": r.lead_ms, "total": r.total,
           "chains": [chain(c) for c in r.chains], "queues": [asdict(row) for row in r.rows],
           "due_within": [asdict(w) for w in r.due_within], "held_source": r.held_source,
           "distributor_consumers": r.distributor_consumers, "problems": r.problems, "notes": r.notes,
           "cancellations": r.cancellations, "retries": r.retries, "waiting": r.waiting}
    return json.dumps(doc, indent=indent) + "\n"


def held_from_metrics(texts: Iterable[str], distributor: str) -> int:
    """The distributors' held messages (every exit queue of the prefix), summed over the
    gateways' /metrics pages."""
    total = 0.0
    for name, labels, value in _samples(texts):
        queue = labels.get("queue", "")
        if name == "delay_gateway_held_messages" and (queue == distributor or queue.startswith(distributor + ".")):
            total += value
    return int(total)


def carried_from_metrics(texts: Iterable[str]) -> Optional[Dict[str, float]]:
    """Messages per publish into the chain, by what was sent (chain, meditation,
    distributor), summed over the gateways' /metrics pages; None if none were sent yet."""
    sums: Dict[str, List[float]] = {}
    for name, labels, value in _samples(texts):
        if name in ("delay_gateway_batched_messages_total", "delay_gateway_batch_publishes_total"):
            pair = sums.setdefault(labels.get("outcome", ""), [0.0, 0.0])
            pair[0 if name == "delay_gateway_batched_messages_total" else 1] += value
    ratios = {outcome: m / p for outcome, (m, p) in sums.items() if p}
    return ratios or None


def retries_from_metrics(texts: Iterable[str]) -> Dict[str, Dict[str, int]]:
    """Failed messages per source queue and what became of them (scheduled, delivered,
    gave_up, parked), summed over the gateways' /metrics pages (since each gateway started)."""
    out: Dict[str, Dict[str, int]] = {}
    for name, labels, value in _samples(texts):
        if name == "delay_gateway_retries_total":
            counts = out.setdefault(labels.get("queue", ""), {"scheduled": 0, "delivered": 0, "gave_up": 0,
                                                              "parked": 0})
            counts[labels.get("outcome", "")] = counts.get(labels.get("outcome", ""), 0) + int(value)
    return out


def _samples(texts: Iterable[str]):
    from prometheus_client.parser import text_string_to_metric_families

    for page in texts:
        for family in text_string_to_metric_families(page):
            for sample in family.samples:
                yield sample.name, sample.labels, sample.value


# -- the adapter -----------------------------------------------------------------------------
def observe(connection, prefix: str, own: ChainKey) -> Tuple[Optional[Registry], Set[ChainKey], Observed]:
    """Everything `report` needs from the broker: the registry, and passive declares of the
    fixed queues and of every queue any known chain can have."""
    fixed = Names(prefix)
    records = read_registry(connection, fixed)
    registry = None if records is None else fold(records)
    look = Look(Prober(connection))
    for name in (fixed.check_in, fixed.retry, fixed.returning, fixed.distributor, fixed.parking, fixed.parked,
                 *(f(t) for t in QUEUE_TYPES if t != "quorum" for f in (fixed.exit_returning, fixed.exit_distributor))):
        look.queue(name)
    known = set(registry.declared if registry else ()) | {own}
    chains: Set[ChainKey] = set(known)
    for key in {k.generation: k for k in sorted(known)}.values():
        chains |= look_at_generation(look, prefix, key, exchanges=False)
    look.prober.close()
    return registry, chains, look.observed()


def fetch_metrics(urls: Sequence[str], timeout: float = 2.0) -> List[str]:
    pages = []
    for url in urls:
        if not url.rstrip("/").endswith("/metrics"):
            url = url.rstrip("/") + "/metrics"
        with urllib.request.urlopen(url, timeout=timeout) as response:
            pages.append(response.read().decode())
    return pages


def cancel_guarantee(stamp_on: Optional[bool], version: Optional[Tuple[int, int]],
                     check_in_consumers: Optional[int]) -> Tuple[Dict[str, Any], Optional[str]]:
    """What a cancel can promise on this broker now, and a problem when it is less than exact."""
    found = {"guarantee": stamp.guarantee(stamp_on), "arrival_stamp": stamp_on,
             "check_in_consumers": check_in_consumers}
    if not stamp_on and (check_in_consumers or 0) > 1:
        return found, (f"{check_in_consumers} gateways consume check-in and the broker does not stamp arrivals: "
                       "a cancel read by one of them may not win over a message read by another at the same "
                       f"moment (docs/cancelling.md, Limits); {stamp.cancel_fix(version)}")
    return found, None


def arrival_stamp(connection, prefix: str) -> Tuple[Optional[Tuple[int, int]], Optional[bool]]:
    """(the broker's version, whether it stamps arrivals; None: the probe could not tell, e.g.
    without permission to declare under the prefix)."""
    try:
        return stamp.state(connection.channel(), prefix)
    except (AMQPError, TimeoutError):
        return stamp.version_of(getattr(connection._impl, "server_properties", None)), None


def one(connection, args, own: ChainKey, now_ms: int,
        stamping: Tuple[Optional[Tuple[int, int]], Optional[bool]] = (None, None)) -> Report:
    registry, chains, observed = observe(connection, args.prefix, own)
    held, source, carried = None, "give --metrics-url with the gateways' metrics ports to see them", None
    retried: Optional[Dict[str, Dict[str, int]]] = None
    urls = [u.strip() for u in (getattr(args, "metrics_url", None) or "").split(",") if u.strip()]
    if urls:
        try:
            pages = fetch_metrics(urls)
            held = held_from_metrics(pages, Names(args.prefix).distributor)
            carried = carried_from_metrics(pages) or {}
            retried = retries_from_metrics(pages)
            source = "metrics"
        except (OSError, ValueError) as exc:
            source = f"--metrics-url failed: {exc}"
    lead_ms = getattr(args, "lead_ms", default("lead_ms"))
    r = report(args.prefix, own, lead_ms, registry, chains, observed, held, source, now_ms, carried)
    window_ms = cancelling.retention_ms(own.settings(args.prefix), getattr(args, "cancel_retention", 0.0))
    records = cancelling.read(connection, Names(args.prefix), window_ms)
    held_ids = {mid for mid, _ in records}
    if getattr(args, "index", True) and not r.missing:
        r.waiting = waiting_messages(connection, Names(args.prefix), records, window_ms, now_ms)
    check_in = observed.queues.get(Names(args.prefix).check_in)
    promise, problem = cancel_guarantee(stamping[1], stamping[0], check_in.consumers if check_in else None)
    r.cancellations = {"held": len(held_ids), "window_ms": window_ms, **promise}
    r.retries = retried
    if problem:
        r.problems.append(problem)
    return r


def waiting_messages(connection, names: Names, records: Sequence[Tuple[bytes, cancels.Time]], window_ms: int,
                     now_ms: int) -> Dict[str, Any]:
    """The messages that wait, from the index, by due time (cumulative, as `due_within`)."""
    store = cancels.Store(window_ms)
    for mid, at in records:
        store.add(mid, at, now_ms)
    ranges = [(label, ms) for label, ms in HORIZONS] + [("later", None)]
    try:
        view, found = index.read(connection, names, now_ms, lambda at: waiting.View(
            now_ms, at, waiting.cancelled_by(store, now_ms), lambda m: True, 0, lambda m: None, ranges))
    except index.Missing:
        return {"total": None, "exact": False, "why": "the index of what waits is not declared (run `delay-gateway "
                                                        "declare` with this version)"}
    cumulative, running = {}, 0
    for (label, _), n in zip(ranges, view.counts.counts, strict=True):
        running += n if label != "later" else 0
        cumulative[label] = running if label != "later" else n
    return {"total": view.total, "due_within": cumulative, "exact": found.horizon.exact, "why": found.horizon.why}


def command(args, open_channel, own: ChainKey, clock) -> int:
    """Print the report once, or every --interval seconds with --watch (redrawn in place
    on a terminal) until interrupted. Exit 3 when the topology is not declared (once)."""
    stop = threading.Event()
    if args.watch:
        # Ctrl-C ends the watch between two reports: raised inside pika instead, it can leave
        # the connection unable to close.
        previous = signal.signal(signal.SIGINT, stopping.setter(stop))
    try:
        return _reports(args, open_channel, own, clock, stop)
    finally:
        if args.watch:
            signal.signal(signal.SIGINT, previous)


def _reports(args, open_channel, own: ChainKey, clock, stop: threading.Event) -> int:
    with open_channel() as channel:
        connection = channel.connection
        stamping = arrival_stamp(connection, args.prefix)
        while not stop.is_set():
            r = one(connection, args, own, clock(), stamping)
            if r.missing and not args.watch and not args.json:
                # Nothing under this prefix: the one useful line, not a table of "missing".
                print(f"delay-gateway status: {r.problems[0]}", file=sys.stderr)
                return 3
            # --watch --json: one document per line, for a reader that follows the stream
            out = as_json(r, None if args.watch else 2) if args.json else text(r)
            if args.watch and sys.stdout.isatty():
                out = "\x1b[H\x1b[2J" + out  # home and clear: redraw in place
            sys.stdout.write(out)
            sys.stdout.flush()
            if not args.watch:
                return 3 if r.missing else 0
            stop.wait(args.interval)
    return 0
