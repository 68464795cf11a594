"""Formats are forever: every format the gateway has written where messages wait, read by
today's code.

tests/formats/samples/<format>/<date>-<commit>.json holds, for each era of each format, the
bytes that commit's own code wrote from fixed inputs and what that code read back from them
(tests/formats/README.md). Each test here decodes a sample with today's readers and checks
that it yields what the sample says. A message scheduled today may be read months later by
a later version: a change that makes any sample unreadable fails here.

Where today's code cannot read an era, the test is an expected failure (strict: it fails the
suite once the code reads it again, so the mark comes off), with the reason; what today's
code does with such a message instead is asserted by a test beside it.

Pure: no broker, no clock (the samples' time is 2026-11-22T01:13:20Z, `generate.NOW`).
"""

import json
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest
from pika import data, spec

from gateway.broker.run.cancelling import Judge
from gateway.commands.parked import NOT_OURS, Parked, destination
from gateway.core import cancels, carrier, envelope, handlers, horizon, index_records, listing, retries, rules, wire
from gateway.core.actions import Enqueue, Forward
from gateway.core.carrier import Entry
from gateway.core.inputs import Delivery
from gateway.core.routes import Way
from gateway.core.rules import Rules
from gateway.core.selection import Selection
from gateway.core.wire import Properties, Table, TableField
from gateway.metrics import Metrics
from gateway.spark import progress, record
from topology import registry

from tests.formats.generate import (CHAIN, FORMATS, LEAD_MS, NOW, SAMPLES, changed, files, samples,
                                    schedule_fingerprint)

NAMES = CHAIN.names
Json = Dict[str, Any]

# -- the eras read by a reader of their own ---------------------------------------------------------------------
FIRST_FORMAT = ("0a9c351", "a11db56")  # the format of 2026-11-21, until the core rework 1013189 (envelope.first_format)
OLD_INDEX = "345936a"  # the index of 2026-11-25 22:28 .. 23:01, before 4a05290 (index_records.first_layout)
BEFORE_CANCEL_MARK = ("f602c79", "ae852a0")  # a parked cancel had no x-gateway-exchange before 7438e7c

# -- the eras today's code cannot read (strict expected failures) ---------------------------------------------
# (No way to tell such a record from one of an unstamped cancel: the same headers, one time in µs, often a
# multiple of 1000 either way; nor by the broker's own stamp on the record where it stamps arrivals, which
# today's record of a cancel whose stamp check-in left out as implausible carries too.)
STAMP_AS_TIME_WHY = (
    "a stamped cancel recorded by f602c79..a2c9377 carries one time, the broker's arrival stamp x 1000; "
    "cancels.read_record takes it for a read time without a stamp, so against a message read since f5c00af "
    "(its read time on the gateway's clock, its own stamp) it compares the cancel's stamp with the message's read "
    "time: a message stamped before the cancel but read after the cancel's stamp is not cancelled")


def xfail(why: str) -> Any:
    return pytest.mark.xfail(strict=True, reason=why)


# -- the samples --------------------------------------------------------------------------------------------
def documents() -> Iterator[Tuple[str, Path, Json]]:
    for fmt in sorted(FORMATS):
        for path in files(fmt):
            yield fmt, path, json.loads(path.read_text())


DOCUMENTS = list(documents())


def cases(wanted: Dict[str, Optional[Tuple[str, ...]]], known: Optional[Dict[str, str]] = None,
          only: Optional[Tuple[str, ...]] = None) -> List[Any]:
    """pytest params (commit, sample) of the formats' variants wanted (None: every variant);
    `known`: commit -> why today's code cannot read that era (a strict xfail); `only`: these
    eras (their first commits) alone."""
    out = []
    for fmt, path, doc in DOCUMENTS:
        if fmt not in wanted:
            continue
        commit = doc["written_by"]["commit"][:7]
        if only is not None and commit not in only:
            continue
        for variant, sample in doc["samples"].items():
            if wanted[fmt] is not None and variant not in wanted[fmt]:
                continue
            why = (known or {}).get(commit)
            out.append(pytest.param(commit, sample, id=f"{fmt}/{path.stem}/{variant}",
                                    marks=[xfail(why)] if why else []))
    return out


def raw(hexed: str) -> bytes:
    return bytes.fromhex(hexed)


def delivery(message: Json, exchange: Optional[str] = None, props: Optional[Properties] = None) -> Delivery:
    return Delivery(exchange if exchange is not None else message["exchange"], raw(message["routing_key"]),
                    props if props is not None else Properties.parse(raw(message["properties"])), raw(message["body"]))


def as_expected(e: Entry) -> Json:
    """An entry as the samples say one: bytes as hex."""
    return {"accepted_us": e.accepted_us, "body": e.body.hex(), "due_ms": e.due_ms, "exchange": e.exchange,
            "routing_key": e.routing_key.hex(), "user_properties": e.user.raw.hex()}


def entry_of(expected: Json) -> Entry:
    return Entry(raw(expected["routing_key"]), Properties.parse(raw(expected["user_properties"])),
                 raw(expected["body"]), expected["due_ms"], expected["accepted_us"], expected["exchange"])


SINGLE = {"envelope": None, "meditation": ("alone",), "arrival-stamp": None, "retry": ("alone",), "moved": None}
CARRIED = {"carrier": None, "meditation": ("carrier",), "retry": ("carrier",)}


