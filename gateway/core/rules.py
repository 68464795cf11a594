"""Group cancels as rules (pure): one record that cancels every message its filter selects
(selection.Selection) that was taken in before it, wherever the message is.

A rule is published like a cancel by id (cancels.py), to `<prefix>.cancel`, which is bound to
the check-in queue: it queues behind every message published before it. Instead of a
message id it carries the filter in headers, the public vocabulary below; the check-in
consumer turns it into a *record* in the cancellations stream (the same headers, normalised,
with the rule's name and its times: read time and arrival stamp), under the same fence as a
cancel by id. Every gateway follows the stream into `Rules` and judges each message it reads,
holds, sends round meditation, retries or releases against the live rules exactly as against
the cancels by id: a rule cancels a message iff its filter selects it and the rule came after
it (cancels.after). So a group cancel is one publish however many messages it matches, works
while every gateway is down (it waits in check-in behind the messages it concerns), and
covers messages no index has seen.

The vocabulary on `<prefix>.cancel` (any AMQP client; a header of this family makes the
message a rule, and its `message_id` is then ignored):

    x-cancel-key          an AMQP topic pattern on the routing key the message arrives with
    x-cancel-id           a message id, or a prefix ending in '*', or a handle ('@...'); text
                          or an array of them
    x-cancel-due-after    due at or after (epoch ms)
    x-cancel-due-before   due at or before (epoch ms)
    x-cancel-header       a table: header name -> value (compared as text)
    x-cancel-retries      true: only retries
    x-cancel-all          true: no filter at all (every message), required when none is given
    x-cancel-rule         the rule's name (optional; what `pending rules` shows and `pending
                          withdraw` names; default: one made from its read time)
    x-cancel-withdraw     (alone, or with x-cancel-rule) withdraw the rules of this name
                          recorded before it: from then on they cancel nothing more

A header of the family that is not one of these, or a value that cannot be read, parks the
rule with the reason (a typo must never widen a rule). A rule with no filter and without
x-cancel-all is parked too.

Gateways add, in the same stream, *tallies*: how many messages each gateway process removed
by each rule so far (cumulative, so a lost record costs nothing but a late count).
"""

import base64
import datetime
import struct
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

from gateway.core import cancels, wire
from gateway.core.cancels import BadCancel, Time
from gateway.core.selection import Selection, literal_words
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

# On the records in the cancellations stream (beside the vocabulary, normalised, and the
# times of cancels.RECORD_AT / RECORD_ARRIVED):
RECORD_RULE = "x-gateway-rule"  # a rule: its name
RECORD_WITHDRAWN = "x-gateway-rule-withdrawn"  # a withdrawal: the name withdrawn
RECORD_TALLY = "x-gateway-rule-tally"  # a tally: the rule's name ...
TALLY_GATEWAY = "x-gateway-tally-gateway"  # ... the gateway process (16 bytes) ...
TALLY_REMOVED = "x-gateway-tally-removed"  # ... and how many it removed by it so far

MAX_NAME_BYTES = 255
MAX_IDS = 1000  # a rule travels in one header frame: for more ids, cancel by id
MAX_RECORD_BYTES = 64_000


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


def is_rule(headers: Table) -> bool:
    """Whether a message published to `<prefix>.cancel` is a rule (or a withdrawal)."""
    return any(e.name.startswith(FAMILY.encode()) for e in headers.entries)


def default_name(read_us: int) -> bytes:
    """A rule's name when its publisher gave none: 'rule-' and its read time, in letters."""
    return b"rule-" + base64.b32encode(struct.pack(">q", read_us)).rstrip(b"=").lower()


# -- reading the vocabulary -------------------------------------------------------------------
def requested(headers: Table) -> Union[Request, Withdrawing]:
    """The rule (or withdrawal) a cancel's headers ask for. Raises BadCancel."""
    given: Dict[str, Any] = {}
    for e in headers.entries:
        if not e.name.startswith(FAMILY.encode()):
            continue
        header = e.name.decode("utf-8", "replace")
        if header not in VOCABULARY:
            raise BadCancel(f"unknown rule header {header!r}: a rule takes {', '.join(VOCABULARY)}")
        given[header] = e.value
    name = _name(given[NAME], NAME) if NAME in given else None
    if WITHDRAW in given:
        withdrawn = _name(given.pop(WITHDRAW), WITHDRAW)
        given.pop(NAME, None)
        if given:
            raise BadCancel(f"{WITHDRAW} takes no filter ({', '.join(sorted(given))} given): withdraw first, "
                            "then publish the new rule")
        if name is not None and name != withdrawn:
            raise BadCancel(f"{WITHDRAW} names {withdrawn!r} but {NAME} names {name!r}")
        return Withdrawing(withdrawn)
    ids = _ids(given[ID]) if ID in given else ()
    key = _text(given[KEY], KEY) if KEY in given else None
    after = _epoch_ms(given[DUE_AFTER], DUE_AFTER) if DUE_AFTER in given else None
    before = _epoch_ms(given[DUE_BEFORE], DUE_BEFORE) if DUE_BEFORE in given else None
    values = _headers(given[HEADER]) if HEADER in given else ()
    retries = _flag(given[RETRIES], RETRIES) if RETRIES in given else False
    everything = _flag(given[ALL], ALL) if ALL in given else False
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
        out.append(raw)
    return tuple(out)


