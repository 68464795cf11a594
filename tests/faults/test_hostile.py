"""Property-based fuzzing of what a publisher can send to check-in: header values of every
AMQP field type (including doubles, which other clients send; see gateway/codec.py), huge and
negative numbers, nested tables and arrays, bodies from 0 bytes to a few MB, odd routing
keys. Every message must be delivered, or parked with a reason, or (due far ahead) still
be waiting in the chain; the gateway must not crash, stall or fail a handler."""

import datetime
import time
import uuid
from collections import Counter

import pika
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gateway import codec, envelope
from topology import build

from ..support import GatewayProcess, connect, drain, now_ms
from .load import Figures

INT64 = (-(2 ** 63), 2 ** 63 - 1)
DELIVER_WITHIN_MS = 4000


scalars = st.one_of(
    st.integers(*INT64),
    st.integers(-300, 300),
    # NaN and infinity are refused by the broker itself (541 INTERNAL_ERROR on 3.10.8).
    st.floats(allow_nan=False, allow_infinity=False),
    st.decimals(min_value=-10 ** 6, max_value=10 ** 6, places=3, allow_nan=False),
    st.text(max_size=40),
    st.binary(max_size=40),
    st.booleans(),
    st.none(),
    st.datetimes(min_value=datetime.datetime(1970, 1, 2), max_value=datetime.datetime(2100, 1, 1)),
)
names = st.text(min_size=1, max_size=20).filter(lambda s: len(s.encode()) <= 255)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(names, inner, max_size=4), max_leaves=12)
delays = st.one_of(st.none(), st.integers(-5000, 2500), st.integers(*INT64), values,
                   st.integers(0, 2500).map(str), st.floats(-100, 2500))
special = st.sampled_from(["x-delay", "x-deliver-at", "x-death", "x-gateway-due-at",
                           "x-gateway-routing-key", "x-first-death-queue", "x-delivery-count"])
routing_keys = st.one_of(
    st.just(""), st.just("a" * 255), st.just("ключ.🙂.#.*"),
    st.lists(st.sampled_from(["a", "b", "*", "#", "", "1", "0"]), max_size=6).map(".".join),
    st.text(max_size=60).filter(lambda s: len(s.encode()) <= 255))
# Mostly small; a few of 64 KB to 4 MB (hypothesis likes boundaries, so keep them rare).
bodies = st.integers(0, 199).flatmap(
    lambda r: st.integers(2 ** 16, 4 * 2 ** 20).map(lambda n: b"\xa5" * n) if r < 4 else st.binary(max_size=2048))


class DeliverAt(int):
    """An offset from the moment of publishing, made absolute then."""


@st.composite
def messages(draw):
    headers = draw(st.dictionaries(names, values, max_size=5))
    if draw(st.booleans()):
        headers["x-delay"] = draw(delays)
    if draw(st.integers(0, 9)) == 0:
        headers["x-deliver-at"] = draw(st.one_of(values, st.integers(-10_000, 2000).map(DeliverAt)))
    if draw(st.integers(0, 9)) == 0:
        headers[draw(special)] = draw(values)
    return draw(routing_keys), headers, draw(bodies), draw(st.sampled_from([None, "text/plain", "ü/?"]))


def predicted(headers, now: int) -> str:
    try:
        due = envelope.due_at(headers, now)
    except envelope.Unreadable:
        return "parked"
    return "delivered" if due - now <= DELIVER_WITHIN_MS else "waiting"


