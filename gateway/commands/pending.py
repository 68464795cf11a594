"""`delay-gateway pending`: list, count, cancel and export the messages that wait; the
group cancels (rules) that are live, and withdrawing one.

What waits is read from the waiting streams the gateways write (gateway/core/index_records.py,
gateway/broker/tools/index_reader.py, gateway/core/listing.py), filtered by message id, routing key,
due time, header or retries. `cancel` publishes one rule with the same filters
(gateway/core/rules.py) through the path of `delay-gateway cancel`: every gateway cancels
every message the rule selects that was published before it, listed or not, with every
guarantee of a confirmed cancel (docs/cancelling.md).
"""

import argparse
import base64
import csv
import datetime
import json
import re
import sys
import time
import uuid
from dataclasses import dataclass
from typing import IO, Any, Callable, Dict, List, Optional, Sequence, Tuple

import pika

from topology.broker.permissions import needing

from gateway.broker.tools import cancellations, index_reader
from gateway.broker.plumbing.amqp import blocking_channel
from gateway.clock import wall_ms
from gateway.core import cancels, listing, rules, wire
from gateway.core.selection import Selection, checked_pattern, selects_every_key
from gateway.core.index_records import Listed
from gateway.core.wire import Table
from gateway.times import due_in, iso_ms, plain_ms
from gateway.settings import Settings, UsageError, argument, integer

SAMPLE = 10  # what `pending cancel` shows before it acts
# where docs/security.md gives each verb's permissions (a refusal names it)
LOOKER, GROUP_CANCELLER = "the looker's line", "the group canceller's line"
ROLES = {"list": LOOKER, "count": LOOKER, "export": LOOKER, "rules": LOOKER, "cancel": GROUP_CANCELLER,
         "withdraw": GROUP_CANCELLER}
LIST_LIMIT = 100


# -- reading the filters -----------------------------------------------------------------------
_RELATIVE = re.compile(r"^([+-])((?:\d+(?:\.\d+)?(?:ms|s|min|m|h|d|w))+)$")
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|min|m|h|d|w)")
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "min": 60_000, "h": 3_600_000, "d": 86_400_000, "w": 604_800_000}


def when(now_ms: int) -> Callable[[str], int]:
    """A time as epoch ms from: epoch ms, an ISO time (UTC unless it says), `now`, or `now`
    plus or minus a duration (`+2h`, `-30min`, `+1d12h`)."""
    def parse(text: str) -> int:
        value = text.strip()
        if value == "now":
            return now_ms
        if value.isdigit():
            return int(value)
        relative = _RELATIVE.match(value)
        if relative:
            sign, parts = relative.groups()
            ms = sum(float(n) * _UNIT_MS[unit] for n, unit in _PART.findall(parts))
            return now_ms + int(ms) * (1 if sign == "+" else -1)
        try:
            at = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            raise ValueError(f"{text!r} is not a time: give epoch ms, an ISO time (2026-11-26T09:00, UTC unless "
                             "it says), or a duration from now (+2h, -30min, +1d12h)") from None
        if at.tzinfo is None:
            at = at.replace(tzinfo=datetime.timezone.utc)
        return int(at.timestamp() * 1000)
    parse.__name__ = "time"
    return parse


def header(text: str) -> Tuple[str, str]:
    name, eq, value = text.partition("=")
    if not eq or not name:
        raise ValueError(f"{text!r}: expected NAME=VALUE")
    return name, value


@dataclass(frozen=True)
class Options:
    """pending's verb and its own arguments (the ACTIONS' options below), typed: each verb
    gives some of them, the others keep these defaults."""

    action: str
    id: Sequence[str] = ()
    key: Optional[str] = None
    due_after: Optional[str] = None
    due_before: Optional[str] = None
    header: Sequence[Tuple[str, str]] = ()
    retries: bool = False
    limit: int = LIST_LIMIT
    json: bool = False
    csv: bool = False
    all: bool = False
    expect: Optional[int] = None
    name: Optional[str] = None
    replace: bool = False
    yes: bool = False
    wait: float = 10.0
    rule: str = ""
    out: str = ""


