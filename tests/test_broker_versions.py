"""What the broker itself does with the four mechanisms the gateway's design leans on, on
each broker version (docs/reliability.md, "Tested on"). No gateway here: plain AMQP against the broker,
so a change in a new RabbitMQ release shows up as a failure naming the mechanism.

- x-death: a client-republished `x-death` header counts for cycle detection on 3.10 (the
  message is dropped) and is ignored on 4.0 and 4.3; the gateway strips it either way.
- Quorum delivery limit: unlimited redelivery on 3.10, a default limit of 20 on 4.x (the
  21st return drops the message when there is nowhere to dead-letter it).
- At-least-once dead-lettering: an unroutable dead-letter stays in its quorum source queue
  (it is not dropped) on both; with the default overflow it silently becomes at-most-once.
- Alternate exchange: catches dead-letters that match no binding, on both.
- Definitions: what `delay-gateway render --format definitions` prints imports on both.
- Arrival stamp (4.x only; 3.10 has no message interceptors): every publish without
  `timestamp_in_ms` gets the broker's arrival time; a publisher's own value is kept.
- Short strings that are not UTF-8: carried as bytes in a publish (routing key, header
  names), refused with 501 FRAME_ERROR in a binding key, on every version.
- Global QoS (`basic.qos` with global=true): taken by 3.10 and 4.0, refused by 4.3; the
  gateway's prefetch is per consumer.

Each test costs a second or two per broker.
"""

import pika
import pytest

from topology import ChainSettings, build
from topology.broker.declare import declare
from topology.definitions import render

from .support import connect, now_ms, remove, unique_prefix, wait_until
from .support import RMQ4

@pytest.fixture
def names(broker, request):
    """A unique prefix for this test's objects, and their deletion afterwards."""
    prefix = unique_prefix()
    made = {"queues": [], "exchanges": []}
    yield prefix, made
    with connect() as connection:
        channel = connection.channel()
        for queue in made["queues"]:
            channel.queue_delete(queue)
        for exchange in made["exchanges"]:
            channel.exchange_delete(exchange)


def version_of(request) -> str:
    return request.node.callspec.params["broker"]


def declare_queue(channel, made, name, **arguments):
    channel.queue_declare(name, durable=True, arguments=arguments)
    made["queues"].append(name)
    return name


def declare_exchange(channel, made, name, kind="fanout", **arguments):
    channel.exchange_declare(name, kind, durable=True, arguments=arguments or None)
    made["exchanges"].append(name)
    return name


def look(channel, queue: str, timeout: float = 1.0):
    """basic.get's method for the next message, not acknowledged; None if none came in time
    (a message just handed back may take a moment to be there again)."""
    return wait_until(lambda: channel.basic_get(queue)[0], timeout, interval=0.02, fail=False)


def wait_for_message(channel, queue, timeout=5.0):
    """(properties, body) of the next message in `queue`, or None if none came in time."""
    def taken():
        method, properties, body = channel.basic_get(queue, auto_ack=True)
        return (properties, body) if method is not None else None
    return wait_until(taken, timeout, interval=0.02, fail=False)


def queue_exists(connection, name: str) -> bool:
    """Whether a passive declare finds `name` (on a channel of its own: a 404 closes it)."""
    try:
        connection.channel().queue_declare(name, passive=True)
        return True
    except pika.exceptions.ChannelClosedByBroker:
        return False


def messages_in(channel, queue) -> int:
    return channel.queue_declare(queue, passive=True).method.message_count


# A message that went through two TTL queues (level.01 then level.00 of a chain), read by a
# client and published into the first again with the x-death the broker wrote: what a
# second pass through the chain would be (a replayed parked message, say) were the gateway
# not to strip the death history. When level.01 dead-letters it into level.00 again, 3.10
# sees level.00 in the history (expired there, nothing rejected since) and drops it as a
# cycle; 4.x ignores a client's x-death and delivers it.
X_DEATH_KEPT = {"rmq3.10": "dropped", "rmq4.0": "delivered", "rmq4.3": "delivered"}