# -- one message in the gateway's format, alone or in carriers ------------------------------------------------
@pytest.mark.parametrize("commit, sample", cases(SINGLE))
def test_a_message_alone_reads_as_written(commit: str, sample: Json) -> None:
    """handlers.entries (what returning and the distributor read) yields the message the sample
    says: its due time, the publisher's routing key, properties (their exact bytes) and body,
    its read time (None where its version kept none: any cancel for its id cancels it) and
    where it goes when due (None: pick-up; "": a retry's queue). A message of the first format
    (2026-11-21) too: its publisher's properties as that version restored them at pick-up."""
    want = sample["expected"]
    (got,) = handlers.entries(delivery(sample["message"]))
    assert as_expected(got) == {k: want[k] for k in as_expected(got)}
    assert envelope.Inside(Properties.parse(raw(sample["message"]["properties"]))).error == want["error"] is None


@pytest.mark.parametrize("commit, sample", cases(CARRIED))
def test_a_carrier_reads_as_written(commit: str, sample: Json) -> None:
    """Each message of a carrier, in order, with its own due time and read time (an old
    carrier, or an entry 0 in the array: None) and the carrier's destination."""
    want = sample["expected"]
    props = Properties.parse(raw(sample["message"]["properties"]))
    assert props.headers.get(carrier.COUNT) == want["count"] == len(want["messages"])
    assert props.headers.get(envelope.DUE_AT) == want["due_ms"] == min(m["due_ms"] for m in want["messages"])
    assert [as_expected(e) for e in handlers.entries(delivery(sample["message"]))] == want["messages"]


def with_headers(props: Properties, added: Json) -> Properties:
    """`props` with these headers set last, as pika encodes them (as the broker would)."""
    pieces: List[bytes] = []
    data.encode_table(pieces, added)
    headers: Table = props.headers
    for e in Table.parse(b"".join(pieces)[4:]).entries:
        headers = headers.with_entry(TableField(e.name, e.kind, e.raw))
    return props.replace(headers=headers)


def dead_lettered(props: Properties, queue: str, exchange: str, reason: str, stamped: bool = True) -> Properties:
    """The properties as they come back from a queue that dead-lettered them: the broker's
    x-death and x-first-death-* (and, where it stamps arrivals, timestamp_in_ms) beside ours."""
    death = {"count": 1, "reason": reason, "queue": queue, "time": datetime(2026, 12, 3, tzinfo=timezone.utc),
             "exchange": exchange, "routing-keys": [""]}
    stamp = {"timestamp_in_ms": NOW + 12 * 86_400_000} if stamped else {}
    return with_headers(props, {"x-death": [death], "x-first-death-exchange": exchange, "x-first-death-queue": queue,
                                "x-first-death-reason": reason, **stamp})


@pytest.mark.parametrize("commit, sample", cases({"meditation": None}))
def test_a_meditation_lap_reads_as_written(commit: str, sample: Json) -> None:
    """Back from a lap of meditation, with the broker's dead-letter history beside our headers,
    a message (or a carrier's messages) reads as it was sent round. (The first format kept our
    headers in the publisher's own table, where a broker that stamps arrivals stamped the
    publish to check-in and keeps that stamp on every later publish: the lap adds none, and a
    stamp there is the publisher's, delivered as that version delivered it.)"""
    message = sample["message"]
    lapped = dead_lettered(Properties.parse(raw(message["properties"])), CHAIN.meditation, message["exchange"],
                           "expired", stamped=commit not in FIRST_FORMAT)
    got = handlers.entries(delivery(message, NAMES.returning, lapped))
    want = sample["expected"]
    messages = want["messages"] if "messages" in want else [
        {k: want[k] for k in ("accepted_us", "body", "due_ms", "exchange", "routing_key", "user_properties")}]
    assert [as_expected(e) for e in got] == messages


@pytest.mark.parametrize("commit, sample", cases({"envelope": None, "meditation": ("alone",), "arrival-stamp": None},
                                                 only=FIRST_FORMAT))
def test_the_first_format_goes_on(commit: str, sample: Json) -> None:
    """A message in the first format (2026-11-21) that reaches the distributor is delivered at
    its due time with its publisher's routing key, properties and body as that version
    delivered them; one back from meditation goes on by its due time in today's format."""
    d, want = delivery(sample["message"]), sample["expected"]
    if sample["message"]["exchange"] == CHAIN.meditation:
        (onward,) = handlers.Returning(CHAIN, LEAD_MS)(delivery(sample["message"], NAMES.returning), NOW)
        assert isinstance(onward, Enqueue)
        sent = handlers.carry(onward.exchange, onward.routing_key, onward.way, [onward.entry])
        assert envelope.Inside(sent.props).complete and envelope.PROPERTIES in sent.props.headers
        (got,) = handlers.entries(Delivery(onward.exchange, onward.routing_key, sent.props, sent.body))
        assert as_expected(got) == {k: want[k] for k in as_expected(got)}
        return
    (released,) = handlers.Distributor(CHAIN, LEAD_MS)(delivery(sample["message"], NAMES.distributor),
                                                       want["due_ms"] - 1)
    assert (released.exchange, released.routing_key, released.body, released.not_before_ms) == (
        NAMES.pick_up, raw(want["routing_key"]), d.body, want["due_ms"])
    assert released.props.raw.hex() == want["user_properties"]


@pytest.mark.parametrize("commit, sample", cases({"meditation": ("alone",)}, only=FIRST_FORMAT))
def test_a_first_format_message_that_cannot_go_on_is_parked_readable(commit: str, sample: Json) -> None:
    """Parked (handlers.park_delivery: its queue refused it), a message in the first format is
    parked in today's format with its publisher's properties, routing key and due time."""
    want = sample["expected"]
    (parked,) = handlers.park_delivery(NAMES, delivery(sample["message"], NAMES.returning), "refused")
    inside = envelope.Inside(parked.props)
    assert (inside.routing_key, inside.user, inside.due_ms, inside.error) == (
        raw(want["routing_key"]), Properties.parse(raw(want["user_properties"])), want["due_ms"], "refused")


