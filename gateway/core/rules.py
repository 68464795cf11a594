"""Group cancels as rules (pure): one record that cancels every message its filter selects
(selection.Selection) that was taken in before it, wherever the message is.

A rule is published to `<prefix>.rules` (a right apart from cancelling one id, which is
`<prefix>.cancel`: docs/security.md), which is bound to the check-in queue: it queues behind
every message published before it. It carries the filter in headers, the public vocabulary
below; the check-in consumer turns it into a *record* in the cancellations stream (its name
and times in headers, the filter, normalised, in the body: `FILTER_MAGIC`), under the same
fence as a cancel by id. Every gateway follows the stream into `Rules` and judges each
message it reads, holds, sends round meditation, retries or releases against the live rules
exactly as against the cancels by id: a rule cancels a message iff its filter selects it and
the rule came after it (cancels.after). So a group cancel is one publish however many
messages it matches, works while every gateway is down (it waits in check-in behind the
messages it concerns), and covers messages no index has seen.

The vocabulary on `<prefix>.rules` (any AMQP client):

    x-cancel-key          an AMQP topic pattern on the routing key the message arrives with
                          (a retry's: the name of the queue it goes back to)
    x-cancel-id           a message id, or a prefix ending in '*', or a handle ('@...'); text
                          or an array of them
    x-cancel-due-after    due at or after (epoch ms)
    x-cancel-due-before   due at or before (epoch ms)
    x-cancel-header       a table: header name -> value (compared as text)
    x-cancel-retries      true: only retries
    x-cancel-all          true: every message; required when no filter is given or the filter
                          selects every message (`#`)
    x-cancel-rule         the rule's name (optional; what `pending rules` shows and `pending
                          withdraw` names; default: one made from the filter)
    x-cancel-withdraw     (alone, or with x-cancel-rule) withdraw the rules of this name
                          recorded before it: from then on they cancel nothing more

Every value is checked and bounded; a header of the family that is not one of these, or a
value that cannot be read exactly, refuses the rule with the reason (it is parked: a typo
must never widen a rule). A record read back without the filter it was written with is
refused too, never applied wider: the filter travels in the record's body, which every
broker keeps whole (RabbitMQ 3.10's streams drop array and table header values).

Gateways add, in the same stream, *tallies*: how many messages each gateway process removed
by each rule so far (cumulative, so a lost record costs nothing but a late count).
"""

import base64
import datetime
import hashlib
from collections import deque
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Callable, Deque, Dict, Iterable, List, Optional, Set, Tuple, Union

from gateway.core import cancels, wire
from gateway.core.cancels import BadCancel, Time
from gateway.core.selection import Selection, checked_pattern, literal_words, selects_every_key
from gateway.core.wire import Properties, Table

FAMILY = "x-cancel-"
KEY = "x-cancel-key"
ID = "x-cancel-id"
DUE_AFTER = "x-cancel-due-after"
DUE_BEFORE = "x-cancel-due-before"
HEADER = "x-cancel-header"
RETRIES = "x-cancel-retries"
ALL = "x-cancel-all"
NAME = "x-cancel-rule"
WITHDRAW = "x-cancel-withdraw"
VOCABULARY = (KEY, ID, DUE_AFTER, DUE_BEFORE, HEADER, RETRIES, ALL, NAME, WITHDRAW)

# On the records in the cancellations stream (beside the times of cancels.RECORD_AT /
# RECORD_ARRIVED):
RECORD_RULE = "x-gateway-rule"  # a rule: its name; its filter is the record's body
RECORD_WITHDRAWN = "x-gateway-rule-withdrawn"  # a withdrawal: the name withdrawn
RECORD_TALLY = "x-gateway-rule-tally"  # a tally: the rule's name ...
TALLY_GATEWAY = "x-gateway-tally-gateway"  # ... the gateway process (16 bytes) ...
TALLY_REMOVED = "x-gateway-tally-removed"  # ... and how many it removed by it so far
# A rule record's body: this, then the filter in the vocabulary as an AMQP field table
# (with its 32-bit length). Until 2026-11-28 the filter was in the record's headers, which
# RabbitMQ 3.10's streams keep only where they are scalars (`_first_format`).
FILTER_MAGIC = b"DGR1"

