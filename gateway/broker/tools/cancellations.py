"""What commands read of the cancellations stream (`<prefix>.cancellations`): the cancels by
id of the window, the rules live at its end and what each rule removed so far. A gateway
follows the stream itself (broker/run/cancelling.py's Follower); commands read it once, up to
the stream's end as of their start, writing nothing (topology/broker/inventory.py's
`stream_ends`), and trust only the records the gateway user wrote (gateway/core/writers.py)."""

from dataclasses import dataclass, field
from typing import Dict, List, Tuple

from topology.broker.inventory import END_WAIT_S, read_stream, stream_ends
from topology.names import Names

from gateway.broker.run.cancelling import PREFETCH, window_start
from gateway.clock import wall_ms
from gateway.core import cancels, rules, writers
from gateway.core.cancels import Store
from gateway.core.horizon import Gap
from gateway.core.rules import Rules

QUIET_S = 0.3  # where the stream's end is not known: read until nothing came for this long


@dataclass
class Recorded:
    """What the cancellations stream holds for the window (for commands): the cancels by id,
    oldest first, the rules live at its end, and what each rule removed so far; what was
    passed over (records of another user) and whether the stream's end was known."""

    ids: List[Tuple[bytes, cancels.Time]] = field(default_factory=list)
    rules: Rules = field(default_factory=lambda: Rules(0))
    tallies: Dict[bytes, int] = field(default_factory=dict)
    doubts: writers.Doubts = field(default_factory=writers.Doubts)
    ended: bool = True  # read up to the stream's end as of the start (False: until it was quiet)

    def store(self, window_ms: int, now_ms: int) -> Store:
        store = Store(window_ms)
        for mid, at in self.ids:
            store.add(mid, at, now_ms)
        return store

    def gaps(self) -> List[Gap]:
        """Why a listing judged by these cancels may not be exact."""
        out = []
        if not self.ended:
            out.append(Gap(f"the cancellations stream: nothing came at its end within {END_WAIT_S:g} s (an empty "
                           "stream, or the broker slow): its cancels were read until it was quiet"))
        if self.doubts.other:
            out.append(Gap(f"{writers.UNTRUSTED} in the cancellations stream: {self.doubts.other} record(s) of "
                           "another user ignored (the gateways ignore them too)"))
        return out


def read(connection, names: Names, window_ms: int, trusted: str) -> Recorded:
    """The records of the window that the gateway user `trusted` wrote (and the unsigned ones
    a gateway reads: writers.cancellation_headers), up to the stream's end as of now (for
    commands; a gateway follows the stream with cancelling.Follower). Missing stream:
    nothing. Needs read permission on the stream, nothing else."""
    out = Recorded(rules=Rules(window_ms))
    stream = names.cancellations
    ends = stream_ends(connection, [stream])
    if stream in ends.missing:
        return out
    out.ended = stream not in ends.silent
    now = wall_ms()
    cutoff_us = (now - window_ms) * 1000
    tallied: List[Tuple[bytes, bytes, int]] = []

    def on_record(properties, body: bytes) -> None:
        props = properties.wire  # (a WireConnection: exact properties)
        out.doubts.count(writers.writer(props, trusted))
        headers = writers.cancellation_headers(props, trusted)
        record = cancels.read_record(headers)
        if record is not None:
            if record[1].read_us >= cutoff_us:
                out.ids.append(record)
        elif (rule := rules.read_record(headers, body)) is not None:
            out.rules.add(rule, now)
        elif (tally := rules.read_tally(headers)) is not None:
            tallied.append(tally)

    read_stream(connection, stream, window_start(window_ms), ends.offsets.get(stream), on_record, PREFETCH,
                idle_s=QUIET_S)
    out.tallies = rules.tallies(tallied)
    return out
