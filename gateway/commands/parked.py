"""Parked messages: list them, and replay them once their cause is fixed.

Both read `<prefix>.parked` with basic.get and no auto-ack, so nothing leaves the queue
until it is safely elsewhere: `list` hands back every message it looked at (closing the
channel requeues them), `replay` acknowledges a message only after the broker confirmed its
copy. The parked queue's delivery limit is set so high that no number of looks removes a
message on any broker version (RabbitMQ 4 would otherwise drop it after 20).

Where a replayed message goes:
- it has a due time (it was parked after check-in had read it: unroutable at pick-up, or
  refused by the broker on its way): to the distributor, which delivers it at once (the
  time is past) or holds it until due. Its `x-delay` is NOT applied again.
- it has none (its delay header could not be read, or the broker dead-lettered it from
  check-in): to check-in, exactly as its publisher sent it. If the header is still
  unreadable it is parked again with the same reason.
- it is a cancel or a rule (no message id, a value that cannot be read, a rule sent to
  `<prefix>.cancel`): back to the exchange it was sent to (`<prefix>.cancel` or
  `<prefix>.rules`), exactly as its publisher sent it; it is parked again with the same
  reason, as no replay can mend it. It is never sent on as a message.
- it is a retry (it gave up after the last attempt, or its queue was gone): back to its
  queue, with the attempts started afresh (no `x-retry-attempt`).

Every format a message was ever parked in is read this way: a cancel parked before 7438e7c
is known by its reason (`unrecorded_cancel`); a message in the first format (2026-11-21,
envelope.first_format), parked by its version or parked whole since because no version
between read that format, goes on with its publisher's properties and due time restored.
"""

import argparse
import fnmatch
import json
import re
import sys
from collections import Counter
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

from pika.exceptions import AMQPError

from gateway.broker.plumbing import lazy_properties
from gateway.broker.plumbing.amqp import blocking_channel
from gateway.core import envelope, retries
from gateway.core.envelope import Inside
from gateway.core.handlers import DEATH_REASONS
from gateway.core.wire import Properties
from gateway.settings import Settings, argument, integer


@dataclass(frozen=True)
class Parked:
    delivery_tag: int
    props: Properties  # as it sits in the parked queue
    body: bytes
    queue_key: bytes  # its routing key in the parked queue

    @property
    def inside(self) -> Inside:
        """How the gateway parked it: in today's format, or the first (envelope.first_format),
        parked by its version or parked whole since (its properties are then the first
        format's: `NOT_OURS`)."""
        inside = Inside(self.props)
        if not inside.complete:
            return envelope.first_format(self.props) or inside
        if inside.due_ms is None and inside.user is not None and NOT_OURS in (inside.error or ""):
            first = envelope.first_format(inside.user)
            if first is not None:
                first.error = inside.error
                return first
        return inside

    @property
    def user(self) -> Properties:
        """The publisher's properties."""
        inside = self.inside
        return inside.user if inside.complete and inside.user is not None else envelope.for_pick_up(self.props)

    @property
    def routing_key(self) -> bytes:
        """The publisher's routing key."""
        inside = self.inside
        return inside.routing_key if inside.complete and inside.routing_key is not None else self.queue_key

    @property
    def reason(self) -> str:
        error = self.inside.error
        if error:
            return error
        death = envelope.last_death(self.props.headers)
        if death is not None:
            why = str(death.get("reason", "?"))
            return f"dead-lettered from queue {death.get('queue', '?')}: {DEATH_REASONS.get(why, why)}"
        return "(no reason recorded)"

    @property
    def due_at(self) -> Optional[int]:
        inside = self.inside
        return inside.due_ms if inside.complete else None

    def summary(self) -> dict:
        return {"message_id": self.user.text("message_id"), "routing_key": envelope.readable_key(self.routing_key),
                "reason": self.reason, "due_at": self.due_at, "bytes": len(self.body)}