@pytest.mark.parametrize("commit, sample", cases({"moved": None}))
def test_a_moved_message_is_fenced_by_when_it_was_published_to_the_plugin(commit: str, sample: Json) -> None:
    """A message moved from the plugin with no read time (3d8ec38) or a negative one (b0f94ec)
    counts as published before any cancel the gateway recorded: any cancel held for its id
    cancels it. Since 2026-11-28 its read time is when the plugin took it in (its due time
    less its x-delay): a cancel recorded before that (an hour before, here) does not cancel it,
    one after does."""
    (moved,) = handlers.entries(delivery(sample["message"]))
    early, late = cancels.Store(86_400_000), cancels.Store(86_400_000)
    early.add(b"order-42-review", cancels.Time(NOW * 1000 - 3_600_000_000, None), NOW)
    late.add(b"order-42-review", cancels.Time(NOW * 1000 + 1, None), NOW + 1)
    taken_in = None if moved.accepted_us is None else cancels.Time(moved.accepted_us, None)
    held_early, held_late = early.get(moved.user.get("message_id")), late.get(moved.user.get("message_id"))
    assert held_early is not None and held_late is not None and held_late.cancels(taken_in)
    if moved.accepted_us is None or moved.accepted_us < 0:
        assert held_early.cancels(taken_in)
    else:
        assert moved.accepted_us == (moved.due_ms - moved.user.headers.get("x-delay")) * 1000
        assert not held_early.cancels(taken_in)


# -- parked messages --------------------------------------------------------------------------------------------
def parked(sample: Json) -> Parked:
    message = sample["message"]
    return Parked(1, Properties.parse(raw(message["properties"])), raw(message["body"]), raw(message["routing_key"]))


@pytest.mark.parametrize("commit, sample", cases({"parked": None}))
def test_a_parked_message_reads_as_written(commit: str, sample: Json) -> None:
    """`parked list` shows the reason, the publisher's routing key, properties and due time;
    `parked replay` sends a message with a due time to the distributor (its x-delay is not
    applied again), a retry to its queue with its attempts afresh, a cancel back to the cancel
    exchange (one parked before 7438e7c, which marked it no other way, known by its reason),
    anything else to check-in as its publisher sent it."""
    want, p = sample["expected"], parked(sample)
    assert p.reason == want["error"]
    assert (p.routing_key.hex(), p.user.raw.hex(), p.due_at, p.body.hex()) == (
        want["routing_key"], want["user_properties"], want["due_ms"], want["body"])
    exchange, key, props = destination(p, NAMES)
    if want["exchange"] == NAMES.cancel or "parks a cancel" in sample["produced_by"]:
        assert (exchange, key, props.raw.hex()) == (NAMES.cancel, p.routing_key, want["user_properties"])
    elif want["exchange"] == "":
        assert (exchange, key) == ("", raw(want["routing_key"]))
        assert props == retries.afresh(Properties.parse(raw(want["user_properties"])))
        assert props.headers.get(retries.ATTEMPT) is None
    elif want["due_ms"] is not None:
        assert (exchange, key) == (NAMES.distributor, b"")
        (again,) = handlers.entries(Delivery(exchange, key, props, p.body))
        assert as_expected(again) == {k: want[k] for k in as_expected(again)}
    else:
        assert (exchange, key, props.raw.hex()) == (NAMES.check_in, raw(want["routing_key"]), want["user_properties"])


@pytest.mark.parametrize("commit, sample", cases({"parked": ("cancel-without-id",)}, only=BEFORE_CANCEL_MARK))
def test_a_cancel_parked_before_7438e7c_is_replayed_as_a_cancel(commit: str, sample: Json) -> None:
    """Replayed to the cancel exchange, it is a cancel again: check-in parks it again with the
    same reason (it still has no id), and it never becomes a message due at once."""
    p = parked(sample)
    exchange, key, props = destination(p, NAMES)
    (again,) = handlers.CheckIn(CHAIN, LEAD_MS)(Delivery(exchange, key, props, p.body), NOW)
    assert isinstance(again, Forward) and again.exchange == NAMES.parked
    assert Parked(2, again.props, again.body, again.routing_key).reason == p.reason
    assert destination(Parked(2, again.props, again.body, again.routing_key), NAMES)[0] == NAMES.cancel


@pytest.mark.parametrize("commit, sample", cases({"parked": None}, only=FIRST_FORMAT))
def test_a_first_format_parked_message_replays_as_its_version_did(commit: str, sample: Json) -> None:
    """A message parked on 2026-11-21 replays as that version replayed it, in today's terms:
    with a due time (unroutable at pick-up, since a11db56) to the distributor, delivered at
    once with its publisher's properties; without one, to check-in with its publisher's
    properties and none of the gateway's old headers, which reads its x-delay again (as that
    version's check-in did: an unreadable one parks it again, with the same reason)."""
    want, p = sample["expected"], parked(sample)
    exchange, key, props = destination(p, NAMES)
    if want["due_ms"] is not None:
        (delivered,) = handlers.Distributor(CHAIN, LEAD_MS)(Delivery(exchange, key, props, p.body), NOW + 5)
        assert (delivered.exchange, delivered.routing_key, delivered.props.raw.hex(), delivered.not_before_ms) == (
            NAMES.pick_up, raw(want["routing_key"]), want["user_properties"], want["due_ms"])
        return
    assert (exchange, key, props.raw.hex()) == (NAMES.check_in, raw(want["routing_key"]), want["user_properties"])
    assert not [n for n in props.headers.names() if str(n).startswith(envelope.INTERNAL)]
    (again,) = handlers.CheckIn(CHAIN, LEAD_MS)(Delivery(exchange, key, props, p.body), NOW + 5)
    if "unreadable" in sample["produced_by"] or "cannot be read" in sample["produced_by"]:
        assert isinstance(again, Forward) and Parked(2, again.props, again.body, again.routing_key).reason == p.reason
    else:
        assert isinstance(again, Enqueue) and again.entry.due_ms == NOW + 5 + 90_000  # its x-delay, from the replay


