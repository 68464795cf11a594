"""`delay-gateway pending`: list, count, cancel and export the messages that wait.

What waits is read from the waiting streams the gateways write (gateway/core/waiting.py,
gateway/broker/waiting.py), filtered by message id, routing key, due time, header or
retries. `cancel` cancels what the filters select through the path `delay-gateway cancel`
takes, by each message's handle: exactly the messages selected, with every guarantee of a
confirmed cancel (docs/cancelling.md).
"""

import argparse
import csv
import datetime
import json
import re
import sys
from typing import IO, Any, Callable, Dict, List, Optional, Tuple

import pika

from gateway.broker import cancelling
from gateway.broker import waiting as index
from gateway.broker.amqp import blocking_channel
from gateway.clock import wall_ms
from gateway.commands import cancel as cancelling_command
from gateway.core import cancels, waiting
from gateway.core.waiting import Listed, Selection
from gateway.settings import Settings, UsageError, argument, integer
from gateway.urls import one_vhost

SAMPLE = 10  # what `pending cancel` shows before it acts
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


def selection(args: argparse.Namespace, now_ms: int) -> Selection:
    at = when(now_ms)
    try:
        after = at(args.due_after) if args.due_after is not None else None
        before = at(args.due_before) if args.due_before is not None else None
    except ValueError as exc:
        raise UsageError(f"--due-after/--due-before: {exc}") from None
    ids = tuple(i.encode("utf-8", "surrogateescape") for i in args.id)
    return Selection(ids, args.key, after, before, tuple(args.header), args.retries)


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
    p.add_argument("--yes", action="store_true", help="cancel them (without it: say how many, and show some)")
    p.add_argument("--wait", type=float, default=10.0, metavar="SECONDS",
                   help="how long to wait for a gateway to record the cancels (default 10)")


def export_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("out", metavar="OUT", help="file to write: .csv, or .jsonl / .json (one object a line); "
                                              "- writes JSON lines to standard output")
    _filters(p)