def selection(args: Options, now_ms: int) -> Selection:
    """The filters of a command line."""
    at = when(now_ms)
    try:
        after = at(args.due_after) if args.due_after is not None else None
        before = at(args.due_before) if args.due_before is not None else None
    except ValueError as exc:
        raise UsageError(f"--due-after/--due-before: {exc}") from None
    ids = tuple(i.encode("utf-8", "surrogateescape") for i in args.id)
    try:
        key = checked_pattern(args.key) if args.key is not None else None
    except ValueError as exc:
        raise UsageError(f"--key: {exc}") from None
    return Selection(ids, key, after, before, tuple(args.header), args.retries)


def _filters(p: argparse.ArgumentParser) -> None:
    f = p.add_argument_group("which messages (the filters combine)")
    f.add_argument("--id", action="append", default=[], metavar="ID",
                   help="its message id or handle, exactly, or a prefix ending in * (repeat for several)")
    f.add_argument("--key", metavar="PATTERN",
                   help="the routing key it will arrive with, as an AMQP topic pattern ('*' one word, '#' any)")
    f.add_argument("--due-after", metavar="WHEN", help="due at or after: epoch ms, ISO time (UTC), or +2h / -30min")
    f.add_argument("--due-before", metavar="WHEN", help="due at or before (same forms)")
    f.add_argument("--header", action="append", default=[], type=argument(header), metavar="NAME=VALUE",
                   help="a header of the message has this value (as text); repeat for several")
    f.add_argument("--retries", action="store_true", help="only retries (failed messages going back to a queue)")


def list_options(p: argparse.ArgumentParser) -> None:
    _filters(p)
    p.add_argument("--limit", type=argument(integer(0)), default=LIST_LIMIT, metavar="N",
                   help=f"show the N due soonest (default {LIST_LIMIT}; 0: all, which holds them all in memory)")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="one JSON object a line (the total goes to stderr)")
    out.add_argument("--csv", action="store_true", help="CSV with a header line (the total goes to stderr)")


def count_options(p: argparse.ArgumentParser) -> None:
    _filters(p)
    p.add_argument("--json", action="store_true", help="print JSON: the total and the counts per range")


def cancel_options(p: argparse.ArgumentParser) -> None:
    _filters(p)
    p.add_argument("--all", action="store_true",
                   help="no filter: every waiting message (refused without it when no filter is given)")
    p.add_argument("--expect", type=argument(integer(0)), metavar="N",
                   help="refuse (exit 2, nothing cancelled) unless exactly N waiting messages match")
    p.add_argument("--name", metavar="NAME", help="the rule's name, for `pending rules` and `pending withdraw` "
                                                  "(default: pending- and 12 random letters); a name a live rule "
                                                  "has is refused without --replace")
    p.add_argument("--replace", action="store_true",
                   help="the live rules of --name are withdrawn as this one is recorded (it replaces them)")
    p.add_argument("--yes", action="store_true", help="cancel them (without it: say how many, and show some)")
    p.add_argument("--wait", type=float, default=10.0, metavar="SECONDS",
                   help="how long to wait for a gateway to record the rule, and to report what it removed "
                        "(default 10)")


def rules_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="one JSON object a line")


def withdraw_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("rule", metavar="RULE", help="the name `pending rules` shows")
    p.add_argument("--wait", type=float, default=10.0, metavar="SECONDS",
                   help="how long to wait for a gateway to record the withdrawal (default 10)")


def export_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("out", metavar="OUT", help="file to write: .csv, or .jsonl / .json (one object a line); "
                                              "- writes JSON lines to standard output")
    _filters(p)


ACTIONS = {
    "list": ("list the messages that wait, soonest due first: message id (or handle), routing key, due time, "
             "size, retry attempt", list_options),
    "count": ("count the messages that wait, per due-time range", count_options),
    "cancel": ("cancel every message the filters select that was published before it, listed or not, with "
               "one rule every gateway applies (say how many match; only with --yes)", cancel_options),
    "export": ("write every message that waits to a CSV or JSON-lines file (for Spark, or a spreadsheet)",
               export_options),
    "rules": ("show the live rules (group cancels) and how many messages each removed so far", rules_options),
    "withdraw": ("withdraw a rule: from the moment a gateway records it, it cancels nothing more (what it "
                 "removed stays removed)", withdraw_options),
}


# -- showing a message -------------------------------------------------------------------------
def _text(raw: bytes) -> Tuple[str, bool]:
    """(text, whether it is the bytes exactly): UTF-8 as it is, other bytes escaped."""
    try:
        return raw.decode("utf-8"), True
    except UnicodeDecodeError:
        return raw.decode("utf-8", "backslashreplace"), False