# What 1013189 and every version until the first format was read again (envelope.first_format)
# did with a message in the first format that reached the distributor: parked it whole.
PARKED_WHOLE = "reached the distributor not in the gateway's format (no due time) (not in the gateway's format (no " \
    "due time))"


@pytest.mark.parametrize("commit, sample", cases({"envelope": None, "meditation": ("alone",), "arrival-stamp": None},
                                                 only=FIRST_FORMAT))
def test_a_first_format_message_parked_whole_replays_with_its_due_time(commit: str, sample: Json) -> None:
    """A message in the first format parked whole since (its properties the first format's, its
    reason that it was not in the gateway's format) replays to the distributor with its
    publisher's properties, routing key and due time: its x-delay is not applied again."""
    want, d = sample["expected"], delivery(sample["message"])
    assert NOT_OURS in PARKED_WHOLE
    whole = handlers.park(NAMES, d.props, d.routing_key, d.body, PARKED_WHOLE)
    p = Parked(1, whole.props, whole.body, whole.routing_key)
    assert (p.reason, p.routing_key.hex(), p.user.raw.hex(), p.due_at) == (
        PARKED_WHOLE, want["routing_key"], want["user_properties"], want["due_ms"])
    exchange, key, props = destination(p, NAMES)
    assert (exchange, key) == (NAMES.distributor, b"")
    (again,) = handlers.entries(Delivery(exchange, key, props, p.body))
    assert as_expected(again) == {k: want[k] for k in as_expected(again)}


def test_a_publishers_own_first_format_headers_are_never_read_as_ours() -> None:
    """x-gateway-* headers a publisher sends are its data: a message check-in parks (its delay
    unreadable) with headers that look like the first format replays to check-in as sent."""
    forged = Properties.build(delivery_mode=2, headers=Table([
        wire.longstr("x-delay", "soon"), wire.longstr(envelope.ROUTING_KEY, "elsewhere"),
        wire.long(envelope.DUE_AT, NOW - 1)]))
    (f,) = handlers.CheckIn(CHAIN, LEAD_MS)(Delivery(NAMES.check_in, b"mine", forged, b"x"), NOW)
    p = Parked(1, f.props, f.body, f.routing_key)
    assert (p.user, p.routing_key, p.due_at) == (forged, b"mine", None)
    assert destination(p, NAMES) == (NAMES.check_in, b"mine", forged)


# -- retries ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("commit, sample", cases({"retry": None}))
def test_a_retry_delivered_back_counts_its_attempt(commit: str, sample: Json) -> None:
    """A retry goes back to its queue with the consumer's properties and x-retry-attempt; when
    the consumer rejects it again, retries.failure reads the next attempt and the queue."""
    want = sample["expected"]
    for m in want.get("messages", [want]):
        user = Properties.parse(raw(m["user_properties"]))
        attempt = user.headers.get(retries.ATTEMPT)
        assert isinstance(attempt, int) and attempt >= 1 and m["exchange"] == ""
        rejected = dead_lettered(user, raw(m["routing_key"]).decode(), "", "rejected")
        assert retries.failure(rejected.headers) == retries.Failure("orders", attempt + 1, None)


# -- cancel records -------------------------------------------------------------------------------------------
def headers_of(sample: Json) -> Table:
    return Properties.parse(raw(sample["message"]["properties"])).headers


@pytest.mark.parametrize("commit, sample", cases({"cancel-record": ("record", "stamped", "handle")}))
def test_a_cancel_record_reads_as_written(commit: str, sample: Json) -> None:
    """read_record yields the id and the times. A record of the first cancel era has one time,
    which today's code takes for its read time (cancels.read_record's rule: see
    test_a_stamped_cancel_cancels_what_was_stamped_before_it for where that is wrong)."""
    want = sample["expected"]
    found = cancels.read_record(headers_of(sample))
    assert found is not None
    mid, at = found
    assert mid.hex() == want["id"]
    if "time_us" in want:
        assert at == cancels.Time(want["time_us"], None)
    else:
        assert at == cancels.Time(want["read_us"], want["arrived_ms"])
    assert cancels.read_mark(headers_of(sample)) is None


@pytest.mark.parametrize("commit, sample", cases({"cancel-record": ("mark",)}))
def test_a_mark_reads_as_written(commit: str, sample: Json) -> None:
    assert cancels.read_mark(headers_of(sample)) == raw(sample["expected"]["mark"])
    assert cancels.read_record(headers_of(sample)) is None


