"""The golden samples of what this version writes where messages wait, from fixed inputs.

`samples()` runs this tree's own writers (the handlers, carriers, cancel records, the index of
what waits, the chains registry, move-from-plugin, the pick-up stamp, schedule's resume
record) on the publishers' messages below and returns, per format and variant, the bytes written and what this tree's
code reads back from them (checked against what the writer held). tests/test_formats.py
compares them with the newest sample of each format; when a format changes on purpose,

    .venv/bin/python -m tests.formats.generate --write

adds a sample of the new format for each format whose bytes changed, named by the commit
that is checked out (commit the change first). It never changes or deletes a sample: every
era stays, and the test reads each one with today's code (tests/formats/README.md).

The samples of earlier eras were made the same way by each earlier commit's own code, from
these inputs.
"""

import argparse
import dataclasses
import json
import random
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional, Tuple

from pika import spec

from gateway.core import cancels, carrier, envelope, handlers, index_records, retries, rules
from gateway.core.actions import Enqueue, Forward
from gateway.core.carrier import Entry
from gateway.core.inputs import Delivery
from gateway.core.routes import Way
from gateway.core.wire import Properties
from topology import ChainSettings
from topology import registry
from topology.index_bands import bands

SAMPLES = Path(__file__).parent / "samples"
NOW = 1_795_310_000_000  # 2026-11-22T01:13:20Z, the clock every handler is given
LEAD_MS = 50
DAY_MS = 86_400_000
STAMP = NOW - 250
CHAIN = ChainSettings(prefix="delay", max_level=20, resolution_ms=1000)
NAMES = CHAIN.names
Json = Dict[str, Any]


def hx(b: Optional[bytes]) -> Optional[str]:
    return None if b is None else bytes(b).hex()


def props_raw(**kw: Any) -> bytes:
    """A publisher's properties as pika puts them on the wire."""
    return b"".join(spec.BasicProperties(**kw).encode())


# -- the publishers' messages (exchange, routing key, body, properties as wire bytes) -----------------
# The handle `pending` lists the message "distributor" below by (it has no message id), as check-in
# reads it first at NOW: cancels.handle of its read time and checksum (cancel_record_samples checks it).
HANDLE = cancels.handle(NOW * 1000, cancels.checksum(b"tick", props_raw(headers={"x-delay": 300}), b""))
DEATH = {"count": 1, "reason": "rejected", "queue": "orders",
         "time": datetime(2026, 11, 21, 22, 33, 19, tzinfo=timezone.utc), "exchange": "", "routing-keys": ["orders"]}