MAX_NAME_BYTES = 255
MAX_IDS = 1000  # a rule travels in one header frame: for more ids, cancel by id
MAX_HEADERS = 32
MAX_VALUE_BYTES = 1024  # of a header value a rule compares
MAX_RECORD_BYTES = 64_000
MAX_EPOCH_MS = 2**63 - 1
# Live rules a gateway holds at most: check-in refuses a rule beyond them (withdraw some, or
# cancel by id). Each costs memory and, for a message it may select, one comparison: so at most
# MAX_BROAD rules every message is compared with (`Rules._place`), and MAX_SHARED in the bucket
# of any one id, word or header value.
MAX_LIVE = 10_000
MAX_BROAD = 64
MAX_SHARED = 32
BROAD = ("prefixes", "shape", "retries", "rest")


@dataclass(frozen=True)
class Request:
    """What a rule asks for, as published (before check-in gives it its time)."""

    select: Selection
    everything: bool = False  # x-cancel-all: no filter
    name: Optional[bytes] = None


@dataclass(frozen=True)
class Withdrawing:
    """A request to withdraw the rules of this name."""

    name: bytes


@dataclass(frozen=True)
class Rule:
    """A rule as recorded: it cancels what `select` selects, taken in before `at`."""

    name: bytes
    select: Selection
    at: Time
    everything: bool = False

    def came_after(self, message: Optional[Time]) -> bool:
        """Whether the rule came after a message taken in at this time (None: unknown, which is
        before any rule: the message entered before read times were kept)."""
        return message is None or cancels.after(self.at, message)


@dataclass(frozen=True)
class Withdrawal:
    name: bytes
    at: Time


@dataclass(frozen=True)
class Refused:
    """A rule record that cannot be read exactly (a filter lost, or one this version does not
    know): it cancels nothing, but it was recorded (what waits for it to be recorded goes on)."""

    name: bytes
    at: Time
    why: str


def is_rule(headers: Table) -> bool:
    """Whether a message carries the rules' vocabulary (on `<prefix>.cancel`: refused there)."""
    return any(e.name.startswith(FAMILY.encode()) for e in headers.entries)


def default_name(select: Selection, everything: bool) -> bytes:
    """A rule's name when its publisher gave none: 'rule-' and a digest of its filter, the same
    whenever the rule is read again (after a crash, check-in reads it again: one rule)."""
    digest = hashlib.blake2b(_filter_table(select, everything).encode(), digest_size=10).digest()
    return b"rule-" + base64.b32encode(digest).rstrip(b"=").lower()


# -- reading the vocabulary -------------------------------------------------------------------
def requested(headers: Table) -> Union[Request, Withdrawing]:
    """The rule (or withdrawal) a cancel's headers ask for. Raises BadCancel, and only that."""
    try:
        return _requested(headers)
    except BadCancel:
        raise
    except Exception as exc:  # (every value is checked; this is the net under the checks)
        raise BadCancel(f"the rule cannot be read: {exc!r}"[:200]) from None