@pytest.mark.parametrize("commit, sample", cases({"cancel-record": ("handle",)}))
def test_a_cancel_by_handle_still_cancels_its_message(commit: str, sample: Json) -> None:
    """A cancel of a handle (`pending cancel`) cancels exactly the message it named, in the
    gateway (Judge) and in `pending`'s listing (listing.cancelled_by), whichever checksum its
    handle was made with (the index's first layout: the routing key's alone)."""
    found = cancels.read_record(headers_of(sample))
    assert found is not None
    store = cancels.Store(86_400_000)
    assert store.add(found[0], found[1], NOW)
    named = entry_of(sample["expected"]["named_message"])
    assert Judge(store, Rules(86_400_000), Metrics(), {})(named, "distributor")
    # the same read time and routing key, another body: not named (but the first layout's checksum, the routing
    # key's alone, did not tell the two apart: why 4a05290 replaced it)
    other = named._replace(body=b"another")
    assert Judge(store, Rules(86_400_000), Metrics(), {})(other, "distributor") == (commit == OLD_INDEX)
    judge = listing.cancelled_by(store, Rules(86_400_000), NOW)
    assert judge is not None
    (today,) = index_records.entries(index_records.pack_entries([index_records.entry_record(named, named.due_ms)]))
    assert judge(today)


def stamped_pairs() -> List[Any]:
    """(cancel record, message) of every era pair: the cancel stamped 150 ms after the message."""
    records = [(d["written_by"]["commit"][:7], d["samples"]["stamped"]) for f, _, d in DOCUMENTS
               if f == "cancel-record" and "stamped" in d["samples"]]
    messages = [(d["written_by"]["commit"][:7], d["samples"]["message"]) for f, _, d in DOCUMENTS
                if f == "arrival-stamp" and d["written_by"]["commit"][:7] not in FIRST_FORMAT]
    out = []
    for rc, rec in records:
        for mc, msg in messages:
            # the known failure: a one-time record holding a stamp, against a message timed by
            # its read time (since f5c00af), not by its stamp (f602c79) or not at all (1013189)
            want = msg["expected"]
            stamp = envelope.broker_stamp(Properties.parse(raw(want["user_properties"])).headers, NOW)
            read_time = want["accepted_us"] is not None and stamp is not None and want["accepted_us"] != stamp * 1000
            stamp_as_time = rec["expected"].get("time_is") == "arrival stamp x 1000"
            marks = [xfail(STAMP_AS_TIME_WHY)] if stamp_as_time and read_time else []
            out.append(pytest.param(rec, msg, id=f"cancel-{rc}/message-{mc}", marks=marks))
    return out


@pytest.mark.parametrize("record_sample, message_sample", stamped_pairs())
def test_a_stamped_cancel_cancels_what_was_stamped_before_it(record_sample: Json, message_sample: Json) -> None:
    """The broker stamped the message 150 ms before the cancel: whichever versions recorded
    the cancel and read the message, the cancel wins (cancels.py: by the stamps when both have
    one)."""
    found = cancels.read_record(headers_of(record_sample))
    assert found is not None and found[0] == b"stamped-1"
    store = cancels.Store(86_400_000)
    store.add(found[0], found[1], NOW)
    (message,) = handlers.entries(delivery(message_sample["message"]))
    assert message.user.get("message_id") == b"stamped-1"
    stamp = envelope.broker_stamp(message.user.headers, NOW)
    taken_in = None if message.accepted_us is None else cancels.Time(message.accepted_us, stamp)
    held = store.get(found[0])
    assert held is not None and held.cancels(taken_in)


# -- the index of what waits ----------------------------------------------------------------------------------
def listed(m: index_records.Listed) -> Json:
    return {"read_us": m.read_us, "crc": m.crc, "due_ms": m.due_ms, "until_ms": m.until_ms, "size": m.size,
            "retry_attempt": m.retry_attempt, "retry": m.retry,
            "message_id": None if m.message_id is None else m.message_id.hex(), "routing_key": m.routing_key.hex(),
            "props": m.props.hex()}


def era_checksum(commit: str, e: Entry) -> int:
    """The checksum an entry of this era names its message by (its version's, as today reads it)."""
    return index_records.first_checksum(e.routing_key) if commit == OLD_INDEX else index_records.checksum(e)


@pytest.mark.parametrize("commit, sample", cases({"waiting": ("entries", "entries-carried")}))
def test_index_entries_read_as_written(commit: str, sample: Json) -> None:
    """index_records.entries yields each entry of a record: read time, checksum (the one its version
    wrote, or for the first layout the one its version computed: the routing key's CRC-32),
    due, until, size, retry attempt, id, routing key, properties."""
    for r in sample["records"]:
        body = raw(r["body"])
        got = [listed(m) for m in index_records.entries(body)]
        assert [{k: g[k] for k in want} for g, want in zip(got, r["expected"], strict=False)] == r["expected"]
        assert len(got) == len(r["expected"])
        assert index_records.first_layout(body) == (commit == OLD_INDEX)
    by_key = {(m["accepted_us"], m["routing_key"]): entry_of(m) for m in sample["messages"]}
    for r in sample["records"]:
        for m in index_records.entries(raw(r["body"])):
            assert m.crc == era_checksum(commit, by_key[m.read_us, m.routing_key.hex()])


@pytest.mark.parametrize("commit, sample", cases({"waiting": ("done",)}))
def test_done_records_read_as_written(commit: str, sample: Json) -> None:
    assert index_records.done_keys(raw(sample["body"])) == sample["expected"]["keys"]


@pytest.mark.parametrize("commit, sample", cases({"waiting": ("done",)}))
def test_done_keys_name_their_messages(commit: str, sample: Json) -> None:
    """A done key is the key today's index gives the message it names (so `pending` stops
    listing it): for an entry of the index's first layout, with that layout's checksum."""
    keys = index_records.done_keys(raw(sample["body"]))
    assert keys == [index_records.key_of(e.accepted_us, era_checksum(commit, e))
                    for e in map(entry_of, sample["messages"])]