# In the reason of a message parked whole because it was not in the gateway's format (since
# 1013189: "reached the distributor ...", "came back from meditation ...").
NOT_OURS = "not in the gateway's format"
# The reasons check-in parked a cancel it could not record with before 7438e7c, which gave a
# parked cancel no other mark (since then: x-gateway-exchange, <prefix>.cancel). Check-in
# parks nothing else with them.
_UNRECORDED_CANCEL = re.compile(
    r"a cancel needs the id of the message to cancel as its message_id property"
    r"|a cancel's message_id must be text, not \w+"
    r"|a cancel's message_id is empty: give the id of the message to cancel"
    r"|message id of \d+ bytes: at most 255 \(AMQP's message_id\)")


def unrecorded_cancel(inside: Inside) -> bool:
    """A cancel check-in could not record, parked before 7438e7c (no mark but its reason)."""
    return inside.complete and inside.exchange is None and inside.due_ms is None \
        and inside.error is not None and _UNRECORDED_CANCEL.fullmatch(inside.error) is not None


def selected(message: Parked, reason: Optional[str], routing_key: Optional[str]) -> bool:
    """--reason is a substring of the reason; --routing-key a shell-style pattern."""
    if reason is not None and reason not in message.reason:
        return False
    if routing_key is not None and not fnmatch.fnmatchcase(envelope.readable_key(message.routing_key), routing_key):
        return False
    return True


# What varies from message to message inside a reason: quoted values (a routing key, a
# header's text; not the names of exchanges and queues, which are the same for all) and long
# numbers (a delay, a due time). Replaced, they leave the kind of reason to group by.
# (a quote opens a value only where a word does not go on: "the retry's queue 'x'" quotes x)
_QUOTED = re.compile(r"(?<!\w)(?:'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")")
_NAMED = ("exchange ", "queue ")
_NUMBER = re.compile(r"-?\d{5,}")
EXAMPLES = 5  # routing keys shown per kind


def kind(reason: str) -> str:
    """The reason without what is particular to one message: what groups messages parked alike."""
    def value(m: "re.Match[str]") -> str:
        return m.group(0) if reason[:m.start()].endswith(_NAMED) else "'…'"
    return _NUMBER.sub("N", _QUOTED.sub(value, reason))


def report(messages: Iterable[Parked]) -> dict:
    messages = list(messages)
    kinds: Dict[str, Counter] = {}
    for m in messages:
        kinds.setdefault(kind(m.reason), Counter())[envelope.readable_key(m.routing_key)] += 1
    return {
        "count": len(messages),
        "kinds": [{"kind": k, "count": sum(keys.values()), "routing_keys": dict(keys.most_common())}
                  for k, keys in sorted(kinds.items(), key=lambda item: -sum(item[1].values()))],
        "reasons": dict(Counter(m.reason for m in messages).most_common()),
        "routing_keys": dict(Counter(envelope.readable_key(m.routing_key) for m in messages).most_common()),
        "messages": [m.summary() for m in messages],
    }


def destination(message: Parked, names) -> Tuple[str, bytes, Properties]:
    """Where `replay` sends it, with which routing key and properties (see the module doc)."""
    inside = message.inside
    for sent_to in (names.cancel, names.rules):
        if inside.complete and inside.exchange == sent_to:
            return sent_to, message.routing_key, message.user  # a cancel or rule, as its publisher sent it
    if unrecorded_cancel(inside):
        return names.cancel, message.routing_key, message.user
    if inside.complete and inside.exchange == "" and inside.user is not None and inside.routing_key is not None:
        return "", inside.routing_key, retries.afresh(inside.user)  # a retry: to its queue, attempts afresh
    if inside.complete and inside.due_ms is not None:
        return names.distributor, b"", inside.next_hop()
    return names.check_in, message.routing_key, message.user


def fetch(channel, queue: str, limit: Optional[int] = None) -> List[Parked]:
    """Up to `limit` messages, unacknowledged (they stay owned by the queue)."""
    out: List[Parked] = []
    while limit is None or len(out) < limit:
        method, properties, body = channel.basic_get(queue, auto_ack=False)
        if method is None:
            break
        out.append(Parked(method.delivery_tag, properties.wire, body, envelope.as_bytes(method.routing_key)))
    return out