def _requested(headers: Table) -> Union[Request, Withdrawing]:
    given: Dict[str, Any] = {}
    for e in headers.entries:
        if not e.name.startswith(FAMILY.encode()):
            continue
        header = e.name.decode("utf-8", "replace")
        if header not in VOCABULARY:
            raise BadCancel(f"unknown rule header {header!r}: a rule takes {', '.join(VOCABULARY)}"[:300])
        if header in given:
            raise BadCancel(f"{header} given twice")
        given[header] = e.value
    name = _name(given[NAME], NAME) if NAME in given else None
    if WITHDRAW in given:
        withdrawn = _name(given.pop(WITHDRAW), WITHDRAW)
        given.pop(NAME, None)
        if given:
            raise BadCancel(f"{WITHDRAW} takes no filter ({', '.join(sorted(given))} given): withdraw first, "
                            "then publish the new rule")
        if name is not None and name != withdrawn:
            raise BadCancel(f"{WITHDRAW} names {withdrawn!r} but {NAME} names {name!r}"[:300])
        return Withdrawing(withdrawn)
    ids = _ids(given[ID]) if ID in given else ()
    key = _pattern(given[KEY]) if KEY in given else None
    after = _epoch_ms(given[DUE_AFTER], DUE_AFTER) if DUE_AFTER in given else None
    before = _epoch_ms(given[DUE_BEFORE], DUE_BEFORE) if DUE_BEFORE in given else None
    values = _headers(given[HEADER]) if HEADER in given else ()
    retries = _flag(given[RETRIES], RETRIES) if RETRIES in given else False
    everything = _flag(given[ALL], ALL) if ALL in given else False
    if key is not None and selects_every_key(key):
        if not everything:
            raise BadCancel(f"{KEY} {key!r} selects every routing key: give {ALL}: true to mean every message")
        key = None
    select = Selection(ids, key, after, before, values, retries)
    if select.empty and not everything:
        raise BadCancel(f"a rule without a filter would cancel every message: give {KEY}, {ID}, {DUE_AFTER}, "
                        f"{DUE_BEFORE}, {HEADER} or {RETRIES}, or {ALL}: true to mean every message")
    if everything and not select.empty:
        raise BadCancel(f"{ALL} with a filter: give one or the other")
    return Request(select, everything, name)


def _text(value: Any, header: str) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise BadCancel(f"{header} is not UTF-8 text") from None
    if isinstance(value, str):
        return value
    raise BadCancel(f"{header} must be text, not {type(value).__name__}")


def _pattern(value: Any) -> str:
    try:
        return checked_pattern(_text(value, KEY))
    except ValueError as exc:
        raise BadCancel(f"{KEY}: {exc}") from None


def _name(value: Any, header: str) -> bytes:
    raw = value.encode("utf-8") if isinstance(value, str) else value if isinstance(value, bytes) else None
    if raw is None:
        raise BadCancel(f"{header} must be text, not {type(value).__name__}")
    if not raw or len(raw) > MAX_NAME_BYTES:
        raise BadCancel(f"{header} must be 1 to {MAX_NAME_BYTES} bytes, not {len(raw)}")
    return raw


def _ids(value: Any) -> Tuple[bytes, ...]:
    items = value if isinstance(value, list) else [value]
    if not items or len(items) > MAX_IDS:
        raise BadCancel(f"{ID} takes 1 to {MAX_IDS} ids (for more, cancel by id: one cancel each)")
    out = []
    for item in items:
        raw = _name(item, ID)
        if raw == b"*":
            raise BadCancel(f"{ID} '*' selects every message: use {ALL}: true to mean it")
        if raw.startswith(b"@") and cancels.handle_read_us(raw) is None:
            # every message has a handle: '@*' would select them all, and a handle names one
            raise BadCancel(f"{ID} {raw.decode('utf-8', 'replace')!r} is not a handle ('@' and 20 letters and "
                            "digits, as `pending list` shows one): a handle names one message, never a group"[:300])
        out.append(raw)
    return tuple(out)


def _epoch_ms(value: Any, header: str) -> int:
    found: Optional[int] = None
    if isinstance(value, datetime.datetime):
        found = int(value.timestamp()) * 1000
    elif isinstance(value, (bytes, str)):
        text = (value.decode("ascii", "replace") if isinstance(value, bytes) else value).strip()
        if 0 < len(text) <= 19 and text.isascii() and text.isdigit():
            found = int(text)
    elif isinstance(value, int) and not isinstance(value, bool):
        found = value
    if found is None or not 0 <= found <= MAX_EPOCH_MS:
        raise BadCancel(f"{header} must be a time in epoch milliseconds (0 to {MAX_EPOCH_MS}), "
                        f"not {value!r}"[:200])
    return found