@pytest.mark.parametrize("commit, sample", cases({"waiting": ("lapped",)}))
def test_a_lapped_record_is_passed_over(commit: str, sample: Json) -> None:
    """Lapped keys (DGL1, written by 133e07a..c86a2a1) said a lap's entry was over. Since
    e34319f a lap ends when the reader meets its next entry (listing.View: laps in transit),
    and readers pass over them: no done keys, beat or entries. The keys are those of the
    entries written with them, as that version read them."""
    body, entry = raw(sample["body"]), raw(sample["entry"])
    assert index_records.done_keys(body) == [] and index_records.beat(body) is None
    assert list(index_records.entries(body)) == []
    count = int.from_bytes(body[4:8], "big")
    assert body[:4] == b"DGL1" and len(body) == 8 + count * index_records.KEY.size
    key = index_records.KEY
    keys = [index_records.key_of(*key.unpack_from(body, 8 + i * key.size)) for i in range(count)]
    assert keys == sample["expected"]["keys"] == [m.key for m in index_records.entries(entry)] == [
        index_records.key_of(e.accepted_us, index_records.checksum(e)) for e in map(entry_of, sample["messages"])]
    assert [listed(m) for m in index_records.entries(entry)] == sample["expected"]["entry"]
    v = listing.View(NOW, horizon.Horizon(NOW - 60_000, True, ""), None, Selection(), keep=0)
    v.add_keys(body)
    assert v.keys == 0


def index_of(commit: str) -> Json:
    """The waiting samples of one era, by variant."""
    (doc,) = [d for f, _, d in DOCUMENTS if f == "waiting" and d["written_by"]["commit"].startswith(commit)]
    found: Json = doc["samples"]
    return found


@pytest.mark.parametrize("commit", [d["written_by"]["commit"][:7] for f, _, d in DOCUMENTS if f == "waiting"])
def test_a_listing_reads_an_eras_index(commit: str) -> None:
    """listing.View fed an era's records as a reader feeds them (the done stream's first: done
    keys, lapped keys, beats, a reader's mark; then the bands', the highest first) lists every
    message of the entries but those a done key names."""
    index = index_of(commit)
    records = [r for v in ("entries", "entries-carried") for r in index[v]["records"]]
    if "lapped" in index:
        records.append({"band": "04", "body": index["lapped"]["entry"]})  # (the entry written with the lapped key)
    entries = [raw(r["body"]) for r in sorted(records, key=lambda r: r["band"], reverse=True)]
    keys = [raw(index[v]["body"]) for v in ("done", "lapped", "beat", "beat-unindexed", "mark") if v in index]
    done = set(index_records.done_keys(raw(index["done"]["body"])))
    every = [m for body in entries for m in index_records.entries(body)]
    assert len(every) == sum(len(r["expected"]) for v in ("entries", "entries-carried") for r in index[v]["records"]) \
        + (1 if "lapped" in index else 0)
    assert done & {m.key for m in every}  # (the message "chain" is done: its entries go)
    v = listing.View(NOW, horizon.Horizon(NOW - 60_000, True, ""), None, Selection(), keep=0)
    for body in keys:
        v.add_keys(body)
    for body in entries:
        v.add_entries(body)
    v.finish()
    assert sorted(m.key for m in v.listed()) == sorted(m.key for m in every if m.key not in done)
    assert v.read == len(every) and v.keys == len(index_records.done_keys(raw(index["done"]["body"])))


@pytest.mark.parametrize("commit", [d["written_by"]["commit"][:7] for f, _, d in DOCUMENTS if f == "waiting"])
def test_a_listing_judges_an_eras_entries_by_their_handles(commit: str) -> None:
    """A cancel of the handle `pending` listed a message by (its era's) leaves it out of the
    listing, and only it."""
    index = index_of(commit)
    every = [m for v in ("entries", "entries-carried") for r in index[v]["records"] for m in index_records.entries(
        raw(r["body"]))]
    assert len(every) == 6
    for m in every:
        store = cancels.Store(86_400_000)
        store.add(m.handle.encode("ascii"), cancels.Time(NOW * 1000 + 5, None), NOW)
        judge = listing.cancelled_by(store, Rules(86_400_000), NOW)
        assert judge is not None and {o.key for o in every if judge(o)} == {m.key}


@pytest.mark.parametrize("commit, sample", cases({"waiting": ("beat", "beat-unindexed")}))
def test_beats_read_as_written(commit: str, sample: Json) -> None:
    """A beat's gateway, roles, earliest due time and time; its consumers and flags (DGB2), and
    what it saw of the queues (DGB3), or
    for a DGB1 beat (before 1.0) one consumer of each kind its roles consume, and entries
    written."""
    want = sample["expected"]
    beat = index_records.beat(raw(sample["body"]))
    assert beat is not None
    assert (beat.gateway, beat.roles, beat.low_ms, beat.at_ms) == (raw(want["gateway"]), want["roles"],
                                                                    want["low_ms"], want["at_ms"])
    if "consumers" in want:
        assert (beat.consumers, beat.flags) == (index_records.Consumers(**want["consumers"]), want["flags"])
        # DGB3: what the gateway saw of the queues (None: it could not look, or an earlier layout)
        seen = want.get("seen")
        assert beat.seen == (None if seen is None else index_records.Seen(
            **{k: index_records.Place(**v) for k, v in seen.items()}))
    else:
        one = 1 if want["roles"] & index_records.ROLE_CHECK_IN else 0
        distributors = 1 if want["roles"] & index_records.ROLE_DISTRIBUTOR else 0
        assert beat.consumers == index_records.Consumers(one, one, distributors)
        assert beat.indexes