FIRST = {"x-first-death-exchange": "", "x-first-death-queue": "orders", "x-first-death-reason": "rejected"}
PUBLISHED: Dict[str, Tuple[str, bytes, bytes, bytes]] = {
    "chain": ("delay.check-in", b"reminder.review", b'{"order": 42}', props_raw(
        content_type="application/json", headers={"x-delay": 90_000, "tenant": "acme"}, delivery_mode=2, priority=3,
        correlation_id="corr-1", expiration="86400000", message_id="order-42-review", timestamp=1_795_310_000,
        app_id="shop")),
    "chain-second": ("delay.check-in", "reminder.caf\u00e9".encode(), b'{"order": 43}', props_raw(
        content_type="application/json", headers={"x-delay": 90_000}, delivery_mode=2, message_id="order-43-review")),
    "meditation": ("delay.check-in", b"invoice.due", b"pay up", props_raw(
        content_type="text/plain", headers={"x-delay": 30 * DAY_MS}, delivery_mode=2, message_id="invoice-7")),
    "distributor": ("delay.check-in", b"tick", b"", props_raw(headers={"x-delay": 300})),
    "stamped": ("delay.check-in", b"reminder.stamped", b"stamped body", props_raw(
        headers={"x-delay": 90_000, "timestamp_in_ms": STAMP}, delivery_mode=2, message_id="stamped-1")),
    "unreadable": ("delay.check-in", b"reminder.bad", b"bad delay", props_raw(
        headers={"x-delay": "soon"}, delivery_mode=2, message_id="bad-1")),
    "cancel": ("delay.cancel", b"", b"", props_raw(delivery_mode=2, message_id="order-42-review")),
    "cancel-stamped": ("delay.cancel", b"", b"", props_raw(
        headers={"timestamp_in_ms": NOW - 100}, delivery_mode=2, message_id="stamped-1")),
    "cancel-no-id": ("delay.cancel", b"", b"", props_raw(delivery_mode=2)),
    # group cancels (rules): the public vocabulary of rules.py, as a client publishes it
    "rule-key": ("delay.rules", b"", b"", props_raw(headers={"x-cancel-key": "reminder.#"}, delivery_mode=2)),
    "rule-ids": ("delay.rules", b"", b"", props_raw(headers={
        "x-cancel-id": ["order-42-review", "invoice-*", HANDLE], "x-cancel-rule": "by-ids"}, delivery_mode=2)),
    "rule-due": ("delay.rules", b"", b"", props_raw(headers={
        "x-cancel-due-after": NOW + 60_000, "x-cancel-due-before": str(NOW + 100_000),
        "timestamp_in_ms": NOW - 100}, delivery_mode=2)),
    "rule-headers": ("delay.rules", b"", b"", props_raw(headers={
        "x-cancel-header": {"tenant": "acme", "priority": 3}, "x-cancel-key": "reminder.*",
        "x-cancel-rule": "acme-reminders"}, delivery_mode=2)),
    "rule-retries": ("delay.rules", b"", b"", props_raw(headers={"x-cancel-retries": True, "x-cancel-key": "orders"},
                                                          delivery_mode=2)),
    "rule-all": ("delay.rules", b"", b"", props_raw(headers={"x-cancel-all": True, "x-cancel-rule": "everything"},
                                                      delivery_mode=2)),
    "rule-withdraw": ("delay.rules", b"", b"", props_raw(headers={"x-cancel-withdraw": "by-ids"}, delivery_mode=2)),
    "rule-client": ("delay.rules", b"", b"", props_raw(headers={
        "x-cancel-key": "reminder.*", "x-cancel-id": "order-4*", "x-cancel-due-after": "1795310060000",
        "x-cancel-due-before": datetime(2026, 11, 22, 1, 15, tzinfo=timezone.utc),
        "x-cancel-header": {"tenant": b"acme"}, "x-cancel-retries": "false", "x-cancel-rule": "client-rule",
        "tenant": "acme"}, content_type="text/plain", delivery_mode=2, message_id="ignored-for-a-rule")),
    "retry": ("delay.retry", b"orders", b"job 7", props_raw(
        content_type="application/json", headers={"x-death": [DEATH], **FIRST, "x-retry-attempt": 2},
        delivery_mode=2, message_id="job-7")),
    "retry-second": ("delay.retry", b"orders", b"job 8", props_raw(
        headers={"x-death": [DEATH], **FIRST, "x-retry-attempt": 2}, delivery_mode=2, message_id="job-8")),
    "retry-gave-up": ("delay.retry", b"orders", b"job 9", props_raw(
        headers={"x-death": [DEATH], **FIRST, "x-retry-attempt": 10, "x-retry-reason": "timeout"},
        delivery_mode=2, message_id="job-9")),
}


def published(name: str) -> Json:
    ex, rk, body, raw = PUBLISHED[name]
    return {"body": hx(body), "exchange": ex, "properties": hx(raw), "routing_key": hx(rk)}


def delivery(name: str) -> Delivery:
    ex, rk, body, raw = PUBLISHED[name]
    exchange = {"delay.check-in": NAMES.check_in, "delay.cancel": NAMES.cancel, "delay.rules": NAMES.rules,
                "delay.retry": NAMES.retry}[ex]
    return Delivery(exchange, rk, Properties.parse(raw), body)


def check_in() -> handlers.CheckIn:
    return handlers.CheckIn(CHAIN, LEAD_MS)


def retry() -> handlers.Retry:
    return handlers.Retry(CHAIN, LEAD_MS, (retries.Policy(),), random.Random(7))


def only(actions: List[Any]) -> Any:
    assert len(actions) == 1, actions
    return actions[0]


def enqueued(handler: Callable[[Delivery, int], List[Any]], name: str) -> Enqueue:
    action = only(handler(delivery(name), NOW))
    assert isinstance(action, Enqueue), action
    return action


# -- the bytes of a publish, and what they say ------------------------------------------------------------
def wire_of(f: Forward) -> Json:
    return {"body": hx(f.body), "exchange": f.exchange, "properties": hx(f.props.raw), "routing_key": hx(f.routing_key)}


def entry_json(e: Entry) -> Json:
    return {"accepted_us": e.accepted_us, "body": hx(e.body), "due_ms": e.due_ms, "exchange": e.exchange,
            "routing_key": hx(e.routing_key), "user_properties": hx(e.user.raw)}


def read_single(msg: Json) -> Json:
    inside = envelope.Inside(Properties.parse(bytes.fromhex(msg["properties"])))
    return {"due_ms": inside.due_ms, "routing_key": hx(inside.routing_key),
            "user_properties": hx(inside.user.raw) if inside.user is not None else None, "body": msg["body"],
            "accepted_us": inside.accepted_us, "exchange": inside.exchange, "error": inside.error}


def read_carrier(msg: Json) -> Json:
    props = Properties.parse(bytes.fromhex(msg["properties"]))
    got = carrier.unpack(bytes.fromhex(msg["body"]), carrier.accepted_times(props), envelope.destination(props.headers))
    return {"count": props.headers.get(carrier.COUNT), "due_ms": props.headers.get(envelope.DUE_AT),
            "messages": [entry_json(e) for e in got]}