def _shown(text: str) -> str:
    """For a terminal: control characters escaped, so no id can move the cursor or hide a line."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def record(m: Listed) -> Dict[str, object]:
    """One message for scripts (JSON, CSV): text where it is text, and the exact bytes in
    base64 beside it where it is not."""
    out: Dict[str, object] = {}
    for name, raw in (("message_id", m.message_id), ("routing_key", m.routing_key)):
        if raw is None:
            out[name] = None
            continue
        text, exact = _text(raw)
        out[name] = text
        if not exact:
            out[name + "_base64"] = base64.b64encode(raw).decode("ascii")
    out.update(handle=m.handle, due_ms=m.due_ms, due=iso_ms(m.due_ms), size=m.size, retry_attempt=m.retry_attempt,
               retry_queue=out["routing_key"] if m.retry else None, read_us=m.read_us)
    return out


CSV_FIELDS = ("message_id", "handle", "routing_key", "due_ms", "due", "size", "retry_attempt", "retry_queue",
              "read_us", "message_id_base64", "routing_key_base64")


def table(listed: List[Listed], now_ms: int) -> List[str]:
    rows = [("message id (or handle)", "routing key", "due (UTC)", "", "size", "retry")]
    for m in listed:
        ident = _shown(_text(m.message_id)[0]) if m.message_id is not None else m.handle
        key = _shown(_text(m.routing_key)[0])
        retry = "" if not m.retry else f"{m.retry_attempt or '?'} to {key}"
        rows.append((ident, "" if m.retry else key, plain_ms(m.due_ms), due_in(m.due_ms - now_ms), str(m.size),
                     retry))
    widths = [min(60, max(len(r[i]) for r in rows)) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(widths[i]) if i != 4 else cell.rjust(widths[i]) for i, cell in enumerate(r)).rstrip()
            for r in rows]


# -- the command -------------------------------------------------------------------------------
def main(settings: Settings, **own: Any) -> int:
    """`delay-gateway pending ACTION`: `own` is the action and its options."""
    return command(Options(**own), settings)


def command(args: Options, settings: Settings) -> int:
    chain = settings.chain
    names = chain.names
    now = wall_ms()
    window_ms = settings.cancel_window_ms
    url = settings.one_vhost_urls
    trusted = settings.trusted_user
    role = ROLES[args.action]
    if args.action == "rules":
        with blocking_channel(url, "delay-gateway pending rules", settings.tls, role) as channel:
            return show_rules(args, cancellations.read(channel.connection, names, window_ms, trusted), now)
    if args.action == "withdraw":
        name = rule_name(args.rule, "RULE")
        with blocking_channel(url, "delay-gateway pending withdraw", settings.tls, role) as channel:
            return withdraw(args, channel, names, window_ms, trusted, name)
    select = selection(args, now)
    if args.action == "cancel":
        everything = checked_cancel(args, select)
    exporting: Optional[Exporter] = Exporter(args.out) if args.action == "export" else None
    keep = None if args.action in ("count", "export") else SAMPLE if args.action == "cancel" else args.limit
    progress = Progress() if sys.stderr.isatty() else None
    with blocking_channel(url, f"delay-gateway pending {args.action}", settings.tls, role) as channel:
        recorded = cancellations.read(channel.connection, names, window_ms, trusted)
        judge = listing.cancelled_by(recorded.store(window_ms, now), recorded.rules, now)
        try:
            view, found = index_reader.read(channel.connection, chain, trusted, now, lambda at: listing.View(
                now, at, judge, select, keep, exporting.write if exporting is not None else None),
                progress.show if progress is not None else None)
            found.gaps += recorded.gaps()
        except index_reader.Missing as exc:
            raise UsageError(str(exc)) from None
        finally:
            if progress is not None:
                progress.clear()
            if exporting is not None:
                exporting.close()
        if args.action == "cancel":
            return cancel_selected(args, channel, names, trusted, select, everything, view, found, recorded,
                                   window_ms, now)
    if args.action == "list":
        show_list(args, view, found, now)
    elif args.action == "count":
        show_count(args, view, found, now)
    else:
        print(f"exported {view.total} waiting message(s) to {args.out}", file=sys.stderr)
        for note in notes(found):
            print(f"note: {note}", file=sys.stderr)
    return 0


class Progress:
    """A line on the terminal (stderr) while a long reading goes on."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.shown = False

    def show(self, entries: int, keys: int) -> None:
        if time.monotonic() - self.started < 1.0:
            return
        self.shown = True
        print(f"\rreading the index: {entries:,} entries, {keys:,} done keys, "
              f"{time.monotonic() - self.started:.0f} s", end="", file=sys.stderr, flush=True)

    def clear(self) -> None:
        if self.shown:
            print("\r\033[K", end="", file=sys.stderr, flush=True)


