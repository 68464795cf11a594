"""Parked messages: list them, and replay them into check-in once their cause is fixed.

Both read `<prefix>.parked` with basic.get and no auto-ack, so nothing leaves the queue
until it is safely elsewhere: `list` returns every message it looked at (closing the
channel requeues them), `replay` acknowledges a message only after the broker confirmed its
copy in check-in.

What due time a replayed message gets:
- parked after check-in had read it (unroutable at pick-up, or a later failure): it
  carries `x-gateway-due-at`, a time already past, so check-in sends it straight on;
  its `x-delay` is NOT applied again.
- parked before check-in could read it (an unreadable delay header): there is no due
  time; check-in reads the headers again, counting `x-delay` from the replay. If the
  header is still unreadable, it is parked again with the same reason.
"""

import argparse
import fnmatch
import json
import sys
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, List, Optional, Tuple

import pika
from pika.exceptions import AMQPError

from . import envelope


@dataclass(frozen=True)
class Parked:
    delivery_tag: int
    routing_key: str  # the user's key (parked messages keep it as their routing key)
    properties: pika.BasicProperties
    body: bytes

    @property
    def reason(self) -> str:
        return str((self.properties.headers or {}).get(envelope.ERROR, "(no reason recorded)"))

    @property
    def due_at(self) -> Optional[int]:
        value = (self.properties.headers or {}).get(envelope.DUE_AT)
        return value if isinstance(value, int) else None

    def summary(self) -> dict:
        return {"message_id": self.properties.message_id, "routing_key": self.routing_key,
                "reason": self.reason, "due_at": self.due_at, "bytes": len(self.body)}


def selected(message: Parked, reason: Optional[str], routing_key: Optional[str]) -> bool:
    """--reason is a substring of the reason; --routing-key a shell-style pattern."""
    if reason is not None and reason not in message.reason:
        return False
    if routing_key is not None and not fnmatch.fnmatchcase(message.routing_key, routing_key):
        return False
    return True


def report(messages: Iterable[Parked]) -> dict:
    messages = list(messages)
    return {
        "count": len(messages),
        "reasons": dict(Counter(m.reason for m in messages).most_common()),
        "routing_keys": dict(Counter(m.routing_key for m in messages).most_common()),
        "messages": [m.summary() for m in messages],
    }


def replay_properties(properties: pika.BasicProperties) -> pika.BasicProperties:
    """The parked message's properties without the parking reason; every other internal
    header (routing key, due time, set-aside expiration and delivery mode) stays."""
    headers = {k: v for k, v in (properties.headers or {}).items() if k != envelope.ERROR}
    return envelope.replace_properties(properties, headers=headers)


def fetch(channel, queue: str, limit: Optional[int] = None) -> List[Parked]:
    """Up to `limit` messages, unacknowledged (they stay owned by the queue)."""
    out: List[Parked] = []
    while limit is None or len(out) < limit:
        method, properties, body = channel.basic_get(queue, auto_ack=False)
        if method is None:
            break
        out.append(Parked(method.delivery_tag, method.routing_key, properties, body))
    return out


def replay(channel, names, reason: Optional[str] = None, routing_key: Optional[str] = None,
           limit: Optional[int] = None, dry_run: bool = False) -> Tuple[List[Parked], List[Parked]]:
    """Move selected parked messages to check-in. Returns (replayed, left in parked)."""
    channel.confirm_delivery()
    replayed, kept = [], []
    for message in fetch(channel, names.parked):
        if (limit is not None and len(replayed) >= limit) or not selected(message, reason, routing_key):
            kept.append(message)
            continue
        if not dry_run:
            # mandatory + confirms: basic_publish raises unless check-in has the message.
            channel.basic_publish(names.check_in, message.routing_key, message.body,
                                  replay_properties(message.properties), mandatory=True)
            channel.basic_ack(message.delivery_tag)
        replayed.append(message)
    for message in kept + (replayed if dry_run else []):
        channel.basic_nack(message.delivery_tag, requeue=True)
    return replayed, kept


# -- command line (wired into `delay-gateway parked`) ------------------------------------
def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["list", "replay"],
                   help="list: show what is parked and why; replay: move messages back into check-in")
    p.add_argument("--json", action="store_true", help="list: print JSON")
    p.add_argument("--reason", metavar="TEXT", help="only messages whose reason contains TEXT")
    p.add_argument("--routing-key", metavar="PATTERN", help="only routing keys matching this shell pattern")
    p.add_argument("--limit", type=int, metavar="N", help="list or replay at most N messages")
    p.add_argument("--dry-run", action="store_true", help="replay: say what would move, move nothing")


def command(args, open_channel, chain) -> int:
    names = chain.names
    try:
        with open_channel() as channel:
            if args.action == "list":
                found = [m for m in fetch(channel, names.parked, args.limit)
                         if selected(m, args.reason, args.routing_key)]
                print_report(report(found), args.json)
                return 0
            replayed, kept = replay(channel, names, args.reason, args.routing_key, args.limit, args.dry_run)
    except AMQPError as exc:
        print(f"delay-gateway parked {args.action}: {exc!r}; unacknowledged messages stay parked",
              file=sys.stderr)
        return 1
    verb = "would replay" if args.dry_run else "replayed"
    print(json.dumps({verb.replace(" ", "_"): len(replayed), "left_parked": len(kept),
                      "message_ids": [m.properties.message_id for m in replayed]}))
    return 0


def print_report(r: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(r, indent=2, default=str))
        return
    print(f"{r['count']} parked message(s)")
    if r["count"]:
        print("reasons:")
        for reason, n in r["reasons"].items():
            print(f"  {n:6d}  {reason}")
        print("routing keys:")
        for key, n in r["routing_keys"].items():
            print(f"  {n:6d}  {key!r}")
        print("message ids:")
        for m in r["messages"]:
            print(f"  {m['message_id']}  {m['routing_key']!r}  {m['reason']}")