def single(f: Forward, written: Optional[Entry], produced_by: str, inputs: Json) -> Json:
    msg = wire_of(f)
    expected = read_single(msg)
    if written is not None:
        for k, v in entry_json(written).items():
            assert expected[k] == v, (produced_by, k, expected[k], v)
    return {"produced_by": produced_by, "inputs": inputs, "message": msg, "expected": expected,
            "route": f.way.value}


def carried(f: Forward, written: List[Entry], produced_by: str, inputs: Json) -> Json:
    msg = wire_of(f)
    expected = read_carrier(msg)
    assert expected["messages"] == [entry_json(e) for e in written], produced_by
    return {"produced_by": produced_by, "inputs": inputs, "message": msg, "expected": expected,
            "route": f.way.value}


def inputs_of(*names: str, **more: Any) -> Json:
    found = [published(n) for n in names]
    return {"published": found[0] if len(found) == 1 else found, "now_ms": NOW, **more}


# -- each format ---------------------------------------------------------------------------------------------
def alone(name: str, produced_by: str) -> Json:
    e = enqueued(check_in(), name)
    f = handlers.carry(e.exchange, e.routing_key, e.way, [e.entry])
    return single(f, e.entry, produced_by, inputs_of(name, lead_ms=LEAD_MS))


def envelope_samples() -> Json:
    return {"chain": alone("chain", "handlers.CheckIn -> a level of the chain (one message alone)"),
            "distributor": alone("distributor", "handlers.CheckIn -> the distributor (due within a unit)")}


def meditation_samples() -> Json:
    h = check_in()
    a, b = enqueued(h, "meditation"), enqueued(h, "chain")
    second = b.entry._replace(due_ms=NOW + 40 * DAY_MS)
    f = handlers.carry(a.exchange, a.routing_key, a.way, [a.entry, second])
    return {"alone": alone("meditation", "handlers.CheckIn -> meditation (x-delay 30 days)"),
            "carrier": carried(f, [a.entry, second], "handlers.CheckIn x2 -> handlers.carry to meditation",
                               inputs_of("meditation", "chain", lead_ms=LEAD_MS,
                                         note="the second message's due time set to now + 40 days"))}


def carrier_samples() -> Json:
    h = check_in()
    a, b = enqueued(h, "chain"), enqueued(h, "chain-second")
    two = handlers.carry(a.exchange, a.routing_key, a.way, [a.entry, b.entry])
    h = check_in()
    a, b = enqueued(h, "chain"), enqueued(h, "chain-second")
    old = b.entry._replace(accepted_us=None)  # one from before read times, re-batched by returning
    mixed = handlers.carry(a.exchange, a.routing_key, a.way, [a.entry, old])
    return {"mixed-times": carried(mixed, [a.entry, old],
                                   "handlers.carry of one entry with a read time and one without",
                                   inputs_of("chain", "chain-second", lead_ms=LEAD_MS,
                                             note="the second entry's accepted_us set to None")),
            "two": carried(two, [a.entry, b.entry], "handlers.CheckIn x2 -> handlers.carry (a carrier of two)",
                           inputs_of("chain", "chain-second", lead_ms=LEAD_MS))}


def arrival_stamp_samples() -> Json:
    return {"message": alone("stamped", "handlers.CheckIn of a stamped message (x-delay counts from the stamp)")}


def parked_samples() -> Json:
    out: Json = {}
    f = only(check_in()(delivery("unreadable"), NOW))
    out["unreadable-delay"] = single(f, None, "handlers.CheckIn parks a message whose x-delay cannot be read",
                                     inputs_of("unreadable"))
    e = enqueued(check_in(), "chain").entry
    f = handlers.Distributor(CHAIN, LEAD_MS).unroutable(e)
    out["unroutable-at-pick-up"] = single(
        f, e, "the distributor (or parking) parks a due message no queue is bound for",
        inputs_of("chain", note="unroutable at pick-up"))
    f = only(check_in()(delivery("cancel-no-id"), NOW))
    out["cancel-without-id"] = single(f, None, "handlers.CheckIn parks a cancel with no message_id",
                                      inputs_of("cancel-no-id"))
    f = only(retry()(delivery("retry-gave-up"), NOW))
    out["retry-gave-up"] = single(f, f.entry, "handlers.Retry parks a message after its last attempt",
                                  inputs_of("retry-gave-up"))
    for name, sample in out.items():
        assert sample["expected"]["error"], name
    return out