class Exporter:
    """Writes each message as the view finds it (unsorted: Spark sorts), so an export of
    millions holds none of them."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.csv = path.endswith(".csv")
        if not self.csv and not path.endswith((".jsonl", ".json")) and path != "-":
            raise UsageError(f"{path!r}: give a .csv, .jsonl or .json file (or - for JSON lines on stdout)")
        try:
            self.file: IO[str] = sys.stdout if path == "-" else open(path, "w", encoding="utf-8", newline="")
        except OSError as exc:
            raise UsageError(f"cannot write {path}: {exc.strerror}") from None
        self.writer = csv.DictWriter(self.file, CSV_FIELDS) if self.csv else None
        if self.writer is not None:
            self.writer.writeheader()

    def write(self, m: Listed) -> None:
        if self.writer is not None:
            self.writer.writerow(record(m))
        else:
            self.file.write(json.dumps(record(m), ensure_ascii=False) + "\n")

    def close(self) -> None:
        if self.file is not sys.stdout:
            self.file.close()


def notes(found: index_reader.Found) -> List[str]:
    return found.notes()


def show_list(args: Options, view: listing.View, found: index_reader.Found, now_ms: int) -> None:
    listed = view.listed()
    shown = f"{len(listed)} shown" if len(listed) < view.total else "all shown"
    summary = f"{view.total} waiting message(s) match; {shown} (soonest due first)"
    if args.json:
        for m in listed:
            print(json.dumps(record(m), ensure_ascii=False))
    elif args.csv:
        writer = csv.DictWriter(sys.stdout, CSV_FIELDS)
        writer.writeheader()
        for m in listed:
            writer.writerow(record(m))
    else:
        print("\n".join(table(listed, now_ms)))
        print(f"\n{summary}{'' if len(listed) == view.total else f'; --limit {view.total} for all'}")
        for note in notes(found):
            print(f"note: {note}")
        return
    print(summary, file=sys.stderr)
    for note in notes(found):
        print(f"note: {note}", file=sys.stderr)


def show_count(args: Options, view: listing.View, found: index_reader.Found, now_ms: int) -> None:
    ranges = {label: n for (label, _), n in zip(view.counts.ranges, view.counts.counts, strict=True)}
    if args.json:
        print(json.dumps({"total": view.total, "ranges": ranges, "exact": found.exact, "at_ms": now_ms,
                          "unread_in_check_in": found.unread_check_in, "notes": notes(found)}, indent=2))
        return
    print(f"{view.total} waiting message(s) match" + ("" if found.exact else " (not exact: see the notes)"))
    for label, n in ranges.items():
        print(f"  {label:<16} {n:>10}")
    for note in notes(found):
        print(f"note: {note}")


# -- group cancels -----------------------------------------------------------------------------
def checked_cancel(args: Options, select: Selection) -> bool:
    """Whether the cancel means every message (--all); refuses what is ambiguous."""
    if args.all and not select.empty:
        raise UsageError("--all with a filter: give the filters, or --all alone")
    if select.key is not None and selects_every_key(select.key):
        raise UsageError(f"--key {select.key!r} selects every routing key: say --all to mean every message")
    for i in select.ids:
        if i.startswith(b"@") and cancels.handle_read_us(i) is None:
            raise UsageError(f"--id {i.decode('utf-8', 'replace')!r} is not a handle ('@' and 20 letters and "
                             "digits, as `pending list` shows one): a handle names one message")
    if args.replace and args.name is None:
        raise UsageError("--replace names no rule: give --name NAME")
    if select.empty and not args.all and args.yes:
        raise UsageError("no filter: this would cancel every waiting message; add --all to mean it, or give "
                         "--key, --id, --header, --due-after, --due-before or --retries")
    if args.name is not None:
        rule_name(args.name, "--name")
    return bool(args.all)


def rule_name(text: str, what: str) -> bytes:
    raw = text.encode("utf-8", "surrogateescape")
    if not raw or len(raw) > rules.MAX_NAME_BYTES:
        raise UsageError(f"{what}: a rule's name is 1 to {rules.MAX_NAME_BYTES} bytes, not {len(raw)}")
    return raw


def rule_headers(select: Selection, everything: bool, name: bytes) -> Table:
    """The rule as any AMQP client publishes it (rules.py's vocabulary)."""
    return Table([wire.longstr(rules.NAME, name)] + rules.filter_fields(select, everything))


def cancel_selected(args: Options, channel, names, trusted: str, select: Selection, everything: bool,
                    view: listing.View, found: index_reader.Found, recorded: cancellations.Recorded, window_ms: int,
                    now_ms: int) -> int:
    """Say how many match and show some; with --yes, publish one rule and say what became of it."""
    print(f"{view.total} waiting message(s) match" + (", for example:" if view.total else ""))
    if view.total:
        print("\n".join(table(view.listed(), now_ms)))
    for note in notes(found):
        print(f"note: {note}")
    if args.yes and found.earlier:
        print(f"delay-gateway pending cancel: error: {found.earlier} gateway(s) of version 0.1.0 read check-in: "
              "such a gateway takes a rule for a message due now and delivers it; publish group cancels once the "
              "last one has stopped (docs/upgrading.md): nothing cancelled", file=sys.stderr)
        return 2
    if args.expect is not None and not found.exact:
        print(f"delay-gateway pending cancel: error: the listing is not exact ({'; '.join(found.reasons())}), so "
              f"--expect {args.expect} cannot be checked: nothing cancelled; try again once it is, or drop --expect",
              file=sys.stderr)
        return 2
    if args.expect is not None and args.expect != view.total:
        print(f"delay-gateway pending cancel: error: {view.total} waiting message(s) match, not {args.expect} "
              "(--expect): nothing cancelled", file=sys.stderr)
        return 2
    if not args.yes:
        if select.empty and not everything:
            print("nothing cancelled: add --all --yes to cancel every waiting message")
        else:
            print(f"nothing cancelled: add --yes to cancel these {view.total}, and every other message the "
                  "filters select that was published before the cancel (listed or not)")
        return 0
    name = (args.name or f"pending-{uuid.uuid4().hex[:12]}").encode("utf-8")
    shown = name.decode("utf-8", "replace")
    before = recorded.rules.recorded.get(name, -1)
    if any(r.name == name for r in recorded.rules.live) and not args.replace:
        print(f"delay-gateway pending cancel: error: a live rule is named {shown} (delay-gateway pending rules): "
              "give another --name, or --replace to withdraw it as this one is recorded; nothing cancelled",
              file=sys.stderr)
        return 2
    channel.confirm_delivery()
    try:
        with needing("write"):
            if args.replace:  # (in one queue, in this order: the withdrawal ends what was recorded before it)
                channel.basic_publish(names.rules, "", b"", pika.BasicProperties(
                    headers={rules.WITHDRAW: shown}, delivery_mode=2), mandatory=True)
            channel.basic_publish(names.rules, "", b"", pika.BasicProperties(
                headers=_pika_headers(rule_headers(select, everything, name)), delivery_mode=2), mandatory=True)
    except pika.exceptions.UnroutableError:
        print(f"delay-gateway pending cancel: {names.rules} is bound to no queue: declare the topology "
              "(delay-gateway declare) or start the gateway", file=sys.stderr)
        return 3
    print(f"rule {shown}: {select.describe() if not everything else '--all'}, published; "
          f"{view.total} waiting message(s) listed match it")
    published = time.monotonic()
    deadline = published + args.wait
    rule, removed, seen = wait_for_rule(channel.connection, names, window_ms, trusted, name, before, view.total,
                                        deadline)
    recorded_after_s = seen - published
    if rule is None:
        print(f"queued: no gateway recorded rule {shown} within {args.wait:g} s (none running, or a backlog in "
              "check-in); once check-in reads it, it cancels every message it selects that was published before "
              "it, whether or not it is listed")
        return 0
    print(f"recorded at {iso_ms(rule.at.read_us // 1000)} ({recorded_after_s:.1f} s after it was published): no "
          "message it selects that was published before then will be delivered")
    rest = f"; the rest as each next passes a gateway (the last is due {iso_ms(view.latest_due_ms)})" \
        if removed < view.total and view.latest_due_ms is not None else ""
    print(f"removed so far: {removed} of the {view.total} expected{rest}")
    return 0


def _pika_headers(table: Table) -> Dict[str, Any]:
    """A table of longstr, array-of-longstr, long, boolean and nested longstr table, for pika."""
    out: Dict[str, Any] = {}
    for e in table.entries:
        value = e.value
        if isinstance(value, Table):
            value = value.to_dict()
        out[e.name.decode("utf-8")] = value
    return out


def wait_for_rule(connection, names, window_ms: int, trusted: str, name: bytes, before_us: int, expected: int,
                  deadline: float) -> Tuple[Optional[rules.Rule], int, float]:
    """The rule once a gateway recorded it (a rule of its name recorded after `before_us`; None
    if none was by `deadline`), what the gateways reported removing by it once they report
    all `expected` (or by `deadline`), and when it was first seen recorded (time.monotonic())."""
    found: Optional[rules.Rule] = None
    seen = 0.0
    while True:
        recorded = cancellations.read(connection, names, window_ms, trusted)
        if found is None:
            found = next((r for r in recorded.rules.live if r.name == name and r.at.read_us > before_us), None)
            seen = time.monotonic()
        removed = recorded.tallies.get(name, 0)
        if (found is not None and removed >= expected) or time.monotonic() >= deadline:
            return found, removed, seen
        time.sleep(0.5)


def withdraw(args: Options, channel, names, window_ms: int, trusted: str, name: bytes) -> int:
    before = cancellations.read(channel.connection, names, window_ms, trusted)
    live = [r for r in before.rules.live if r.name == name]
    channel.confirm_delivery()
    try:
        with needing("write"):
            channel.basic_publish(names.rules, "", b"", pika.BasicProperties(
                headers={rules.WITHDRAW: name.decode("utf-8")}, delivery_mode=2), mandatory=True)
    except pika.exceptions.UnroutableError:
        print(f"delay-gateway pending withdraw: {names.rules} is bound to no queue: declare the topology "
              "(delay-gateway declare) or start the gateway", file=sys.stderr)
        return 3
    shown = name.decode("utf-8", "replace")
    deadline = time.monotonic() + args.wait
    while True:
        after = cancellations.read(channel.connection, names, window_ms, trusted)
        done = after.rules.recorded.get(name, -1) > before.rules.recorded.get(name, -1)
        if done or time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    if not done:
        print(f"queued: no gateway recorded the withdrawal of {shown} within {args.wait:g} s; it applies once "
              "check-in reads it (to rules of this name published before it)")
    elif live:
        print(f"withdrawn: rule {shown} cancels nothing more; it removed {after.tallies.get(name, 0)} message(s) "
              "before")
    else:
        print(f"withdrawn: no live rule was named {shown} (one still queued in check-in before the withdrawal is "
              "withdrawn with it)")
    return 0


def show_rules(args: Options, recorded: cancellations.Recorded, now_ms: int) -> int:
    live = sorted(recorded.rules.live, key=lambda r: r.at.read_us)
    if args.json:
        for r in live:
            print(json.dumps({"rule": r.name.decode("utf-8", "backslashreplace"),
                              "recorded": iso_ms(r.at.read_us // 1000), "recorded_us": r.at.read_us,
                              "filter": described(r), "removed": recorded.tallies.get(r.name, 0)}, ensure_ascii=False))
        return 0
    if not live:
        print("no live rule (group cancel) in the retention window")
        return 0
    cells = [("rule", "recorded (UTC)", "removed", "filter")] + [
        (_shown(r.name.decode("utf-8", "backslashreplace")), plain_ms(r.at.read_us // 1000),
         str(recorded.tallies.get(r.name, 0)), _shown(described(r))) for r in live]
    widths = [max(len(c[i]) for c in cells) for i in range(3)]
    for c in cells:
        print("  ".join([c[0].ljust(widths[0]), c[1].ljust(widths[1]), c[2].rjust(widths[2]), c[3]]))
    print(f"\n{len(live)} live rule(s); each cancels what it selects that was published before it was recorded")
    return 0


def described(rule: rules.Rule) -> str:
    return "--all" if rule.everything else rule.select.describe()
