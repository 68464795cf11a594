"""What one status report reads: passive declares and streams over AMQP, and the gateways' /metrics over HTTP."""

import urllib.request
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from pika.exceptions import AMQPError

from topology import build
from topology.broker.inventory import Look, Prober, look_at_generation, read_registry
from topology.footprint import Fit, over_budget, reserved_handles
from topology.names import Names
from topology.registry import ChainKey, Registry, fold
from topology.model import cancel_window_ms
from topology.retirement import Observed
from topology.settings import QUEUE_TYPES, ChainSettings

from gateway.broker.plumbing.management import Management
from gateway.broker.run import stamp
from gateway.broker.tools import cancellations, index_reader
from gateway.commands.status.metrics import carried_from_metrics, held_from_metrics, retries_from_metrics
from gateway.commands.status.report import HORIZONS, Report, report
from gateway.core import listing
from gateway.core.selection import Selection
from gateway.settings import Settings


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


def read_report(connection, settings: Settings, own: ChainKey, now_ms: int,
                stamping: Tuple[Optional[Tuple[int, int]], Optional[bool]] = (None, None),
                metrics_urls: Sequence[str] = (), index_counts: bool = True) -> Report:
    """One status report: the broker's counts of the chains under the settings' prefix (`own`:
    the chain of these settings), what the gateways' /metrics at `metrics_urls` add, and
    (index_counts) the messages that wait, counted from the index."""
    prefix = settings.chain.prefix
    registry, chains, observed = observe(connection, prefix, own)
    held, source, carried = None, "give --metrics-url with the gateways' metrics ports to see them", None
    retried: Optional[Dict[str, Dict[str, int]]] = None
    if metrics_urls:
        try:
            pages = fetch_metrics(metrics_urls)
            held = held_from_metrics(pages, Names(prefix).distributor)
            carried = carried_from_metrics(pages) or {}
            retried = retries_from_metrics(pages)
            source = "metrics"
        except (OSError, ValueError) as exc:
            source = f"--metrics-url failed: {exc}"
    r = report(prefix, own, settings.lead_ms, registry, chains, observed, held, source, now_ms, carried)
    version = stamping[0]
    if settings.management_url and version is not None and version[0] == 3:
        fit = Fit(0, Management(settings.management_url, settings.urls[0], settings.tls).nodes())
        r.notes.append("file handles, by the management API: " + fit.said())
        if not fit.fits:
            r.problems.append(over_budget(fit))
    elif not r.missing:
        reserved = reserved_handles(build(own.settings(prefix)), version)
        if reserved is not None:
            r.notes.append(reserved)
    window_ms = cancel_window_ms(own.settings(prefix), settings.cancel_retention)
    records = cancellations.read(connection, Names(prefix), window_ms, settings.trusted_user)
    held_ids = {mid for mid, _ in records.ids}
    if index_counts and not r.missing:
        r.waiting = waiting_messages(connection, own.settings(prefix), settings.trusted_user, records, window_ms,
                                     now_ms)
    check_in = observed.queues.get(Names(prefix).check_in)
    promise, problem = cancel_guarantee(stamping[1], stamping[0], check_in.consumers if check_in else None)
    r.cancellations = {"held": len(held_ids), "window_ms": window_ms, "rules": len(records.rules), **promise}
    r.retries = retried
    if problem:
        r.problems.append(problem)
    return r


def waiting_messages(connection, chain: ChainSettings, trusted: str, records: cancellations.Recorded,
                     window_ms: int, now_ms: int) -> Dict[str, Any]:
    """The messages that wait, from the index, by due time (cumulative, as `due_within`)."""
    judge = listing.cancelled_by(records.store(window_ms, now_ms), records.rules, now_ms)
    ranges = [(label, ms) for label, ms in HORIZONS] + [("later", None)]
    try:
        view, found = index_reader.read(connection, chain, trusted, now_ms, lambda at: listing.View(
            now_ms, at, judge, Selection(), None, None, ranges))
        found.gaps += records.gaps()
    except index_reader.Missing:
        return {"total": None, "exact": False, "why": "the index of what waits is not declared (run `delay-gateway "
                                                        "declare` with this version)"}
    cumulative, running = {}, 0
    for (label, _), n in zip(ranges, view.counts.counts, strict=True):
        running += n if label != "later" else 0
        cumulative[label] = running if label != "later" else n
    return {"total": view.total, "due_within": cumulative, "exact": found.exact, "why": "; ".join(found.reasons())}