def retry_samples() -> Json:
    e = enqueued(retry(), "retry")
    f = handlers.carry(e.exchange, e.routing_key, e.way, [e.entry])
    more = {"lead_ms": LEAD_MS, "policy": "retries.Policy() defaults", "rng": "random.Random(7)"}
    h = retry()
    a, b = enqueued(h, "retry"), enqueued(h, "retry-second")
    assert (a.exchange, a.routing_key) == (b.exchange, b.routing_key)
    two = handlers.carry(a.exchange, a.routing_key, a.way, [a.entry, b.entry])
    return {"alone": single(f, e.entry, "handlers.Retry -> the chain (a retry alone)", inputs_of("retry", **more)),
            "carrier": carried(two, [a.entry, b.entry], "handlers.Retry x2 -> handlers.carry (retries to one queue)",
                               inputs_of("retry", "retry-second", lead_ms=LEAD_MS))}


def record_expected(f: Forward) -> Json:
    found = cancels.read_record(f.props.headers)
    assert found is not None
    return {"id": hx(found[0]), "read_us": found[1].read_us, "arrived_ms": found[1].arrived_ms}


def cancel_record_samples() -> Json:
    out: Json = {}
    for variant, name, about in (("record", "cancel", "handlers.CheckIn records a cancel (no arrival stamp)"),
                                 ("stamped", "cancel-stamped", "handlers.CheckIn records a cancel the broker stamped")):
        f = only(check_in()(delivery(name), NOW))
        out[variant] = {"produced_by": about, "inputs": inputs_of(name), "message": wire_of(f),
                        "expected": record_expected(f), "route": f.way.value}
    token = b"0123456789abcdef0123456789abcdef"
    mark = cancels.mark(token)
    out["mark"] = {"produced_by": "cancels.mark (a gateway's mark to find the stream's end)",
                   "inputs": {"token": hx(token)},
                   "message": {"exchange": "", "routing_key": "", "properties": hx(mark.raw), "body": ""},
                   "expected": {"mark": hx(cancels.read_mark(mark.headers))}}
    # a cancel by handle, as `pending cancel` publishes it for a message without an id
    named = enqueued(check_in(), "distributor").entry
    rec = index_records.Recorder(16, CHAIN.meditation_ms)
    rec.waits(False, [(1, named)], NOW)
    ((_, _, record),) = rec.take_entries()
    (listed,) = list(index_records.entries(record))
    handle = listed.handle.encode()
    assert listed.handle == HANDLE
    d = delivery("cancel")._replace(props=Properties.build(delivery_mode=2, message_id=handle))
    f = only(check_in()(d, NOW))
    out["handle"] = {
        "produced_by": "pending cancel's handle of a message, recorded by handlers.CheckIn",
        "inputs": inputs_of("distributor", note="the handle of the message 'distributor' (no message id) as that "
                            "version's index lists it, published as a cancel's message_id and recorded by check-in"),
        "message": wire_of(f), "expected": {**record_expected(f), "handle": handle.decode(),
                                            "named_message": entry_json(named)},
        "route": f.way.value}
    return out


def selection_json(select: Any) -> Json:
    return {"ids": [hx(i) for i in select.ids], "key": select.key, "due_after_ms": select.due_after_ms,
            "due_before_ms": select.due_before_ms, "headers": [list(h) for h in select.headers],
            "retries": select.retries}


def request_json(asked: Any) -> Json:
    """What rules.requested reads from a rule's public message."""
    if isinstance(asked, rules.Withdrawing):
        return {"withdraw": hx(asked.name)}
    return {"select": selection_json(asked.select), "everything": asked.everything,
            "name": hx(asked.name)}


def rule_record_json(headers: Any, body: bytes) -> Json:
    """What a record of the cancellations stream holds, as rules.read_record / read_tally read it."""
    found = rules.read_record(headers, body)
    if isinstance(found, rules.Rule):
        return {"kind": "rule", "name": hx(found.name), "select": selection_json(found.select),
                "everything": found.everything, "read_us": found.at.read_us, "arrived_ms": found.at.arrived_ms}
    if isinstance(found, rules.Withdrawal):
        return {"kind": "withdrawal", "name": hx(found.name), "read_us": found.at.read_us,
                "arrived_ms": found.at.arrived_ms}
    tally = rules.read_tally(headers)
    assert tally is not None
    return {"kind": "tally", "name": hx(tally[0]), "gateway": hx(tally[1]), "removed": tally[2]}


