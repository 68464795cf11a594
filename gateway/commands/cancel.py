"""`delay-gateway cancel ID [ID ...]`: cancel scheduled messages by their message id.

Publishes one cancel per id to `<prefix>.cancel` with confirms (what any AMQP client does,
docs/cancelling.md), then says per id what can be known from the cancellations stream:

- `cancelled`: the gateway recorded this cancel (at the time shown): every message with
  this id accepted before it will not be delivered;
- `already cancelled at T, cancelled again`: a cancel for the id was recorded before (a
  message published between the two is cancelled by the new one);
- `queued`: the broker took the cancel but the gateway has not recorded it within --wait
  seconds (no gateway running, or a backlog in check-in): it takes effect when check-in
  reads it, for the messages published before it.

Whether a message was already delivered cannot be known: the gateway keeps no record of
deliveries (nothing beside RabbitMQ), and a delivered message has left it. A cancel of a
delivered or unknown id is harmless; the line says so. Exit 0 when every cancel was
confirmed; 2 when an id is not one a message can have (the others are still cancelled).
"""

import argparse
import sys
import time
from typing import Dict, List, Optional, Tuple

import pika

from topology.broker.permissions import Refused, needing

from gateway.broker.tools import cancellations
from gateway.broker.plumbing.amqp import blocking_channel, refused
from gateway.core import cancels
from gateway.settings import Settings, UsageError
from gateway.times import iso_ms

CANCELLER = "the canceller's line"  # its permissions in docs/security.md
NOT_KNOWN = "whether it was already delivered cannot be known (the gateway keeps no record of deliveries)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("ids", nargs="*", metavar="ID", help="message ids to cancel")
    p.add_argument("--from-file", metavar="PATH", help="also cancel the ids in this file, one a line (- : stdin)")
    p.add_argument("--wait", type=float, default=10.0, metavar="SECONDS",
                   help="how long to wait for the gateway to record the cancels (default 10)")


def read_ids(given: List[str], from_file: Optional[str]) -> List[str]:
    ids = list(given)
    if from_file:
        try:
            f = sys.stdin if from_file == "-" else open(from_file, encoding="utf-8")
        except OSError as exc:
            raise UsageError(f"--from-file: cannot read {from_file}: {exc.strerror}") from None
        with f:
            ids += [line.rstrip("\r\n") for line in f if line.strip()]
    if not ids:
        raise UsageError("no message id given: name them, or --from-file PATH")
    return ids


def main(settings: Settings, ids: List[str], from_file: Optional[str], wait: float) -> int:
    chain = settings.chain
    names = chain.names
    good: List[bytes] = []
    bad = 0
    for n, text in enumerate(read_ids(ids, from_file), 1):
        try:
            good.append(cancels.checked_id(text))
        except cancels.BadCancel as exc:
            bad += 1
            print(f"delay-gateway cancel: error: id {n} ({text[:40]!r}): {exc}", file=sys.stderr)
    if not good:
        return 2
    window_ms = settings.cancel_window_ms
    trusted = settings.trusted_user
    with blocking_channel(settings.one_vhost_urls, "delay-gateway cancel", settings.tls, CANCELLER) as channel:
        try:
            before: Optional[Dict[bytes, int]] = latest(
                cancellations.read(channel.connection, names, window_ms, trusted).ids)
        except Refused as exc:  # may not read the cancellations stream: the cancels go all the same
            print(f"delay-gateway cancel: note: {refused(exc, exc.reply_text, '', CANCELLER)}; without it this "
                  "command cannot say whether a gateway recorded the cancels", file=sys.stderr)
            before = None
        channel.confirm_delivery()
        for mid in good:
            try:
                with needing("write"):
                    channel.basic_publish(names.cancel, "", b"", pika.BasicProperties(message_id=_text(mid),
                                                                                      delivery_mode=2),
                                          mandatory=True)
            except pika.exceptions.UnroutableError:
                print(f"delay-gateway cancel: {names.cancel} is bound to no queue: declare the topology "
                      "(delay-gateway declare) or start the gateway", file=sys.stderr)
                return 3
        if before is None:
            for mid in good:
                print(f"{mid.decode('utf-8', 'backslashreplace')}: sent (the broker confirmed it): it applies to "
                      "messages published before it once check-in reads it")
            return 2 if bad else 0
        recorded = wait_recorded(channel.connection, names, window_ms, trusted, good, before, wait)
    for mid in good:
        print(line(mid, before.get(mid), recorded.get(mid)))
    return 2 if bad else 0


def _text(mid: bytes) -> str:
    # pika sends a str property as UTF-8; an id that is not UTF-8 is not a pika message's id
    return mid.decode("utf-8", "surrogateescape")


def latest(records: List[Tuple[bytes, cancels.Time]]) -> Dict[bytes, int]:
    """id -> when its latest cancel was read (µs)."""
    out: Dict[bytes, int] = {}
    for mid, at in records:
        out[mid] = max(at.read_us, out.get(mid, at.read_us))
    return out


def wait_recorded(connection, names, window_ms: int, trusted: str, ids: List[bytes], before: Dict[bytes, int],
                  wait_s: float) -> Dict[bytes, int]:
    """The new cancels' times, once the gateway recorded them (up to wait_s)."""
    deadline = time.monotonic() + wait_s
    while True:
        found = {mid: at for mid, at in latest(cancellations.read(connection, names, window_ms, trusted).ids).items()
                 if mid in ids and at != before.get(mid)}
        if len(found) == len(set(ids)) or time.monotonic() >= deadline:
            return found
        time.sleep(0.2)


def line(mid: bytes, before: Optional[int], now: Optional[int]) -> str:
    name = mid.decode("utf-8", "backslashreplace")
    if now is None:
        return (f"{name}: queued: the broker has it, but no gateway has recorded it yet (none running, or a "
                "backlog in check-in); it applies to messages published before it once check-in reads it")
    if before is not None:
        return (f"{name}: already cancelled at {iso_ms(before // 1000)}; cancelled again at {iso_ms(now // 1000)}; "
                f"{NOT_KNOWN}")
    return f"{name}: cancelled at {iso_ms(now // 1000)}: not delivered if still scheduled; {NOT_KNOWN}"
