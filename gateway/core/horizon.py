"""How far back a reader of the index looks, and what may wait unlisted (pure): from the
gateways' beats (gateway/core/index_records.py) and what the broker says of the queues where
messages wait for a gateway. `listing.View` reads from the horizon; `Found` (the reader's
answer) is exact only with a horizon of a minute and no gap.
"""

from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from topology.index_bands import RETENTION_SLACK_MS, span_ms

from gateway.core.index_records import LIVE_MS, Beat, Place

GRACE_MS = 60_000  # what a message may be overdue while the gateways keep up


@dataclass(frozen=True)
class Horizon:
    """How far back a message may be overdue and still wait, as a reader finds it."""

    at_ms: int
    exact: bool  # the gateways keep up: within GRACE_MS of the earliest due time they hold
    why: str  # when not: why everything kept is read


def live_beats(now_ms: int, beats: Iterable[Beat]) -> List[Beat]:
    """Each gateway's latest beat, of those that beat within LIVE_MS."""
    latest: Dict[bytes, Beat] = {}
    for b in beats:
        if now_ms - b.at_ms <= LIVE_MS and (b.gateway not in latest or b.at_ms > latest[b.gateway].at_ms):
            latest[b.gateway] = b
    return list(latest.values())


def silent(place: str, consumers: int, live: Sequence[Beat]) -> int:
    """How many consumers of a kind of queue no live beat accounts for."""
    counted: int = sum(getattr(b.consumers, place) for b in live)
    return max(0, consumers - counted)


def horizon(now_ms: int, beats: Iterable[Beat], places: Dict[str, Place]) -> Horizon:
    """From the gateways' beats and the `distributor` and `returning` places: every consumer
    of them beat lately and nothing waits unread there, so nothing is overdue by more than
    GRACE_MS past the earliest due time they hold. Else the reader looks as far back as the
    streams keep."""
    live = live_beats(now_ms, beats)
    everything = now_ms - RETENTION_SLACK_MS
    for place in ("distributor", "returning"):
        found = places.get(place, Place(0, 0))
        if found.ready:
            return Horizon(everything, False, f"{found.ready} message(s) wait unread in the {place} queue")
        if found.consumers == 0:
            return Horizon(everything, False, f"no gateway consumes the {place} queue")
        quiet = silent(place, found.consumers, live)
        if quiet:
            return Horizon(everything, False, f"{quiet} consumer(s) of the {place} queue said nothing for "
                                              f"{LIVE_MS // 1000} s (a gateway of an earlier version, or one blocked)")
    low = min([now_ms] + [b.low_ms for b in live])
    return Horizon(low - GRACE_MS, True, "")


def seen(now_ms: int, beats: Iterable[Beat]) -> Tuple[Optional[Dict[str, Place]], str]:
    """What the gateways saw of the queues where messages wait for them (`check_in`,
    `returning`, `distributor`), by the newest live beat that says (a reader with read
    permission only cannot look itself), and why not when none does."""
    live = live_beats(now_ms, beats)
    counted = [b for b in live if b.seen is not None]
    if counted:
        newest = max(counted, key=lambda b: b.at_ms)
        assert newest.seen is not None
        return newest.seen.places(), ""
    if not live:
        return None, (f"no gateway beat within {LIVE_MS // 1000} s (none runs, or none can write the index), so "
                      "whether messages wait unread in check-in, the distributor or the returning queue is not known")
    return None, ("the gateways that beat do not say what they see of the queues (a version before 1.0), so whether "
                  "messages wait unread in check-in, the distributor or the returning queue is not known")


def earlier_check_in(now_ms: int, beats: Iterable[Beat], places: Optional[Dict[str, Place]]) -> int:
    """How many gateways of 0.1.0 (DGB1 beats) may still read check-in: each beat within
    LIVE_MS, unless the broker's count of check-in's consumers shows that the later gateways
    account for all of them (a stopped one beats no more, but its last beat stays live a while)."""
    live = live_beats(now_ms, beats)
    earlier = sum(1 for b in live if b.first_layout and b.consumers.check_in)
    if earlier and places is not None and places["check_in"].consumers <= sum(
            b.consumers.check_in for b in live if not b.first_layout):
        return 0
    return earlier


def read_from_ms(b: int, at: Horizon) -> int:
    """Where a reader starts reading band b (by the time entries were written)."""
    return at.at_ms - span_ms(b)


@dataclass(frozen=True)
class Gap:
    """Why messages may wait unlisted, and until when (None: until someone acts)."""

    why: str
    until_ms: Optional[int] = None


def gaps(now_ms: int, beats: Iterable[Beat], check_in: Place, unlisted: Iterable[Gap]) -> List[Gap]:
    """What can wait unlisted beside the horizon: messages no gateway has read yet, a gateway
    that writes no entries or says nothing while it reads check-in, and what the registry
    records (messages from before the index: topology/registry.py's `unlisted`)."""
    live = live_beats(now_ms, beats)
    out: List[Gap] = []
    if check_in.ready:
        out.append(Gap(f"{check_in.ready} message(s) wait in check-in, not read by a gateway yet: listed once one "
                       "has read them"))
    quiet = silent("check_in", check_in.consumers, live)
    if quiet:
        out.append(Gap(f"{quiet} consumer(s) of check-in said nothing for {LIVE_MS // 1000} s (a gateway of an "
                       "earlier version, or one blocked): what they send on may not be listed"))
    blind = sum(1 for b in live if not b.indexes and b.consumers.check_in)
    if blind:
        out.append(Gap(f"{blind} gateway(s) run with --no-pending-index: what they send on is not listed"))
    reading = sum(1 for b in live if b.reading)
    if reading:
        out.append(Gap(f"{reading} gateway(s) held messages they had read and not sent on yet (waiting for "
                       "company in a carrier, or behind a cancel): listed once sent on, within the carrier wait"))
    blocked = sum(1 for b in live if b.blocked)
    if blocked:
        out.append(Gap(f"the broker blocks {blocked} gateway(s) (a resource alarm): messages may wait past due in "
                       "the chain, and are not listed once more than a minute overdue"))
    out += [g for g in unlisted if g.until_ms is None or g.until_ms > now_ms]
    return out