def cancel_rule_samples() -> Json:
    out: Json = {}
    for variant, name, about in (
            ("key", "rule-key", "handlers.CheckIn records a rule by key pattern (no name: one from its filter)"),
            ("ids", "rule-ids", "handlers.CheckIn records a rule by ids: an id, a prefix and a handle"),
            ("due-range", "rule-due", "handlers.CheckIn records a rule by due range, the broker's stamp on it"),
            ("headers", "rule-headers", "handlers.CheckIn records a rule by header values and a key"),
            ("retries", "rule-retries", "handlers.CheckIn records a rule on retries only"),
            ("all", "rule-all", "handlers.CheckIn records a rule on every message (x-cancel-all)"),
            ("withdrawal", "rule-withdraw", "handlers.CheckIn records the withdrawal of a rule")):
        f = only(check_in()(delivery(name), NOW))
        assert isinstance(f, Forward) and f.way is Way.CANCEL, (name, f)
        asked = rules.requested(Properties.parse(PUBLISHED[name][3]).headers)
        out[variant] = {"produced_by": about, "inputs": inputs_of(name), "message": wire_of(f),
                        "expected": {**rule_record_json(f.props.headers, f.body), "requested": request_json(asked)},
                        "route": f.way.value}
    gw = bytes(range(16))
    tally = rules.tally_record(b"by-ids", gw, 3)
    out["tally"] = {"produced_by": "rules.tally_record (broker/run/cancelling.Follower: what a gateway removed by a "
                                   "rule)",
                    "inputs": {"rule": hx(b"by-ids"), "gateway": hx(gw), "removed": 3},
                    "message": {"exchange": NAMES.cancellations, "routing_key": "", "properties": hx(tally.raw),
                                "body": ""},
                    "expected": rule_record_json(tally.headers, b"")}
    ex, rk, body, raw = PUBLISHED["rule-client"]
    out["published"] = {
        "produced_by": "a client's rule as it waits in check-in (pika 1.4.4, the vocabulary of rules.py): every "
                       "filter, in the types a client may send (text digits, an AMQP timestamp, a binary header "
                       "value, 'false'), a header of its own and a message_id (ignored: it is a rule)",
        "inputs": {"published": published("rule-client")},
        "message": {"exchange": ex, "routing_key": hx(rk), "properties": hx(raw), "body": hx(body)},
        "expected": request_json(rules.requested(Properties.parse(raw).headers))}
    return out


def listed_json(m: index_records.Listed) -> Json:
    return {k: hx(v) if isinstance(v, bytes) else v for k, v in dataclasses.asdict(m).items()}


def recorded_entries(rec: index_records.Recorder) -> List[Json]:
    return [{"band": key, "body": hx(record), "expected": [listed_json(m) for m in index_records.entries(record)]}
            for key, _, record in rec.take_entries()]


def beat_json(beat: index_records.Beat) -> Json:
    out: Json = {"gateway": hx(beat.gateway), "roles": beat.roles, "low_ms": beat.low_ms, "at_ms": beat.at_ms,
                 "consumers": dataclasses.asdict(beat.consumers), "flags": beat.flags}
    if beat.seen is not None:
        out["seen"] = dataclasses.asdict(beat.seen)
    return out


def waiting_samples() -> Json:
    h = check_in()
    chain_e, med_e, noid_e = (enqueued(h, n).entry for n in ("chain", "meditation", "distributor"))
    retry_e = enqueued(retry(), "retry").entry
    n = bands(CHAIN)
    rec = index_records.Recorder(n, CHAIN.meditation_ms)
    rec.waits(False, [(1, chain_e), (2, noid_e), (3, retry_e)], NOW)
    rec.waits(True, [(4, med_e)], NOW)
    out: Json = {"entries": {
        "produced_by": "index_records.Recorder.waits -> take_entries (DGW1)",
        "inputs": {**inputs_of("chain", "distributor", "retry", "meditation"), "bands": n,
                   "lap_ms": CHAIN.meditation_ms},
        "records": recorded_entries(rec), "messages": [entry_json(e) for e in (chain_e, noid_e, retry_e, med_e)]}}
    h = check_in()
    a, b = enqueued(h, "chain").entry, enqueued(h, "chain-second").entry
    rec = index_records.Recorder(n, CHAIN.meditation_ms)
    rec.waits(False, [(1, a), (1, b)], NOW)
    out["entries-carried"] = {
        "produced_by": "index_records.Recorder.waits of a carrier's two messages (one DGW1 record)",
        "inputs": {**inputs_of("chain", "chain-second"), "bands": n, "lap_ms": CHAIN.meditation_ms},
        "records": recorded_entries(rec), "messages": [entry_json(e) for e in (a, b)]}
    h = check_in()
    a, b = enqueued(h, "chain").entry, enqueued(h, "distributor").entry
    rec = index_records.Recorder(16, CHAIN.meditation_ms)
    owed = rec.left([(1, a)], NOW) + rec.left([(2, b)], NOW)
    taken = rec.take_done(NOW, now=True)
    assert taken is not None and taken[0] == owed == [1, 2]
    done = taken[1]
    out["done"] = {"produced_by": "index_records.Recorder.left -> take_done (DGD1): the distributor delivered one "
                                  "message and dropped one a cancel names",
                   "inputs": inputs_of("chain", "distributor"), "body": hx(done),
                   "expected": {"keys": index_records.done_keys(done)}, "messages": [entry_json(e) for e in (a, b)]}
    gw = bytes(range(16))
    consumers = index_records.Consumers(check_in=2, returning=1, distributor=3)
    roles = index_records.ROLE_CHECK_IN | index_records.ROLE_DISTRIBUTOR
    place = index_records.Place
    seen = index_records.Seen(check_in=place(7, 2), returning=place(0, 1), distributor=place(70_000, 3))
    body = index_records.pack_beat(gw, roles, NOW + 1234, NOW, consumers, index_records.INDEXES, seen)
    beat = index_records.beat(body)
    assert beat is not None
    out["beat"] = {"produced_by": "index_records.pack_beat (DGB3: with what the gateway saw of the queues)",
                   "inputs": {"gateway": hx(gw), "roles": 3, "low_ms": NOW + 1234, "now_ms": NOW,
                              "consumers": dataclasses.asdict(consumers), "flags": index_records.INDEXES,
                              "seen": dataclasses.asdict(seen)},
                   "body": hx(body), "expected": beat_json(beat)}
    body = index_records.pack_beat(gw, index_records.ROLE_CHECK_IN, NOW, NOW, index_records.Consumers(check_in=1), 0)
    beat = index_records.beat(body)
    assert beat is not None
    out["beat-unindexed"] = {"produced_by": "index_records.pack_beat (DGB3) of a gateway with --no-pending-index "
                                            "that could not look at the queues",
                             "inputs": {"gateway": hx(gw), "roles": 1, "low_ms": NOW, "now_ms": NOW,
                                        "consumers": {"check_in": 1}, "flags": 0, "seen": None},
                             "body": hx(body), "expected": beat_json(beat)}
    from gateway.broker.run.index_streams import MARK  # (the reader's mark is written by the broker side)
    token = bytes(range(16, 32))
    out["mark"] = {"produced_by": "gateway.broker.run.index_streams.MARK + a token (a reader's mark to find a "
                                  "stream's end; since DGB3 a gateway's, as it starts, so that no stream is empty)",
                   "inputs": {"token": hx(token)}, "body": hx(MARK + token),
                   "expected": {"entries": 0, "done_keys": [], "beat": None}}
    return out