def replay(channel, names, reason: Optional[str] = None, routing_key: Optional[str] = None,
           limit: Optional[int] = None, dry_run: bool = False) -> Tuple[List[Parked], List[Parked]]:
    """Move selected parked messages on. Returns (replayed, left in parked)."""
    channel.confirm_delivery()
    replayed: List[Parked] = []
    kept: List[Parked] = []
    for message in fetch(channel, names.parked):
        if (limit is not None and len(replayed) >= limit) or not selected(message, reason, routing_key):
            kept.append(message)
            continue
        if not dry_run:
            exchange, key, props = destination(message, names)
            # mandatory + confirms: basic_publish raises unless the broker has the message.
            channel.basic_publish(exchange, key, message.body, lazy_properties.WireProperties(props), mandatory=True)
            channel.basic_ack(message.delivery_tag)
        replayed.append(message)
    for message in kept + (replayed if dry_run else []):
        channel.basic_nack(message.delivery_tag, requeue=True)
    return replayed, kept


# -- command line (wired into `delay-gateway parked`) ------------------------------------
def _selection(p: argparse.ArgumentParser, verb: str) -> None:
    p.add_argument("--reason", metavar="TEXT", help="only messages whose reason contains TEXT")
    p.add_argument("--routing-key", metavar="PATTERN", help="only routing keys matching this shell pattern")
    p.add_argument("--limit", type=argument(integer(1)), metavar="N", help=f"{verb} at most N messages")


def list_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON: one entry per message, and the kinds of reason")
    _selection(p, "list")


def replay_options(p: argparse.ArgumentParser) -> None:
    _selection(p, "replay")
    p.add_argument("--dry-run", action="store_true", help="say what would move, move nothing")


ACTIONS = {
    "list": ("show what is parked and why: counts by kind of reason, with example routing keys and message ids "
             "(moves nothing, however often it runs)", list_options),
    "replay": ("send parked messages on again once their cause is fixed: each is removed from parked only once "
               "the broker confirmed its copy (docs/operating.md: Parked messages)", replay_options),
}


def main(settings: Settings, action: str, reason: Optional[str], routing_key: Optional[str], limit: Optional[int],
         json: bool = False, dry_run: bool = False) -> int:
    """`delay-gateway parked ACTION` with its options (`json`: list's; `dry_run`: replay's)."""
    names = settings.chain.names
    try:
        with blocking_channel(settings.one_vhost_urls, "delay-gateway parked", settings.tls) as channel:
            if action == "list":
                found = [m for m in fetch(channel, names.parked, limit) if selected(m, reason, routing_key)]
                print_report(report(found), json)
                return 0
            replayed, kept = replay(channel, names, reason, routing_key, limit, dry_run)
    except AMQPError as exc:
        print(f"delay-gateway parked {action}: {exc!r}; unacknowledged messages stay parked", file=sys.stderr)
        return 1
    print_replayed(replayed, kept, dry_run)
    return 0


def print_replayed(replayed: List[Parked], kept: List[Parked], dry_run: bool) -> None:
    verb = "would replay" if dry_run else "replayed"
    print(json.dumps({verb.replace(" ", "_"): len(replayed), "left_parked": len(kept),
                      "message_ids": [m.user.text("message_id") for m in replayed]}))


def print_report(r: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(r, indent=2, default=str))
        return
    print(f"{r['count']} parked message(s)")
    if r["count"]:
        print("reasons:")
        for k in r["kinds"]:
            keys = list(k["routing_keys"].items())
            shown = ", ".join(f"{key!r} ({n})" for key, n in keys[:EXAMPLES])
            more = f" and {len(keys) - EXAMPLES} more" if len(keys) > EXAMPLES else ""
            print(f"  {k['count']:6d}  {k['kind']}")
            print(f"          routing keys: {shown}{more}")
        print("routing keys:")
        for key, n in r["routing_keys"].items():
            print(f"  {n:6d}  {key!r}")
        print("message ids:")
        for m in r["messages"]:
            print(f"  {m['message_id']}  {m['routing_key']!r}  {m['reason']}")