def _headers(value: Any) -> Tuple[Tuple[str, str], ...]:
    if not isinstance(value, dict) or not value:
        raise BadCancel(f"{HEADER} must be a table of header names and values")
    if len(value) > MAX_HEADERS:
        raise BadCancel(f"{HEADER} takes at most {MAX_HEADERS} headers, not {len(value)}")
    out = []
    for name, v in value.items():
        if not isinstance(name, str) or not name:
            raise BadCancel(f"{HEADER}: a header name must be UTF-8 text")
        text = _as_text(v, name)
        if len(text.encode("utf-8")) > MAX_VALUE_BYTES:
            raise BadCancel(f"{HEADER}: the value of {name!r} is over {MAX_VALUE_BYTES} bytes"[:200])
        out.append((name, text))
    return tuple(sorted(out))


def _as_text(value: Any, name: str) -> str:
    """A header value as `pending --header NAME=VALUE` compares it: as text."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (str, int, Decimal, float)):
        return str(value)
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    raise BadCancel(f"{HEADER}: the value of {name!r} must be text or a number"[:200])


def _flag(value: Any, header: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, (str, bytes)):
        text = (value.decode("ascii", "replace") if isinstance(value, bytes) else value).strip().lower()
        if text in ("true", "1", "false", "0"):
            return text in ("true", "1")
    raise BadCancel(f"{header} must be true or false, not {value!r}"[:200])


# -- the records ------------------------------------------------------------------------------
def _times(at: Time) -> List[wire.TableField]:
    out = [wire.long(cancels.RECORD_AT, at.read_us)]
    if at.arrived_ms is not None:
        out.append(wire.long(cancels.RECORD_ARRIVED, at.arrived_ms))
    return out


def filter_fields(select: Selection, everything: bool) -> List[wire.TableField]:
    """A filter in the vocabulary, normalised (the same types whatever the publisher sent)."""
    out: List[wire.TableField] = []
    if select.key is not None:
        out.append(wire.longstr(KEY, select.key))
    if select.ids:
        out.append(wire.longstrs(ID, select.ids))
    if select.due_after_ms is not None:
        out.append(wire.long(DUE_AFTER, select.due_after_ms))
    if select.due_before_ms is not None:
        out.append(wire.long(DUE_BEFORE, select.due_before_ms))
    if select.headers:
        out.append(wire.table(HEADER, Table([wire.longstr(n, v) for n, v in select.headers])))
    if select.retries:
        out.append(wire.boolean(RETRIES, True))
    if everything:
        out.append(wire.boolean(ALL, True))
    return out


def _filter_table(select: Selection, everything: bool) -> Table:
    return Table(filter_fields(select, everything))


def record(rule: Rule) -> Tuple[Properties, bytes]:
    """A rule's record in the cancellations stream: its properties and its body (the filter)."""
    props = Properties.build(delivery_mode=2, headers=Table([wire.longstr(RECORD_RULE, rule.name)] + _times(rule.at)))
    body = FILTER_MAGIC + _filter_table(rule.select, rule.everything).encode()
    if len(props.raw) + len(body) > MAX_RECORD_BYTES:
        raise BadCancel(f"the rule takes {len(props.raw) + len(body)} bytes: at most {MAX_RECORD_BYTES} (fewer ids?)")
    return props, body


def withdrawal_record(w: Withdrawal) -> Properties:
    return Properties.build(delivery_mode=2, headers=Table([wire.longstr(RECORD_WITHDRAWN, w.name)] + _times(w.at)))


def tally_record(name: bytes, gateway: bytes, removed: int) -> Properties:
    return Properties.build(delivery_mode=2, headers=Table([
        wire.longstr(RECORD_TALLY, name), wire.binary(TALLY_GATEWAY, gateway), wire.long(TALLY_REMOVED, removed)]))