def registry_samples() -> Json:
    key = registry.ChainKey(1000, "quorum", "queue", 20)
    records = [registry.Record("declared", NOW, key),
               registry.Record("sealed", NOW + 1, None, {
                   "delay.1000ms-quorum-queue.level.19.delay": NOW + 2 ** 19 * 1000,
                   "delay.1000ms-quorum-queue.meditation.20": NOW + 2 ** 20 * 1000}),
               registry.Record("retired", NOW + 2, key)]
    out = []
    for r in records:
        body = registry.encode(r)
        back = registry.decode(body)
        assert back == r
        out.append({"body": hx(body), "expected": {
            "event": r.event, "at_ms": r.at_ms, "chain": dataclasses.asdict(r.chain) if r.chain else None,
            "queues": dict(r.queues)}})
    return {"records": {"produced_by": "topology.registry.encode", "records": out, "inputs": {
        "note": "declared, sealed and retired records of the chain 1000ms-quorum-queue, 20 levels"}},
            "unlisted": unlisted_samples()}


def registry_json(r: registry.Record) -> Json:
    return {"event": r.event, "at_ms": r.at_ms, "chain": dataclasses.asdict(r.chain) if r.chain else None,
            "queues": dict(r.queues), "until_ms": r.until_ms, "why": r.why}


def unlisted_samples() -> Json:
    """The `unlisted` records gateway/broker/run/index_streams.py appends: after a declare that created the index
    where messages already wait, and by a gateway that writes no entries (their broker calls stubbed)."""
    from unittest import mock

    from gateway.broker.run import index_streams
    written: List[registry.Record] = []

    class Queues:  # (Prober: every queue of the chain holds one message)
        def __init__(self, connection: Any) -> None:
            pass

        def queue(self, name: str) -> Any:
            return SimpleNamespace(messages=1)

        def close(self) -> None:
            pass

    with mock.patch.object(index_streams, "append", lambda connection, names, records: written.extend(records)), \
            mock.patch.object(index_streams, "Prober", Queues):
        index_streams.note_messages_before_index(None, CHAIN, NOW)
        index_streams.note_unindexed_gateway(None, CHAIN, NOW + 1)
    out = []
    for r in written:
        body = registry.encode(r)
        assert registry.decode(body) == r
        out.append({"body": hx(body), "expected": registry_json(r)})
    return {"produced_by": "gateway.broker.run.index_streams.note_messages_before_index and note_unindexed_gateway -> "
                           "topology.registry.encode (unlisted)", "records": out,
            "inputs": {"now_ms": NOW, "chain": "1000 ms, 20 levels (generate.CHAIN)",
                       "note": "an upgrade's note at now, a --no-pending-index gateway's at now + 1 ms"}}