@pytest.mark.parametrize("commit, sample", cases({"waiting": ("mark",)}))
def test_a_readers_mark_is_no_record(commit: str, sample: Json) -> None:
    body = raw(sample["body"])
    assert list(index_records.entries(body)) == [] and index_records.done_keys(body) == []
    assert index_records.beat(body) is None


# -- the chains registry, the pick-up stamp ------------------------------------------------------------------
@pytest.mark.parametrize("commit, sample", cases({"registry": None}))
def test_registry_records_read_as_written(commit: str, sample: Json) -> None:
    """Each record's event, time, chain and queues; an `unlisted` one's until_ms and why, which
    `pending` shows while they last (registry.fold, horizon.gaps)."""
    for r in sample["records"]:
        want = r["expected"]
        chain = None if want["chain"] is None else registry.ChainKey(**want["chain"])
        assert registry.decode(raw(r["body"])) == registry.Record(
            want["event"], want["at_ms"], chain, want["queues"], want.get("until_ms"), want.get("why", ""))
    folded = registry.fold(registry.decode(raw(r["body"])) for r in sample["records"])
    unlisted = [r["expected"] for r in sample["records"] if r["expected"]["event"] == "unlisted"]
    assert [(u.until_ms, u.why) for u in folded.unlisted] == [(u["until_ms"], u["why"]) for u in unlisted]
    gaps = horizon.gaps(NOW, [], index_records.Place(0, 0), [horizon.Gap(u.why, u.until_ms) for u in folded.unlisted])
    assert [g.why for g in gaps] == [u["why"] for u in unlisted if u["until_ms"] > NOW]


# -- group cancels (rules) ----------------------------------------------------------------------------------
def selection_of(want: Json) -> Selection:
    return Selection(tuple(raw(i) for i in want["ids"]), want["key"], want["due_after_ms"], want["due_before_ms"],
                     tuple((n, v) for n, v in want["headers"]), want["retries"])


def request_of(want: Json) -> Any:
    if "withdraw" in want:
        return rules.Withdrawing(raw(want["withdraw"]))
    return rules.Request(selection_of(want["select"]), want["everything"], None if want["name"] is None
                         else raw(want["name"]))


RULE_RECORDS = ("key", "ids", "due-range", "headers", "retries", "all", "withdrawal")


@pytest.mark.parametrize("commit, sample", cases({"cancel-rule": RULE_RECORDS}))
def test_a_rule_record_reads_as_written(commit: str, sample: Json) -> None:
    """rules.read_record yields the rule (its name, filter and times) or the withdrawal; a rule
    record is no cancel by id, tally or mark."""
    want, headers, body = sample["expected"], headers_of(sample), raw(sample["message"]["body"])
    found = rules.read_record(headers, body)
    at = cancels.Time(want["read_us"], want["arrived_ms"])
    if want["kind"] == "withdrawal":
        assert found == rules.Withdrawal(raw(want["name"]), at)
    else:
        assert found == rules.Rule(raw(want["name"]), selection_of(want["select"]), at, want["everything"])
    assert (cancels.read_record(headers), cancels.read_mark(headers), rules.read_tally(headers)) == (None, None, None)
    # (a rule keeps its x-cancel-* filter, normalised: in its headers until 2026-11-28, then in its body, which
    # RabbitMQ 3.10's streams keep whole)
    assert rules.is_rule(headers) == (want["kind"] == "rule" and not body)
    assert body.startswith(rules.FILTER_MAGIC) == (want["kind"] == "rule" and not commit.startswith("8bc5274"))


@pytest.mark.parametrize("commit, sample", cases({"cancel-rule": RULE_RECORDS + ("published",)}))
def test_a_clients_rule_waiting_in_check_in_reads_as_published(commit: str, sample: Json) -> None:
    """A client's rule (or withdrawal) as it waits in check-in, published before an upgrade:
    rules.requested reads what its version read, and check-in records it."""
    published = sample["inputs"]["published"] if "requested" in sample["expected"] else sample["message"]
    want = sample["expected"].get("requested", sample["expected"])
    props = Properties.parse(raw(published["properties"]))
    assert rules.is_rule(props.headers) and rules.requested(props.headers) == request_of(want)
    check_in = handlers.CheckIn(CHAIN, LEAD_MS)
    (recorded,) = check_in(Delivery(NAMES.rules, raw(published["routing_key"]), props, raw(published["body"])), NOW)
    assert isinstance(recorded, Forward) and recorded.exchange == NAMES.cancellations
    assert rules.read_record(recorded.props.headers, recorded.body) is not None
    if published["exchange"] == "delay.cancel":
        # Until 2026-11-28 rules were published to <prefix>.cancel, the cancels by id's: that one right
        # gave both. One still waiting there is parked, marked as a cancel (replayed, it goes back there
        # and is parked again): to apply it, publish it again to <prefix>.rules.
        (parked,) = check_in(Delivery(NAMES.cancel, raw(published["routing_key"]), props, raw(published["body"])),
                             NOW)
        assert isinstance(parked, Forward) and parked.way is Way.PARKED
        assert f"goes to {NAMES.rules!r}" in (parked.reason or "")
        assert envelope.Inside(parked.props).exchange == NAMES.cancel