def _epoch_ms(value: Any, header: str) -> int:
    if isinstance(value, datetime.datetime):
        return int(value.timestamp()) * 1000
    if isinstance(value, (bytes, str)):
        text = value.decode("ascii", "replace") if isinstance(value, bytes) else value
        if text.strip().isdigit():
            return int(text.strip())
    elif isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise BadCancel(f"{header} must be a time in epoch milliseconds, not {value!r}"[:200])


def _headers(value: Any) -> Tuple[Tuple[str, str], ...]:
    if not isinstance(value, dict) or not value:
        raise BadCancel(f"{HEADER} must be a table of header names and values")
    out = []
    for name, v in value.items():
        if not isinstance(name, str) or not name:
            raise BadCancel(f"{HEADER}: a header name must be UTF-8 text")
        out.append((name, _as_text(v, name)))
    return tuple(sorted(out))


def _as_text(value: Any, name: str) -> str:
    """A header value as `pending --header NAME=VALUE` compares it: as text."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (str, int, Decimal, float)):
        return str(value)
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    raise BadCancel(f"{HEADER}: the value of {name!r} must be text or a number")


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


def record(rule: Rule) -> Properties:
    """A rule's record in the cancellations stream (its body is empty)."""
    props = Properties.build(delivery_mode=2, headers=Table(
        [wire.longstr(RECORD_RULE, rule.name)] + filter_fields(rule.select, rule.everything) + _times(rule.at)))
    if len(props.raw) > MAX_RECORD_BYTES:
        raise BadCancel(f"the rule takes {len(props.raw)} bytes: at most {MAX_RECORD_BYTES} (fewer ids?)")
    return props


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


def read_record(headers: Table) -> Optional[Union[Rule, Withdrawal]]:
    """The rule or withdrawal a record holds; None if it holds neither (a cancel by id, a
    tally, a mark) or cannot be read (then it cancels nothing: never more than it says)."""
    at = _time(headers)
    if at is None:
        return None
    withdrawn = _bytes(headers.get(RECORD_WITHDRAWN))
    if withdrawn:
        return Withdrawal(withdrawn, at)
    name = _bytes(headers.get(RECORD_RULE))
    if not name:
        return None
    try:
        asked = requested(Table([e for e in headers.entries if e.name.startswith(FAMILY.encode())]))
    except BadCancel:
        return None
    if not isinstance(asked, Request):
        return None
    return Rule(name, asked.select, at, asked.everything)


def read_tally(headers: Table) -> Optional[Tuple[bytes, bytes, int]]:
    """(rule name, gateway, removed so far) of a tally record; None if it is not one."""
    name, gateway, removed = _bytes(headers.get(RECORD_TALLY)), headers.get(TALLY_GATEWAY), headers.get(TALLY_REMOVED)
    if name and isinstance(gateway, bytes) and _integer(removed):
        return name, gateway, removed
    return None


# -- the rules a gateway holds ----------------------------------------------------------------
@dataclass
class _Node:
    rules: List[Rule] = field(default_factory=list)
    below: Dict[bytes, "_Node"] = field(default_factory=dict)