@pytest.mark.parametrize("strip", [False, True], ids=["x-death-kept", "x-death-stripped"])
def test_republished_x_death_and_cycle_detection(request, names, strip):
    prefix, made = names
    with connect() as connection:
        channel = connection.channel()
        channel.confirm_delivery()
        out_exchange = declare_exchange(channel, made, f"{prefix}.out")
        out = declare_queue(channel, made, f"{prefix}.out-q")
        channel.queue_bind(out, out_exchange)
        level0_exchange = declare_exchange(channel, made, f"{prefix}.level0")
        level0 = declare_queue(channel, made, f"{prefix}.level0-q", **{
            "x-message-ttl": 30, "x-dead-letter-exchange": out_exchange})
        channel.queue_bind(level0, level0_exchange)
        level1 = declare_queue(channel, made, f"{prefix}.level1-q", **{
            "x-message-ttl": 30, "x-dead-letter-exchange": level0_exchange})
        # Pass 1: the broker dead-letters it twice and writes both deaths.
        channel.basic_publish("", level1, b"pass", pika.BasicProperties(delivery_mode=2), mandatory=True)
        properties, _ = wait_for_message(channel, out)
        assert [d["queue"] for d in properties.headers["x-death"]] == [level0, level1]
        # Pass 2: republished by a client, the death history kept or stripped.
        headers = dict(properties.headers)
        if strip:
            headers = {k: v for k, v in headers.items()
                       if not k.startswith(("x-death", "x-first-death", "x-last-death"))}
        channel.basic_publish("", level1, b"pass", pika.BasicProperties(delivery_mode=2, headers=headers),
                              mandatory=True)
        second = wait_for_message(channel, out, timeout=2)
    outcome = "delivered" if second is not None else "dropped"
    expected = "delivered" if strip else X_DEATH_KEPT[version_of(request)]
    assert outcome == expected, (f"{version_of(request)}: republished with x-death "
                                 f"{'stripped' if strip else 'kept'}, the message was {outcome}")


def test_two_ttl_queues_dead_lettering_into_each_other_lose_the_message(request, names):
    """Why meditation returns through the check-in consumer (which strips x-death) and not
    straight from queue to queue: the broker's own cycle detection, on every version."""
    prefix, made = names
    with connect() as connection:
        channel = connection.channel()
        a_ex = declare_exchange(channel, made, f"{prefix}.a")
        b_ex = declare_exchange(channel, made, f"{prefix}.b")
        a = declare_queue(channel, made, f"{prefix}.a-q", **{"x-message-ttl": 30, "x-dead-letter-exchange": b_ex})
        b = declare_queue(channel, made, f"{prefix}.b-q", **{"x-message-ttl": 30, "x-dead-letter-exchange": a_ex})
        channel.queue_bind(a, a_ex)
        channel.queue_bind(b, b_ex)
        channel.confirm_delivery()
        channel.basic_publish(a_ex, "", b"loop", pika.BasicProperties(delivery_mode=2), mandatory=True)
        wait_until(lambda: messages_in(channel, a) + messages_in(channel, b) == 0, 10,
                   what="the looping message dropped")


# How many times a quorum queue without x-delivery-limit lets a message be returned
# (reject, requeue) before it drops it, there being no dead-letter target.
DEFAULT_DELIVERY_LIMIT = {"rmq3.10": None, "rmq4.0": 20, "rmq4.3": 20}
# Which returns count against a delivery limit: basic.reject with requeue and a consumer
# gone with the message unacked (its channel closed, its connection lost) count everywhere;
# basic.nack with requeue counts on 3.10 and 4.0 but not on 4.3 (no x-delivery-count either).
NACK_COUNTS = {"rmq3.10": True, "rmq4.0": True, "rmq4.3": False}


def give_back(channel, tag: int, how: str) -> None:
    if how == "nack":
        channel.basic_nack(tag, requeue=True)
    else:
        channel.basic_reject(tag, requeue=True)