def _bytes(value: Any) -> Optional[bytes]:
    return value.encode("utf-8") if isinstance(value, str) else value if isinstance(value, bytes) else None


def _time(headers: Table) -> Optional[Time]:
    at, arrived = headers.get(cancels.RECORD_AT), headers.get(cancels.RECORD_ARRIVED)
    if not _integer(at):
        return None
    return Time(at, arrived if _integer(arrived) else None)


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read_record(headers: Table, body: bytes = b"") -> Optional[Union[Rule, Withdrawal, Refused]]:
    """The rule or withdrawal a record holds; None if it holds neither (a cancel by id, a
    tally, a mark). A rule record that cannot be read exactly is `Refused`: it cancels nothing
    (never more than it says)."""
    at = _time(headers)
    if at is None:
        return None
    withdrawn = _bytes(headers.get(RECORD_WITHDRAWN))
    if withdrawn:
        return Withdrawal(withdrawn, at)
    name = _bytes(headers.get(RECORD_RULE))
    if not name:
        return None
    if body.startswith(FILTER_MAGIC):
        content = body[len(FILTER_MAGIC):]
        if len(content) < 4 or int.from_bytes(content[:4], "big") != len(content) - 4:
            return Refused(name, at, "its filter is cut short")
        given = Table.parse(content[4:])
        if given.tail:
            return Refused(name, at, "its filter cannot be parsed")
    elif body:
        return Refused(name, at, "its filter is in a format this version does not know (a later version's?)")
    else:
        given = _first_format(headers)
    try:
        asked = requested(given)
    except BadCancel as exc:
        return Refused(name, at, str(exc))
    if not isinstance(asked, Request):
        return Refused(name, at, "it holds a withdrawal's header")
    return Rule(name, asked.select, at, asked.everything)


def _first_format(headers: Table) -> Table:
    """The filter of a record written before FILTER_MAGIC (until 2026-11-28), in its headers.
    RabbitMQ 3.10's streams dropped its array and table values (`x-cancel-id`, `x-cancel-header`),
    and nothing says which were there: read as they are (a record without a filter is refused)."""
    return Table([e for e in headers.entries if e.name.startswith(FAMILY.encode())])


def read_tally(headers: Table) -> Optional[Tuple[bytes, bytes, int]]:
    """(rule name, gateway, removed so far) of a tally record; None if it is not one."""
    name, gateway, removed = _bytes(headers.get(RECORD_TALLY)), headers.get(TALLY_GATEWAY), headers.get(TALLY_REMOVED)
    if name and isinstance(gateway, bytes) and _integer(removed):
        return name, gateway, removed
    return None


# -- the rules a gateway holds ----------------------------------------------------------------
Bucket = Tuple[Rule, ...]  # replaced whole on a change, never changed in place
_Identity = Tuple[bytes, Selection, bool]  # one rule: recorded again after a crash, it is the same


def _identity(rule: Rule) -> _Identity:
    return rule.name, rule.select, rule.everything