@pytest.mark.parametrize("commit, sample", cases({"cancel-rule": ("tally",)}))
def test_a_tally_reads_as_written(commit: str, sample: Json) -> None:
    want, headers = sample["expected"], headers_of(sample)
    assert rules.read_tally(headers) == (raw(want["name"]), raw(want["gateway"]), want["removed"])
    assert (rules.read_record(headers), cancels.read_record(headers)) == (None, None)
    assert rules.tallies([rules.read_tally(headers)] * 2) == {raw(want["name"]): want["removed"]}


@pytest.mark.parametrize("commit, sample", cases({"cancel-rule": ("ids",)}))
def test_a_rule_by_handle_cancels_the_message_it_names(commit: str, sample: Json) -> None:
    """The rule names, among ids, the handle of the message "distributor" (no message id) as
    the index lists it: held, it cancels that message in the gateway and in the listing."""
    found = rules.read_record(headers_of(sample), raw(sample["message"]["body"]))
    assert isinstance(found, rules.Rule)
    held = Rules(86_400_000)
    assert held.add(found, NOW)
    (named,) = [d["samples"]["handle"]["expected"]["named_message"] for f, _, d in DOCUMENTS
                if f == "cancel-record" and d["written_by"]["commit"].startswith("4a05290")]
    message = entry_of(named)
    assert Judge(cancels.Store(86_400_000), held, Metrics(), {})(message, "distributor")
    record = index_records.entry_record(message, message.due_ms)
    (listed_as,) = index_records.entries(index_records.pack_entries([record]))
    judge = listing.cancelled_by(cancels.Store(86_400_000), held, NOW)
    assert judge is not None and judge(listed_as)


@pytest.mark.parametrize("commit, sample", cases({"pick-up-stamp": None}))
def test_the_pick_up_stamp_reads_as_written(commit: str, sample: Json) -> None:
    """`delay-gateway record` takes the due time from x-gateway-due-at of what pick-up delivers
    (pika decodes the properties, as for any consumer)."""
    props = spec.BasicProperties()
    props.decode(raw(sample["message"]["properties"]))
    method = SimpleNamespace(routing_key=raw(sample["message"]["routing_key"]).decode(), redelivered=False)
    line = record.line(method, props, NOW)
    assert (line["due_at"], line["due_source"]) == (sample["expected"]["due_ms"], "stamp")


# -- schedule's resume record (on the driver's disk) --------------------------------------------------------------
@pytest.mark.parametrize("commit, sample", cases({"schedule-state": None}))
def test_a_schedule_resume_record_is_resumed(commit: str, sample: Json, tmp_path: Path) -> None:
    """`delay-gateway schedule` run again, with the same command, table and brokers, after a
    run of this era was killed half way: today's Progress reads the run's fingerprint, start
    instant and partitions, and the partitions it finished; and today's fingerprint of the same
    run is the record's, so the run resumes (publishes only the other partitions, checks rows
    against the same start) instead of refusing the record as another run's."""
    state = tmp_path / "state"
    for written in sample["records"]:
        (state / written["path"]).parent.mkdir(parents=True, exist_ok=True)
        (state / written["path"]).write_bytes(raw(written["body"]))
    previous, want = progress.Progress(str(state)).run(), sample["expected"]
    assert previous is not None  # what schedule_job.Job.run reads of it
    assert (previous["fingerprint"], previous["started_at_ms"], previous.get("partitions")) == (
        want["fingerprint"], want["started_at_ms"], want["partitions"])
    assert sorted(progress.Progress(str(state)).done().items()) == [tuple(d) for d in want["done"]]
    assert schedule_fingerprint(sample["inputs"])[0] == previous["fingerprint"]


# -- the samples themselves ---------------------------------------------------------------------------------------
# The eras recovered from the history (the first commit of each): a sample deleted fails here.
ERAS = {
    "arrival-stamp": {"0a9c351", "1013189", "f602c79", "f5c00af"},
    "cancel-record": {"f602c79", "f5c00af", "345936a", "4a05290"},
    "cancel-rule": {"8bc5274", "b938cba"},
    "carrier": {"d876567", "f602c79"},
    "envelope": {"0a9c351", "1013189", "f602c79"},
    "meditation": {"0a9c351", "1013189", "d876567", "f602c79"},
    "moved": {"3d8ec38", "b0f94ec", "b7a9ad3"},
    "parked": {"0a9c351", "a11db56", "1013189", "f602c79", "ae852a0", "7438e7c"},
    "pick-up-stamp": {"1013189"},
    "registry": {"1f5570f", "133e07a"},
    "retry": {"ae852a0", "7fb1d2d"},
    "schedule-state": {"4ac3d51"},
    "waiting": {"345936a", "4a05290", "133e07a", "e34319f", "7fb1d2d", "f381cff"},
}


def test_no_sample_is_lost() -> None:
    found: Dict[str, set] = {}
    for fmt, path, doc in DOCUMENTS:
        commit = doc["written_by"]["commit"]
        assert path.name.endswith(f"-{commit[:7]}.json") and doc["format"] == fmt == path.parent.name
        found.setdefault(fmt, set()).add(commit[:7])
    assert set(SAMPLES.iterdir()) == {SAMPLES / fmt for fmt in FORMATS}
    for fmt, eras in ERAS.items():
        assert eras <= found.get(fmt, set()), f"a sample of {fmt} is gone: never delete one"


def test_today_writes_the_newest_samples() -> None:
    """What this tree writes is its format's newest sample, byte for byte. If not, a format
    changed: keep every sample, add one of the new format (`.venv/bin/python -m
    tests.formats.generate --write`, tests/formats/README.md), and make sure the tests above
    still read the old ones."""
    now = samples()
    assert {fmt: changed(fmt, variants) for fmt, variants in now.items()} == {fmt: [] for fmt in now}