class Rules:
    """The live rules of the retention window (the one of cancels.Store), indexed so that a
    message is compared with the few rules that can select it: by exact id, by the read time a
    handle names, by the literal words a key pattern starts with; the rest (patterns starting
    with a wildcard, id prefixes without a key, due or header filters alone) with every message.
    One thread adds (the stream's follower), others look up."""

    def __init__(self, window_ms: int) -> None:
        self.window_us = window_ms * 1000
        self._rules: List[Rule] = []  # as recorded
        # name -> the newest read time of a rule or withdrawal of that name (what catch-up asks)
        self.recorded: Dict[bytes, int] = {}
        self.newest_read_us = 0
        self.withdrawn = 0
        self._index()

    def __len__(self) -> int:
        return len(self._rules)

    @property
    def live(self) -> Tuple[Rule, ...]:
        return tuple(self._rules)

    def add(self, item: Union[Rule, Withdrawal], now_ms: int) -> bool:
        """Hold a rule, or apply a withdrawal; False if it is already outside the window."""
        if item.at.read_us < now_ms * 1000 - self.window_us:
            return False
        self.recorded[item.name] = max(item.at.read_us, self.recorded.get(item.name, -1))
        self.newest_read_us = max(self.newest_read_us, item.at.read_us)
        if isinstance(item, Withdrawal):
            kept = [r for r in self._rules if not (r.name == item.name and r.at.read_us <= item.at.read_us)]
            self.withdrawn += len(self._rules) - len(kept)
            self._rules = kept
        else:
            # The same rule recorded again: a gateway died between its record and its
            # acknowledgement, and the next one read it again. One rule, the later record: what
            # was read between the two was read again after it (a record is a fence:
            # deliveries.py), so the later fence holds what the earlier one did.
            same = [r for r in self._rules if (r.name, r.select, r.everything) == (item.name, item.select,
                                                                                   item.everything)]
            if any(r.at.read_us >= item.at.read_us for r in same):
                return True
            self._rules = [r for r in self._rules if r not in same] + [item]
        self._index()
        return True

    def holds(self, name: bytes, read_us: int) -> bool:
        """Whether a record of this name read at `read_us` (or a newer one) is held."""
        return self.recorded.get(name, -1) >= read_us

    def prune(self, now_ms: int) -> int:
        """Forget what is older than the window; how many rules were forgotten."""
        cutoff = now_ms * 1000 - self.window_us
        kept = [r for r in self._rules if r.at.read_us >= cutoff]
        gone = len(self._rules) - len(kept)
        self.recorded = {n: t for n, t in self.recorded.items() if t >= cutoff}
        if gone:
            self._rules = kept
            self._index()
        return gone

    def _index(self) -> None:
        """Rebuilt whole on each change (rules are few; a lookup must see one consistent index:
        the attributes are replaced, never changed in place)."""
        by_id: Dict[bytes, List[Rule]] = {}
        by_handle: Dict[int, List[Rule]] = {}
        root, general = _Node(), []
        for rule in self._rules:
            ids = rule.select.ids
            if ids and not any(i.endswith(b"*") for i in ids):
                for i in ids:
                    named = cancels.handle_read_us(i)
                    if named is not None:
                        by_handle.setdefault(named, []).append(rule)
                    else:
                        by_id.setdefault(i, []).append(rule)
                continue
            words = literal_words(rule.select.key) if rule.select.key is not None else []
            if words:
                node = root
                for w in words:
                    node = node.below.setdefault(w, _Node())
                node.rules.append(rule)
            else:
                general.append(rule)
        self._by_id, self._by_handle, self._root, self._general = by_id, by_handle, root, general

    # -- what a reader of the index asks, to skip what no rule can select (listing.Cancels) --------
    MAX_PREFIXES = 256

    def handle_times(self) -> List[int]:
        """The read times the rules' handles name."""
        return list(self._by_handle)

    def by_id(self) -> bool:
        """Whether some rule selects by exact message ids."""
        return bool(self._by_id)

    def names_id(self, message_id: bytes) -> bool:
        return message_id in self._by_id

    def key_prefixes(self) -> Optional[List[bytes]]:
        """What the routing key of every message a rule of the key index can select starts
        with; None when a rule may select any message (it has no such words), or there are too
        many to be worth testing one by one."""
        if self._general:
            return None
        out: List[bytes] = []
        pending: List[Tuple[List[bytes], _Node]] = [([], self._root)]
        while pending:
            words, node = pending.pop()
            if node.rules:
                out.append(b".".join(words))
                continue  # (what starts with these words starts with them, whatever follows)
            pending += [(words + [w], below) for w, below in node.below.items()]
        return out if len(out) <= self.MAX_PREFIXES else None

    def candidates(self, message_id: Optional[bytes], routing_key: bytes, read_us: Optional[int]) -> List[Rule]:
        """The rules that may select a message with these (each still to be matched in full)."""
        out = list(self._general)
        if message_id is not None and self._by_id:
            out += self._by_id.get(message_id, ())
        if read_us is not None and self._by_handle:
            out += self._by_handle.get(read_us, ())
        node: Optional[_Node] = self._root
        if self._root.below:
            for word in routing_key.split(b"."):
                node = node.below.get(word) if node is not None else None
                if node is None:
                    break
                out += node.rules
        return out

    def first(self, message_id: Optional[bytes], routing_key: bytes, due_ms: int, retry: bool,
              headers: Callable[[], Table], handle: Callable[[], bytes], read_us: Optional[int],
              taken_in: Optional[Time]) -> Optional[Rule]:
        """The first live rule that cancels this message (selects it, and came after it)."""
        if not self._rules:
            return None
        for rule in self.candidates(message_id, routing_key, read_us):
            if rule.came_after(taken_in) and rule.select.matches(message_id, routing_key, due_ms, retry, headers,
                                                                 handle):
                return rule
        return None


def tallies(records: Iterable[Tuple[bytes, bytes, int]]) -> Dict[bytes, int]:
    """Rule name -> removed so far, from tally records (each gateway's latest, summed)."""
    latest: Dict[Tuple[bytes, bytes], int] = {}
    for name, gateway, removed in records:
        latest[(name, gateway)] = max(removed, latest.get((name, gateway), 0))
    out: Dict[bytes, int] = {}
    for (name, _), removed in latest.items():
        out[name] = out.get(name, 0) + removed
    return out