class Rules:
    """The live rules of the retention window (the one of cancels.Store), each in one index
    (`_place`) by what every message it selects must have, so that a message is compared
    only with the rules that may select it: an exact id, the read time a handle names, a
    literal word of its key pattern, a header value; the broad ones (an id prefix, the key's
    word count for a pattern of wildcards only, being a retry, due times alone, everything)
    with every message of their kind (`room_for` bounds them). Adding, withdrawing and
    forgetting cost a rule's index, not the number of rules. One thread changes it (the
    stream's follower), others look up: each index's buckets are tuples replaced whole, so a
    lookup sees one consistent bucket."""

    def __init__(self, window_ms: int) -> None:
        self.window_us = window_ms * 1000
        self._live: Dict[_Identity, Rule] = {}  # as recorded
        self._by_name: Dict[bytes, Set[_Identity]] = {}
        self._order: Deque[Tuple[int, _Identity]] = deque()  # as added: (read time, identity)
        # name -> the newest read time of a record of that name (what catch-up asks)
        self.recorded: Dict[bytes, int] = {}
        self.newest_read_us = 0
        self.withdrawn = 0
        # the indexes: anchor kind -> anchor -> bucket
        self._ids: Dict[bytes, Bucket] = {}
        self._handles: Dict[int, Bucket] = {}
        self._prefixes: Dict[bytes, Bucket] = {}
        self._prefix_lengths: Dict[int, int] = {}  # length -> how many prefixes of it
        self._words: Dict[bytes, Bucket] = {}
        self._shapes: Dict[Tuple[int, bool], Bucket] = {}  # (words, with '#') -> bucket
        self._headers: Dict[Tuple[str, str], Bucket] = {}
        self._header_names: Dict[str, int] = {}
        self._retries: Bucket = ()
        self._rest: Bucket = ()  # due times alone, or everything
        self._broad = 0  # rules in the broad indexes (BROAD)
        # for a reader of the index (listing.Cancels): the literal prefixes of key patterns
        # of rules without exact ids, and how many rules may select any key
        self._key_prefixes: Dict[bytes, int] = {}
        self._open = 0

    def __len__(self) -> int:
        return len(self._live)

    @property
    def live(self) -> Tuple[Rule, ...]:
        return tuple(self._live.values())

    def add(self, item: Union[Rule, Withdrawal, Refused], now_ms: int) -> bool:
        """Hold a rule, apply a withdrawal, or note a refused record; False if it is already
        outside the window."""
        if item.at.read_us < now_ms * 1000 - self.window_us:
            return False
        self.recorded[item.name] = max(item.at.read_us, self.recorded.get(item.name, -1))
        self.newest_read_us = max(self.newest_read_us, item.at.read_us)
        if isinstance(item, Refused):
            pass  # (recorded, cancelling nothing: what waits for it to be recorded goes on)
        elif isinstance(item, Withdrawal):
            for identity in list(self._by_name.get(item.name, ())):
                if self._live[identity].at.read_us <= item.at.read_us:
                    self._remove(identity)
                    self.withdrawn += 1
        else:
            # The same rule recorded again: a gateway died between its record and its
            # acknowledgement, and the next one read it again. One rule, the later record: what
            # was read between the two was read again after it (a record is a fence:
            # deliveries.py), so the later fence holds what the earlier one did.
            identity = _identity(item)
            held = self._live.get(identity)
            if held is not None:
                if held.at.read_us >= item.at.read_us:
                    return True
                self._remove(identity)
            self._live[identity] = item
            self._by_name.setdefault(item.name, set()).add(identity)
            self._order.append((item.at.read_us, identity))
            self._index(item, +1)
        return True

    def holds(self, name: bytes, read_us: int) -> bool:
        """Whether a record of this name read at `read_us` (or a newer one) is held."""
        return self.recorded.get(name, -1) >= read_us

    def prune(self, now_ms: int) -> int:
        """Forget what is older than the window; how many rules were forgotten."""
        cutoff = now_ms * 1000 - self.window_us
        gone = 0
        while self._order and self._order[0][0] < cutoff:
            at, identity = self._order.popleft()
            held = self._live.get(identity)
            if held is not None and held.at.read_us == at:
                self._remove(identity)
                gone += 1
        if any(t < cutoff for t in self.recorded.values()):
            self.recorded = {n: t for n, t in self.recorded.items() if t >= cutoff}
        return gone

    def _remove(self, identity: _Identity) -> None:
        rule = self._live.pop(identity)
        names = self._by_name[rule.name]
        names.discard(identity)
        if not names:
            del self._by_name[rule.name]
        self._index(rule, -1)

    # -- the indexes ---------------------------------------------------------------------------
    @staticmethod
    def _place(select: Selection) -> Tuple[str, List[Any]]:
        """The index a rule of this filter goes in, and its anchors there: every exact id (a
        message must have one of them), any literal word of its key pattern (it must have
        each), its first header value; else one of the broad ones, which every message (or
        every retry) of their kind looks in."""
        ids = select.ids
        if ids and not any(i.endswith(b"*") for i in ids):
            return "ids", list(ids)
        pattern = (select.key.encode("utf-8").split(b".") if select.key else []) if select.key is not None else []
        literal = [w for w in pattern if w not in (b"*", b"#")]
        if literal:
            return "word", literal
        if ids:
            return "prefixes", list(ids)
        if select.key is not None:  # ("": no words)
            return "shape", [(pattern.count(b"*"), b"#" in pattern)]
        if select.headers:
            name, value = select.headers[0]
            return "header", [(name, value.lower())]
        return ("retries" if select.retries else "rest"), []

    def _index(self, rule: Rule, change: int) -> None:
        """Put a rule in (+1) or take it out of (-1) the index of its anchor."""
        select = rule.select
        kind, anchors = self._place(select)
        words = literal_words(select.key) if select.key is not None else []
        if kind != "ids":
            if words and select.key is not None and not select.key.startswith(("*", "#")):
                _count(self._key_prefixes, b".".join(words), change)
            else:
                self._open += change
        if kind in BROAD:
            self._broad += change
        if kind == "ids":
            for i in anchors:
                if (named := cancels.handle_read_us(i)) is not None:
                    _put(self._handles, named, rule, change)
                else:
                    _put(self._ids, i, rule, change)
        elif kind == "word":
            if change > 0:  # (the word whose bucket is smallest now; ties: the longest)
                word = min(anchors, key=lambda w: (len(self._words.get(w, ())), -len(w)))
            else:
                word = next(w for w in anchors if rule in self._words.get(w, ()))
            _put(self._words, word, rule, change)
        elif kind == "prefixes":
            for i in anchors:
                if i.endswith(b"*"):
                    _count(self._prefix_lengths, len(i) - 1, change)
                    _put(self._prefixes, i[:-1], rule, change)
                elif (named := cancels.handle_read_us(i)) is not None:
                    _put(self._handles, named, rule, change)
                else:
                    _put(self._ids, i, rule, change)
        elif kind == "shape":
            _put(self._shapes, anchors[0], rule, change)
        elif kind == "header":
            _count(self._header_names, anchors[0][0], change)
            _put(self._headers, anchors[0], rule, change)
        elif kind == "retries":
            self._retries = _changed(self._retries, rule, change)
        else:
            self._rest = _changed(self._rest, rule, change)

    def room_for(self, select: Selection) -> Optional[str]:
        """Why check-in must refuse a rule of this filter (a limit it would pass), or None. The
        limits bound what judging one message costs whatever rules are live: every message
        looks in the broad indexes, and in the buckets of its own id, words and headers."""
        if len(self._live) >= MAX_LIVE:
            return (f"{len(self._live)} rules are live, at most {MAX_LIVE}: withdraw some (delay-gateway pending "
                    "withdraw), or cancel by id")
        kind, anchors = self._place(select)
        if kind in BROAD:
            if self._broad >= MAX_BROAD:
                return (f"{self._broad} live rules select by an id prefix, retries, due times or key wildcards alone "
                        f"(every message is compared with them), at most {MAX_BROAD}: give a word of the key, an "
                        "exact id or a header value, or withdraw some")
            return None
        index: Dict[Any, Bucket] = self._ids if kind == "ids" else self._words if kind == "word" else self._headers
        full = [a for a in anchors if len(index.get(a, ())) >= MAX_SHARED
                and not (kind == "ids" and cancels.handle_read_us(a) is not None)]
        if (kind == "word" and len(full) == len(anchors)) or (kind != "word" and full):
            shown = ", ".join(repr(a.decode("utf-8", "replace") if isinstance(a, bytes) else a) for a in full)[:200]
            return (f"{MAX_SHARED} live rules already select by {shown}: at most that many share what a message "
                    "is looked up by; narrow the filter, or withdraw some")
        return None

    def candidates(self, message_id: Optional[bytes], routing_key: bytes, read_us: Optional[int], retry: bool,
                   headers: Callable[[], Table]) -> List[Rule]:
        """The rules that may select a message with these (each still to be matched in full)."""
        out: List[Rule] = list(self._rest)
        if retry and self._retries:
            out += self._retries
        if message_id is not None:
            if self._ids:
                out += self._ids.get(message_id, ())
            for length in list(self._prefix_lengths):
                if length <= len(message_id):
                    out += self._prefixes.get(message_id[:length], ())
        if read_us is not None and self._handles:
            out += self._handles.get(read_us, ())
        if self._words or self._shapes:
            words = routing_key.split(b".") if routing_key else []
            if self._words:
                for word in set(words):
                    out += self._words.get(word, ())
            for (count, open_ended), bucket in list(self._shapes.items()):
                if count == len(words) or (open_ended and count <= len(words)):
                    out += bucket
        if self._headers:
            out += self._by_header(headers())
        return out

    def _by_header(self, table: Table) -> List[Rule]:
        out: List[Rule] = []
        names = self._header_names
        for e in table.entries:
            name = e.name.decode("utf-8", "replace")
            if name in names:
                value = e.value
                text = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
                out += self._headers.get((name, text.lower()), ())
        return out

    def first(self, message_id: Optional[bytes], routing_key: bytes, due_ms: int, retry: bool,
              headers: Callable[[], Table], handle: Callable[[], bytes], read_us: Optional[int],
              taken_in: Optional[Time]) -> Optional[Rule]:
        """The first live rule that cancels this message (selects it, and came after it)."""
        if not self._live:
            return None
        for rule in self.candidates(message_id, routing_key, read_us, retry, headers):
            if rule.came_after(taken_in) and rule.select.matches(message_id, routing_key, due_ms, retry, headers,
                                                                 handle):
                return rule
        return None

    # -- what a reader of the index asks, to skip what no rule can select (listing.Cancels) --------
    MAX_PREFIXES = 256

    def handle_times(self) -> List[int]:
        """The read times the rules' handles name."""
        return list(self._handles)

    def by_id(self) -> bool:
        """Whether some rule selects by exact message ids."""
        return bool(self._ids)

    def names_id(self, message_id: bytes) -> bool:
        return message_id in self._ids

    def key_prefixes(self) -> Optional[List[bytes]]:
        """What the routing key of every message a rule without exact ids can select starts
        with; None when such a rule may select any key, or there are too many prefixes to be
        worth testing one by one. (A prefix covers the longer ones it starts: kept all the same.)"""
        if self._open or len(self._key_prefixes) > self.MAX_PREFIXES:
            return None
        return list(self._key_prefixes)


def _count(counts: Dict[Any, int], key: Any, change: int) -> None:
    left = counts.get(key, 0) + change
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)


def _changed(bucket: Bucket, rule: Rule, change: int) -> Bucket:
    if change > 0:
        return bucket + (rule,)
    return tuple(r for r in bucket if r is not rule)


def _put(index: Dict[Any, Bucket], anchor: Any, rule: Rule, change: int) -> None:
    bucket = _changed(index.get(anchor, ()), rule, change)
    if bucket:
        index[anchor] = bucket
    else:
        index.pop(anchor, None)


def tallies(records: Iterable[Tuple[bytes, bytes, int]]) -> Dict[bytes, int]:
    """Rule name -> removed so far, from tally records (each gateway's latest, summed)."""
    latest: Dict[Tuple[bytes, bytes], int] = {}
    for name, gateway, removed in records:
        latest[(name, gateway)] = max(removed, latest.get((name, gateway), 0))
    out: Dict[bytes, int] = {}
    for (name, _), removed in latest.items():
        out[name] = out.get(name, 0) + removed
    return out