def moved_samples() -> Json:
    from gateway.commands import move
    _, rk, body, raw = PUBLISHED["chain"]
    plugin = SimpleNamespace(routing_key=rk, properties=raw, body=body, due_ms=NOW + 90_000)
    ((exchange, key, props, out_body),) = list(move.outgoing(
        move.held_as_gateway([plugin], cancels.Sequencer(), NOW), NAMES.distributor))
    msg = {"body": hx(out_body), "exchange": exchange, "properties": hx(props.raw),
           "routing_key": hx(envelope.as_bytes(key))}
    return {"from-plugin": {
        "produced_by": "gateway.commands.move.outgoing (a plugin's message moved to the distributor)",
        "inputs": {"plugin_message": {"routing_key": hx(rk), "properties": hx(raw), "body": hx(body),
                                      "due_ms": NOW + 90_000}, "now_ms": NOW},
        "message": msg, "expected": read_single(msg)}}


def pick_up_stamp_samples() -> Json:
    e = enqueued(check_in(), "chain").entry
    props = envelope.stamped(e.user, e.due_ms)
    return {"delivered": {
        "produced_by": "envelope.stamped (the distributor with --stamp-due-at)", "inputs": inputs_of("chain"),
        "message": {"exchange": NAMES.pick_up, "routing_key": hx(e.routing_key), "properties": hx(props.raw),
                    "body": hx(e.body)},
        "expected": {"due_ms": e.due_ms}}}


# -- schedule's resume record (gateway/spark/progress.py): a directory on the driver, not in a queue --------
# `delay-gateway schedule` of a CSV table into the chain, killed once two of its four partitions were
# confirmed: the `--state` directory it leaves, which the same command run again resumes. Spark is not
# needed: of the table's DataFrame the record takes only its columns and its input files (with their
# sizes and modification times, given here).
SCHEDULE: Json = {
    "argv": ["/data/orders.csv", "--message-id-column", "order_id", "--content-type", "application/json"],
    "columns": ["order_id", "routing_key", "payload", "deliver_at", "headers"],
    "input_files": [{"path": "file:/data/orders.csv", "size": 1_234_567, "mtime_ns": (NOW - DAY_MS) * 1_000_000}],
    "urls": ["amqp://gateway:s3cret@rabbit-2:5672/%2F", "amqp://gateway:s3cret@rabbit-1:5672/%2F"],
    "exchange": NAMES.check_in,
    "started_at_ms": NOW,
    "counts": {"partitions": 4, "read": 10_000, "rejected": 3},
    "done": [[2, 2_499, 12.3456], [0, 2_500, 9.5]],  # partition, rows, seconds: in the order they finished
}


def schedule_fingerprint(inputs: Json) -> Tuple[str, Json]:
    """The fingerprint and the description of the run `inputs` says, as this tree's `schedule`
    makes them (schedule_job.Job.run): its options by schedule's own parser (with its defaults),
    the format by the input's name, the column mapping, the brokers and the input files."""
    import os
    from unittest import mock

    from gateway.spark import progress, schedule, schedule_job, table_job
    from gateway.spark.columns import column_mapping
    from gateway.spark.publisher import Target
    parser = argparse.ArgumentParser()
    schedule.add_arguments(parser)
    options = schedule_job.Options(**vars(parser.parse_args(inputs["argv"])))
    df = SimpleNamespace(columns=inputs["columns"], inputFiles=lambda: [f["path"] for f in inputs["input_files"]])
    files = {f["path"][len("file:"):]: f for f in inputs["input_files"]}
    real_stat = os.stat

    def stat(path: Any, *args: Any, **kwargs: Any) -> Any:  # (the input files, as given)
        found = files.get(path)
        if found is None:
            return real_stat(path, *args, **kwargs)
        return SimpleNamespace(st_size=found["size"], st_mtime_ns=found["mtime_ns"])

    with mock.patch.object(os, "stat", stat):
        description = progress.run_description(options, table_job.input_format(options),
                                                Target(tuple(inputs["urls"]), inputs["exchange"]), df,
                                                column_mapping(options, df))
    return progress.fingerprint(description), description