def test_quorum_default_delivery_limit(request, names):
    prefix, made = names
    with connect() as connection:
        channel = connection.channel()
        channel.confirm_delivery()
        queue = declare_queue(channel, made, f"{prefix}.qq", **{"x-queue-type": "quorum"})
        channel.basic_publish("", queue, b"again", pika.BasicProperties(delivery_mode=2), mandatory=True)
        limit = DEFAULT_DELIVERY_LIMIT[version_of(request)]
        returns = 0
        for _ in range(25):
            # "Looking" at a message is a delivery: basic.get then nack with requeue. Until
            # the return is back in the queue, or (dropped) a second has passed.
            method = look(channel, queue)
            if method is None:
                break
            channel.basic_reject(method.delivery_tag, requeue=True)
            returns += 1
        expected_left = 1 if limit is None else 0
        wait_until(lambda: messages_in(channel, queue) == expected_left, 5, fail=False)  # the last return back
        left = messages_in(channel, queue)
    if limit is None:
        assert returns == 25 and left == 1, (returns, left)
    else:
        assert returns == limit + 1 and left == 0, (returns, left)


@pytest.mark.parametrize("how", ["reject", "nack", "consumer-gone"])
def test_explicit_delivery_limit_dead_letters(request, names, how):
    """The gateway's consumed queues set x-delivery-limit (20) and dead-letter at least once
    to parking, so the 21st return moves the message aside. The returns the gateway causes
    are those of a consumer gone (a crash, a lost connection): they count on every version.
    (It never requeues with basic.nack, which 4.3 does not count.)"""
    prefix, made = names
    with connect() as connection:
        channel = connection.channel()
        channel.confirm_delivery()
        parking_ex = declare_exchange(channel, made, f"{prefix}.parking")
        parking = declare_queue(channel, made, f"{prefix}.parking-q", **{"x-queue-type": "quorum"})
        channel.queue_bind(parking, parking_ex)
        queue = declare_queue(channel, made, f"{prefix}.consumed", **{
            "x-queue-type": "quorum", "x-delivery-limit": 3, "x-dead-letter-exchange": parking_ex,
            "x-dead-letter-strategy": "at-least-once", "x-overflow": "reject-publish"})
        channel.basic_publish("", queue, b"poison", pika.BasicProperties(delivery_mode=2), mandatory=True)
        returns = 0
        while returns < 10:
            reader = connection.channel() if how == "consumer-gone" else channel
            method = look(reader, queue)
            if method is None:
                break
            if how == "consumer-gone":
                reader.close()  # unacked: back to the queue
            else:
                give_back(channel, method.delivery_tag, how)
            returns += 1
        parked = wait_for_message(channel, parking, timeout=5 if returns < 10 else 0.5)
    if how == "nack" and not NACK_COUNTS[version_of(request)]:
        assert returns == 10 and parked is None, (returns, parked)  # still in the queue, never parked
        return
    assert returns == 4, returns
    assert parked is not None and parked[1] == b"poison"
    [death] = parked[0].headers["x-death"]
    assert death["reason"] == "delivery_limit" and death["queue"] == queue


def held_by(broker_ctl, queue: str, within_s: int) -> int:
    """Messages a queue holds in any state, the first non-zero count the queue itself gives
    within `within_s` seconds (else 0): a quorum queue's dead-letter waiting for a route is
    neither ready nor unacked, so AMQP cannot see it, and list_queues shows it only once the
    queue's statistics are next emitted. The node asks the queue in a loop of its own: on a
    busy machine one `rabbitmqctl eval` can take longer than the whole wait."""
    out = broker_ctl("eval", f"""
        Ask = fun() -> {{ok, Q}} = rabbit_amqqueue:lookup(rabbit_misc:r(<<"/">>, queue, <<"{queue}">>)),
                       proplists:get_value(messages, rabbit_amqqueue:info(Q, [messages])) end,
        Loop = fun(L, 0) -> Ask();
                  (L, N) -> case Ask() of 0 -> timer:sleep(100), L(L, N - 1); Held -> Held end end,
        Loop(Loop, {within_s * 10}).""")
    return int(out.strip())