def test_hostile_publishers_never_crash_or_stall_the_gateway(make_chain, fault_report):
    chain = make_chain(max_level=3, resolution_ms=100)
    gateway = GatewayProcess(chain).wait_consuming()
    connection = connect()
    channel = connection.channel()
    channel.confirm_delivery()
    sink = channel.queue_declare("", exclusive=True).method.queue
    channel.queue_bind(sink, chain.names.pick_up, "#")
    expected, tally = {}, Counter()

    @settings(max_examples=150, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(messages())
    @example(("big", {"x-delay": 300}, b"\xa5" * (4 * 2 ** 20), None))  # several MB
    @example(("", {}, b"", None))  # empty everything
    @example(("a" * 255, {"x-delay": 1.5e300, "ratio": 1.5}, b"x", None))  # the double that broke it
    @example(("ratio", {"x-delay": 250.5, "ratio": 1.5, "tiny": 5e-324}, b"x", None))
    def publish(message):
        key, headers, body, content_type = message
        message_id = uuid.uuid4().hex
        now = now_ms()
        headers = {k: now + int(v) if isinstance(v, DeliverAt) else v for k, v in headers.items()}
        channel.basic_publish(chain.names.check_in, key, body, pika.BasicProperties(
            message_id=message_id, headers=headers, content_type=content_type, delivery_mode=2),
            mandatory=True)
        expected[message_id] = (predicted(headers, now), key, headers)
        tally["bodies >= 1 MB"] += len(body) >= 2 ** 20
        tally["float headers"] += any(isinstance(v, float) for v in headers.values())

    # This process sends and reads doubles the way the gateway does (pika alone cannot).
    codec.install()
    publish()
    wanted = {mid for mid, (kind, _, _) in expected.items() if kind == "delivered"}
    delivered = {}
    deadline = time.monotonic() + DELIVER_WITHIN_MS / 1000 + 15
    while not wanted <= delivered.keys() and time.monotonic() < deadline:
        delivered.update({p.message_id: (m.routing_key, p.headers) for m, p, _ in drain(channel, sink)})
        connection.sleep(0.1)
    time.sleep(1)
    delivered.update({p.message_id: (m.routing_key, p.headers) for m, p, _ in drain(channel, sink)})
    parked = {p.message_id: (p.headers or {}).get(envelope.ERROR) for _, p, _ in drain(channel, chain.names.parked)}
    alive = gateway.proc.poll() is None
    assert gateway.terminate() == 0
    time.sleep(chain.meditation_ms / 1000 + 1)  # what waits drains into check-in or distributor
    with connect() as c:
        held = sum(c.channel().queue_declare(q.name, passive=True).method.message_count
                   for q in build(chain).queues if q.name not in (chain.names.parked,))
    connection.close()

    outcome = {mid: ("delivered" if mid in delivered else "parked" if mid in parked else "missing")
               for mid in expected}
    waiting = [mid for mid, (kind, _, _) in expected.items() if kind == "waiting"]
    missing = [mid for mid, o in outcome.items() if o == "missing" and mid not in waiting]
    tally.update(f"{o}" for o in outcome.values())
    tally.update(f"predicted {kind}" for kind, _, _ in expected.values())
    failures = [e for e in gateway.lines if e.get("event") in ("handler failed; rejecting to parking", "publish failed")]
    fault_report(Figures("hostile-input", len(expected), 0, len(missing), 0, 0,
                         {k.replace(" ", "_"): v for k, v in sorted(tally.items())}))
    assert alive, "".join(gateway.raw[-20:])
    assert not failures, failures[:3]
    problems = [e for e in gateway.lines if e.get("level") in ("warning", "error") and e.get("event") != "parked"]
    assert not problems, problems[:5]
    assert not missing, [(expected[m][0], expected[m][1], expected[m][2]) for m in missing[:5]]
    assert all(reason for reason in parked.values()), "a parked message has no x-gateway-error"
    assert held == len([m for m in waiting if outcome[m] == "missing"])
    for mid, (kind, key, headers) in expected.items():
        if outcome[mid] == "delivered":
            assert kind == "delivered", (kind, headers)
            got_key, got_headers = delivered[mid]
            assert set(got_headers or {}) == {k for k in headers if not envelope.is_broker_header(k)
                                              and not k.startswith(envelope.INTERNAL)}
            if "ratio" in headers:  # doubles travel unchanged
                assert got_headers["ratio"] == 1.5 and got_headers.get("tiny", 5e-324) == 5e-324
        if outcome[mid] == "parked":
            assert kind == "parked", (kind, headers, parked[mid])