def schedule_state_samples() -> Json:
    import tempfile

    from gateway.spark import progress
    fp, description = schedule_fingerprint(SCHEDULE)
    with tempfile.TemporaryDirectory() as directory:
        state = progress.Progress(directory)  # as schedule_job.Job.run writes it
        state.begin({"fingerprint": fp, "started_at_ms": SCHEDULE["started_at_ms"], "run": description})
        state.update(**SCHEDULE["counts"])
        for partition, rows, seconds in SCHEDULE["done"]:
            state.mark(partition, rows, seconds)
        written = sorted(p for p in Path(directory).rglob("*") if p.is_file())
        records = [{"path": p.relative_to(directory).as_posix(), "body": hx(p.read_bytes())} for p in written]
        back = progress.Progress(directory)
        run, done = back.run(), back.done()
    assert run is not None and run["fingerprint"] == fp and run["run"] == json.loads(json.dumps(description))
    assert done == {partition: rows for partition, rows, _ in SCHEDULE["done"]}
    return {"interrupted": {
        "produced_by": "gateway.spark.progress.Progress (begin, update, mark) as schedule_job.Job.run calls it, "
                       "with run_description and fingerprint of the command, table and brokers in the inputs",
        "inputs": SCHEDULE, "records": records,
        "expected": {"fingerprint": run["fingerprint"], "started_at_ms": run["started_at_ms"],
                     "partitions": run["partitions"], "done": sorted([p, rows] for p, rows in done.items())}}}


FORMATS: Dict[str, Callable[[], Json]] = {
    "arrival-stamp": arrival_stamp_samples,
    "cancel-record": cancel_record_samples,
    "cancel-rule": cancel_rule_samples,
    "carrier": carrier_samples,
    "envelope": envelope_samples,
    "meditation": meditation_samples,
    "moved": moved_samples,
    "parked": parked_samples,
    "pick-up-stamp": pick_up_stamp_samples,
    "registry": registry_samples,
    "retry": retry_samples,
    "schedule-state": schedule_state_samples,
    "waiting": waiting_samples,
}


def samples() -> Dict[str, Json]:
    """format -> variant -> sample, as this tree writes them."""
    return {name: make() for name, make in FORMATS.items()}


# -- the sample files ----------------------------------------------------------------------------------------
def files(fmt: str) -> List[Path]:
    """A format's sample files, oldest first (their names start with the commit's date)."""
    return sorted((SAMPLES / fmt).glob("*.json"))


def load(path: Path) -> Json:
    with path.open() as f:
        found: Json = json.load(f)
    return found


def written_bytes(sample: Json) -> Any:
    """What a sample says was written: the part a format change changes."""
    if "message" in sample:
        return sample["message"]["properties"], sample["message"]["body"]
    if "records" in sample:
        return [r["body"] for r in sample["records"]]
    return sample["body"]


def changed(fmt: str, now: Json) -> List[str]:
    """The variants whose bytes differ from the newest sample of `fmt` (all, if it has none)."""
    found = files(fmt)
    newest = load(found[-1])["samples"] if found else {}
    return sorted(set(newest) ^ set(now) | {v for v in now if v in newest
                                            and written_bytes(now[v]) != written_bytes(newest[v])})


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).parent).stdout.strip()


def commit_info(rev: str) -> Json:
    full, date, adate = _git("log", "-1", "--format=%H%n%cI%n%aI", rev, "--").split("\n")
    return {"commit": full, "date": date, "author_date": adate}


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.formats.generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--write", action="store_true", help="add a sample file for each format that changed")
    p.add_argument("--changed", default="", help="with --write: what changed, for the new files")
    p.add_argument("--commit", default="HEAD", metavar="REV",
                   help="with --write: the commit whose code first writes the new bytes, which names the files "
                        "(check with git log; default: the one checked out, which is often a later one: a merge, "
                        "or a commit after the change)")
    p.add_argument("--only", action="append", metavar="FORMAT", choices=sorted(FORMATS),
                   help="with --write: only this format (repeat for more): formats changed by different commits")
    p.add_argument("--about", default="", help="with --write: what a new format is (a format's first sample)")
    args = p.parse_args(argv)
    now = samples()
    differ = {fmt: changed(fmt, variants) for fmt, variants in now.items() if not args.only or fmt in args.only}
    differ = {fmt: v for fmt, v in differ.items() if v}
    if not differ:
        print("every format writes what its newest sample says: nothing to add")
        return 0
    for fmt, variants in differ.items():
        print(f"{fmt}: changed {', '.join(variants)}")
    if not args.write:
        print("run again with --write (after committing the change) to add their samples")
        return 1
    info, checked = commit_info(args.commit), commit_info("HEAD")
    full, date = info["commit"], info["date"]
    for fmt in differ:
        path = SAMPLES / fmt / f"{date[:16].replace(':', '')}-{full[:7]}.json"
        if path.exists():
            print(f"{path} exists: not overwritten", file=sys.stderr)
            return 2
        about = load(files(fmt)[-1])["about"] if files(fmt) else args.about or "(say what this format is)"
        doc = {"format": fmt, "about": about, "written_by": info, "same_bytes_until": checked, "checkpoints": {},
               "changed": args.changed or "(say what changed)",
               "generated": f"by python -m tests.formats.generate at {checked['commit'][:7]}, with fixed inputs; "
                            "'expected' is what that commit's own code read back from these bytes",
               "samples": now[fmt]}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