ACTIONS = {
    "list": ("list the messages that wait, soonest due first: message id (or handle), routing key, due time, "
             "size, retry attempt", list_options),
    "count": ("count the messages that wait, per due-time range", count_options),
    "cancel": ("cancel the messages the filters select, exactly those (by their handles), through the path "
               "`delay-gateway cancel` takes; only with --yes", cancel_options),
    "export": ("write every message that waits to a CSV or JSON-lines file (for Spark, or a spreadsheet)",
               export_options),
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


def clock_text(ms: int) -> str:
    return datetime.datetime.fromtimestamp(ms / 1000, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def iso(ms: int) -> str:
    return datetime.datetime.fromtimestamp(ms / 1000, datetime.timezone.utc).isoformat(timespec="milliseconds")


def relative(ms: int) -> str:
    """A span of time for people: "in 3 h 2 min", "overdue 4 s"."""
    later, left = ms >= 0, abs(ms)
    parts: List[str] = []
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("min", 60_000), ("s", 1000)):
        if parts or left >= size:  # the first unit there is, and the one after it
            parts.append(f"{left // size} {unit}")
            left %= size
        if len(parts) == 2:
            break
    said = " ".join(parts) or f"{left} ms"
    return f"in {said}" if later else f"overdue {said}"


def record(m: Listed) -> Dict[str, object]:
    """One message for scripts (JSON, CSV): text where it is text, and the exact bytes in
    base64 beside it where it is not."""
    import base64
    out: Dict[str, object] = {}
    for name, raw in (("message_id", m.message_id), ("routing_key", m.routing_key)):
        if raw is None:
            out[name] = None
            continue
        text, exact = _text(raw)
        out[name] = text
        if not exact:
            out[name + "_base64"] = base64.b64encode(raw).decode("ascii")
    out.update(handle=m.handle, due_ms=m.due_ms, due=iso(m.due_ms), size=m.size, retry_attempt=m.retry_attempt,
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
        rows.append((ident, "" if m.retry else key, clock_text(m.due_ms), relative(m.due_ms - now_ms), str(m.size),
                     retry))
    widths = [min(60, max(len(r[i]) for r in rows)) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(widths[i]) if i != 4 else cell.rjust(widths[i]) for i, cell in enumerate(r)).rstrip()
            for r in rows]


# -- the command -------------------------------------------------------------------------------
def main(settings: Settings, **own: Any) -> int:
    """`delay-gateway pending ACTION`: `own` is the action and its options."""
    return command(argparse.Namespace(**own), settings)


def command(args: argparse.Namespace, settings: Settings) -> int:
    chain = settings.chain
    names = chain.names
    now = wall_ms()
    select = selection(args, now)
    limit = getattr(args, "limit", 0) if args.action == "list" else 0
    window_ms = cancelling.retention_ms(chain, settings.cancel_retention)
    exporting: Optional[Exporter] = Exporter(args.out) if args.action == "export" else None
    selected: Dict[str, Listed] = {}
    # (a count keeps none of them, an export writes each as it comes, a cancel keeps one per
    # handle; only a list keeps messages, --limit of them)
    each: Optional[Callable[[Listed], object]] = exporting.write if exporting is not None else \
        (lambda m: selected.setdefault(m.handle, m)) if args.action == "cancel" else \
        (lambda m: None) if args.action == "count" else None
    with blocking_channel(one_vhost(settings.urls, settings.vhosts), f"delay-gateway pending {args.action}",
                          settings.tls) as channel:
        store = cancels.Store(window_ms)
        for mid, at in cancelling.read(channel.connection, names, window_ms):
            store.add(mid, at, now)
        try:
            view, found = index.read(channel.connection, names, now, lambda at: waiting.View(
                now, at, waiting.cancelled_by(store, now), select, limit, each))
        except index.Missing as exc:
            raise UsageError(str(exc)) from None
        finally:
            if exporting is not None:
                exporting.close()
        if args.action == "cancel":
            return cancel_selected(args, channel, names, selected, found, window_ms, now)
    if args.action == "list":
        show_list(args, view, found, now)
    elif args.action == "count":
        show_count(args, view, found, now)
    else:
        print(f"exported {view.total} waiting message(s) to {args.out}", file=sys.stderr)
        for note in notes(found):
            print(f"note: {note}", file=sys.stderr)
    return 0


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


def notes(found: index.Found) -> List[str]:
    out = list(found.notes)
    if found.unread_check_in:
        out.append(f"{found.unread_check_in} message(s) wait in check-in, not read by a gateway yet: not listed "
                   "until it has read them")
    return out


def show_list(args: argparse.Namespace, view: waiting.View, found: index.Found, now_ms: int) -> None:
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


def show_count(args: argparse.Namespace, view: waiting.View, found: index.Found, now_ms: int) -> None:
    ranges = {label: n for (label, _), n in zip(view.counts.ranges, view.counts.counts, strict=True)}
    if args.json:
        print(json.dumps({"total": view.total, "ranges": ranges, "exact": found.horizon.exact, "at_ms": now_ms,
                          "unread_in_check_in": found.unread_check_in, "notes": notes(found)}, indent=2))
        return
    print(f"{view.total} waiting message(s) match")
    for label, n in ranges.items():
        print(f"  {label:<16} {n:>10}")
    for note in notes(found):
        print(f"note: {note}")


def cancel_selected(args: argparse.Namespace, channel, names, selected: Dict[str, Listed], found: index.Found,
                    window_ms: int, now_ms: int) -> int:
    """Say how many and show some; with --yes, cancel each by its handle and say what was."""
    print(f"{len(selected)} waiting message(s) match" + (", for example:" if selected else ""))
    if selected:
        sample = sorted(selected.values(), key=lambda m: (m.due_ms, m.read_us))[:SAMPLE]
        print("\n".join(table(sample, now_ms)))
    for note in notes(found):
        print(f"note: {note}")
    if not selected:
        return 0
    if not args.yes:
        print(f"nothing cancelled: add --yes to cancel these {len(selected)}")
        return 0
    handles = [h.encode("ascii") for h in selected]
    before = cancelling_command.latest(cancelling.read(channel.connection, names, window_ms))
    channel.confirm_delivery()
    for h in handles:
        try:
            channel.basic_publish(names.cancel, "", b"", pika.BasicProperties(message_id=h.decode("ascii"),
                                                                              delivery_mode=2), mandatory=True)
        except pika.exceptions.UnroutableError:
            print(f"delay-gateway pending cancel: {names.cancel} is bound to no queue: declare the topology "
                  "(delay-gateway declare) or start the gateway", file=sys.stderr)
            return 3
    recorded = cancelling_command.wait_recorded(channel.connection, names, window_ms, handles, before, args.wait)
    for h in handles:
        m = selected[h.decode("ascii")]
        ident = _shown(_text(m.message_id)[0]) if m.message_id is not None else h.decode("ascii")
        state = "cancelled" if h in recorded else "queued (no gateway recorded it yet: it applies once check-in " \
                                                  "reads it)"
        print(f"{state}: {ident} {_shown(_text(m.routing_key)[0])!r} due {iso(m.due_ms)} ({h.decode('ascii')})")
    done = sum(1 for h in handles if h in recorded)
    print(f"{done} of {len(handles)} cancelled" + ("" if done == len(handles) else
                                                    f"; {len(handles) - done} queued"))
    return 0

