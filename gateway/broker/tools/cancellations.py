"""What commands read of the cancellations stream (`<prefix>.cancellations`): the cancels by
id of the window, the rules live at its end and what each rule removed so far. A gateway
follows the stream itself (broker/run/cancelling.py's Follower); commands read it once."""

import time
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

from topology.broker.inventory import close_stream_reader, stream_channel
from topology.names import Names

from gateway.broker.run.cancelling import PREFETCH, window_start
from gateway.clock import wall_ms
from gateway.core import cancels, rules
from gateway.core.cancels import Store
from gateway.core.rules import Rules


@dataclass
class Recorded:
    """What the cancellations stream holds for the window (for commands): the cancels by id,
    oldest first, the rules live at its end, and what each rule removed so far."""

    ids: List[Tuple[bytes, cancels.Time]] = field(default_factory=list)
    rules: Rules = field(default_factory=lambda: Rules(0))
    tallies: Dict[bytes, int] = field(default_factory=dict)

    def store(self, window_ms: int, now_ms: int) -> Store:
        store = Store(window_ms)
        for mid, at in self.ids:
            store.add(mid, at, now_ms)
        return store


def read(connection, names: Names, window_ms: int, idle_s: float = 0.3) -> Recorded:
    """The records of the window, read until the stream is quiet for idle_s (for commands; a
    gateway follows the stream with `Follower`). Missing stream: nothing."""
    out = Recorded(rules=Rules(window_ms))
    channel = stream_channel(connection, names.cancellations)
    if channel is None:
        return out
    now = wall_ms()
    cutoff_us = (now - window_ms) * 1000
    tallied: List[Tuple[bytes, bytes, int]] = []
    seen = 0

    def on_record(ch, method, properties, body) -> None:
        nonlocal seen
        seen += 1
        headers = properties.wire.headers
        record = cancels.read_record(headers)
        if record is not None:
            if record[1].read_us >= cutoff_us:
                out.ids.append(record)
        elif (rule := rules.read_record(headers, body)) is not None:
            out.rules.add(rule, now)
        elif (tally := rules.read_tally(headers)) is not None:
            tallied.append(tally)
        ch.basic_ack(method.delivery_tag)

    channel.basic_qos(prefetch_count=PREFETCH)
    channel.basic_consume(names.cancellations, on_record, arguments={"x-stream-offset": window_start(window_ms)})
    counted, quiet_since = 0, time.monotonic()
    while time.monotonic() - quiet_since < idle_s:
        connection.process_data_events(time_limit=0.02)
        if seen != counted:
            counted, quiet_since = seen, time.monotonic()
    close_stream_reader(channel)
    out.tallies = rules.tallies(tallied)
    return out
