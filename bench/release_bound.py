"""What "frames built once" could save a release at most, measured without a broker.

Issue "release as bytes" asked for a new carrier format holding each message's publish
frames ready, so that a release copies bytes instead of unpacking an entry and framing it.
This measures the two steps such a format would remove, on a carrier of 1,000 x 1 KB
messages as check-in packs them today, against its best case (every message's frames
sliced out of one buffer and joined): `python -m bench.release_bound`. The difference is
the most it could save a released message; BENCHMARKS.md sets it beside what a message
costs the gateway end to end.
"""

import os
import time
from typing import Callable, List, Sequence, Tuple

from pika import spec

from gateway.broker.plumbing import publish_frames
from gateway.core import carrier, wire
from gateway.core.carrier import Entry
from gateway.core.wire import Properties, Table

MESSAGES = 1000
_PICK_UP = b"delay.pick-up"  # the default prefix's


def _entries() -> List[Entry]:
    props = Properties.build(delivery_mode=2, message_id="order-000001234", content_type="application/json",
                             headers=Table([wire.long("x-delay", 5000), wire.longstr("trace-id", b"4bf92f35")]))
    return [Entry(b"orders.created.%d" % (i % 10), props, os.urandom(1024), 1_000_000 + i, 123 + i)
            for i in range(MESSAGES)]


def frames(entries: Sequence[Entry]) -> bytes:
    """publish_frames.publish_all's loop: each message's three frames, joined."""
    pieces: List[bytes] = []
    for e in entries:
        key, raw, body = e.routing_key, e.user.raw, e.body
        pieces += [publish_frames._PUBLISH_HEAD.pack(spec.FRAME_METHOD, 1, 9 + len(_PICK_UP) + len(key), 60, 40, 0),
                   bytes((len(_PICK_UP),)), _PICK_UP, bytes((len(key),)), key, b"\x00\xce",
                   publish_frames._CONTENT_FRAME_HEAD.pack(spec.FRAME_HEADER, 1, 12 + len(raw), 60, 0, len(body)),
                   raw, b"\xce", publish_frames._BODY_FRAME_HEAD.pack(spec.FRAME_BODY, 1, len(body)), body, b"\xce"]
    return b"".join(pieces)


def _best_us(step: Callable[[], object], repeat: int = 9) -> float:
    """The fastest of `repeat` runs, per message."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return min(times) / MESSAGES * 1e6


def main() -> None:
    entries = _entries()
    body = carrier.pack(entries)
    accepted = [e.accepted_us for e in entries]
    built = frames(entries)
    spans: List[Tuple[int, int]] = []
    offset = 0
    for e in entries:
        size = len(frames([e]))
        spans.append((offset, offset + size))
        offset += size
    view = memoryview(built)
    unpack = _best_us(lambda: carrier.unpack(body, accepted))
    framing = _best_us(lambda: frames(entries))
    sliced = _best_us(lambda: b"".join([view[a:b] for a, b in spans]))  # one slice a message: its worst case
    print(f"carrier of {MESSAGES} x 1 KB, µs a message (best of 9):")
    print(f"  unpack (an Entry and its properties)  {unpack:6.2f}")
    print(f"  frames built at release               {framing:6.2f}")
    print(f"  frames kept in the carrier, sliced    {sliced:6.2f}")
    print(f"  at most saved                         {unpack + framing - sliced:6.2f}")
    print(f"carrier bytes: {len(body):,} today, {len(built):,} with frames "
          f"(+{100 * (len(built) - len(body)) / len(body):.1f} %)")


if __name__ == "__main__":
    main()