@pytest.mark.parametrize("overflow", ["reject-publish", "drop-head"])
def test_at_least_once_keeps_an_unroutable_dead_letter(request, names, broker_ctl, overflow):
    """An expired message whose dead-letter exchange routes it nowhere: with at-least-once
    it stays in its quorum source queue (and blocks those behind it: why the gateway gives
    every chain exchange an alternate exchange); with drop-head overflow RabbitMQ silently
    falls back to at-most-once and the message is gone. The same on both versions."""
    prefix, made = names
    with connect() as connection:
        channel = connection.channel()
        channel.confirm_delivery()
        nowhere = declare_exchange(channel, made, f"{prefix}.nowhere", "topic")
        source = declare_queue(channel, made, f"{prefix}.source", **{
            "x-queue-type": "quorum", "x-message-ttl": 50, "x-dead-letter-exchange": nowhere,
            "x-dead-letter-strategy": "at-least-once", "x-overflow": overflow})
        channel.basic_publish("", source, b"stuck?", pika.BasicProperties(delivery_mode=2), mandatory=True)
        # expired within 50 ms: not ready for consumers, whatever the dead-lettering does
        wait_until(lambda: messages_in(channel, source) == 0, 5, fail=False)
        ready = messages_in(channel, source)
    # The dead-letter worker holds it for a moment before it is counted as back in the
    # queue: watch for a few seconds.
    held = held_by(broker_ctl, source, within_s=10)
    assert ready == 0  # expired: not for consumers either way
    assert held == (1 if overflow == "reject-publish" else 0), f"{overflow}: {held} held"


def test_alternate_exchange_catches_dead_letters_with_no_binding(request, names):
    prefix, made = names
    with connect() as connection:
        channel = connection.channel()
        channel.confirm_delivery()
        parking_ex = declare_exchange(channel, made, f"{prefix}.parking")
        parking = declare_queue(channel, made, f"{prefix}.parking-q", **{"x-queue-type": "quorum"})
        channel.queue_bind(parking, parking_ex)
        level = declare_exchange(channel, made, f"{prefix}.level", "topic", **{"alternate-exchange": parking_ex})
        for queue_type, strategy in (("classic", None), ("quorum", "at-least-once")):
            arguments = {"x-queue-type": queue_type, "x-message-ttl": 30, "x-dead-letter-exchange": level,
                         "x-dead-letter-routing-key": "no.binding.matches"}
            if strategy:
                arguments.update({"x-dead-letter-strategy": strategy, "x-overflow": "reject-publish"})
            source = declare_queue(channel, made, f"{prefix}.{queue_type}-source", **arguments)
            channel.basic_publish("", source, queue_type.encode(), pika.BasicProperties(delivery_mode=2),
                                  mandatory=True)
            caught = wait_for_message(channel, parking)
            assert caught is not None and caught[1] == queue_type.encode(), queue_type
        # And a publish to the exchange that matches no binding goes there too.
        channel.basic_publish(level, "nothing.bound", b"published", mandatory=True)
        assert wait_for_message(channel, parking)[1] == b"published"


def test_gateway_definitions_import_on_each_version(names, broker_ctl):
    """`delay-gateway render --format definitions` imported with rabbitmqctl, then the gateway's own
    declare: any difference in arguments would be a 406 (4.x checks them as 3.10 does)."""
    prefix, _ = names
    chain = ChainSettings(prefix=prefix, max_level=4)
    topology = build(chain)
    try:
        broker_ctl("-q", "import_definitions", broker_ctl.file(render(topology), ".json"))
        with connect() as connection:
            # the import runs asynchronously: wait for the last queue
            wait_until(lambda: queue_exists(connection, topology.queues[-1].name), 10, 0.1,
                       "the imported queues", sleep=connection.sleep)
            declare(connection.channel(), topology)
    finally:
        remove(chain)


# The broker's arrival stamp (3.12+, `message_interceptors.incoming.set_header_timestamp`):
# the RabbitMQ 4.x nodes of these tests have it on; 3.10 has no interceptors.
@pytest.mark.brokers(*RMQ4, reason='message interceptors exist from 3.12 on')
def test_arrival_stamp_is_added_and_a_publishers_own_is_kept(names):
    prefix, made = names
    with connect() as connection:
        channel = connection.channel()
        channel.confirm_delivery()
        queue = declare_queue(channel, made, f"{prefix}.stamped", **{"x-queue-type": "quorum"})
        before = now_ms()
        channel.basic_publish("", queue, b"plain", pika.BasicProperties(delivery_mode=2), mandatory=True)
        after = now_ms()
        channel.basic_publish("", queue, b"forged", pika.BasicProperties(
            delivery_mode=2, headers={"timestamp_in_ms": 1}), mandatory=True)
        plain = wait_for_message(channel, queue)
        forged = wait_for_message(channel, queue)
    assert before <= plain[0].headers["timestamp_in_ms"] <= after
    assert plain[0].timestamp == plain[0].headers["timestamp_in_ms"] // 1000  # the property, in seconds
    # overwrite = false: what a publisher sets is kept, so the stamp can be forged.
    assert forged[0].headers["timestamp_in_ms"] == 1


def test_short_strings_that_are_not_utf8(names):
    """A routing key and a header name that are not UTF-8 are carried as bytes in a publish,
    on every version (the gateway keeps them: tests/test_isolation.py); the same bytes as
    a binding key, in a method the broker decodes, close the client's connection with 501
    FRAME_ERROR "Malformed UTF-8 in shortstr": a receiver cannot bind to such a key."""
    from gateway.broker.plumbing import lazy_properties
    from gateway.core.wire import Properties, Table
    prefix, made = names
    with connect() as connection:  # the gateway's WireConnection: it reads a header name that is not UTF-8
        channel = connection.channel()
        channel.confirm_delivery()
        exchange = declare_exchange(channel, made, f"{prefix}.topic", "topic")
        queue = declare_queue(channel, made, f"{prefix}.all")
        channel.queue_bind(queue, exchange, "#")
        headers = Table.parse(bytes([5]) + b"\xffname" + b"b" + b"\x01")
        channel.basic_publish(exchange, b"key.\xff\xfe", b"bytes", lazy_properties.WireProperties(Properties.build(
            headers=headers)), mandatory=True)
        method, properties, body = channel.basic_get(queue, auto_ack=True)
        assert body == b"bytes" and method.routing_key in (b"key.\xff\xfe", "key.\xff\xfe")
        assert b"\xffname" in properties.headers
    with connect() as connection:
        channel = connection.channel()
        with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as refused:
            channel.queue_bind(queue, exchange, b"key.\xff\xfe")
    assert refused.value.reply_code == 501 and "UTF-8" in refused.value.reply_text


# basic.qos with global=true shares one prefetch among a channel's consumers: a deprecated
# feature (`rabbitmqctl list_deprecated_features`: global_qos) that 4.3 denies by default. It
# does not refuse the method: it takes the prefetch per consumer instead and logs an error.
# Two consumers on one channel with a global prefetch of 1: how many deliveries unacked.
GLOBAL_QOS_UNACKED = {"rmq3.10": 1, "rmq4.0": 1, "rmq4.3": 2}


def test_global_qos_is_per_consumer_on_4_3(request, names):
    """The gateway's prefetch is per consumer (pika's default), the same on every version."""
    prefix, made = names
    with connect() as connection:
        channel = connection.channel()
        queues = [declare_queue(channel, made, f"{prefix}.q{i}") for i in (1, 2)]
        for queue in queues:
            for _ in range(3):
                channel.basic_publish("", queue, b"x")
        wait_until(lambda: all(messages_in(channel, q) == 3 for q in queues), 5, 0.02, "three in each queue")
        consumer = connection.channel()
        consumer.basic_qos(prefetch_count=1, global_qos=True)
        got = []
        for queue in queues:
            consumer.basic_consume(queue, lambda ch, method, properties, body: got.append(method.routing_key))
        # A queue hands out what the prefetch lets it as it takes the consumer, before it says
        # consume-ok: what is no longer ready is what was sent. Until all of that arrived.
        sent = 6 - sum(messages_in(channel, q) for q in queues)
        wait_until(lambda: len(got) >= sent, 5, 0.02, "what the queues sent", sleep=connection.sleep)
        consumer.close()  # the unacked go back
    assert len(got) == sent == GLOBAL_QOS_UNACKED[version_of(request)], (got, sent)
