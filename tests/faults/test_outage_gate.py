"""Split roles keep the outage gate (on every suite broker): a distributor of its own that
(re)connects releases nothing before check-in has recorded the cancels queued in it. After an
outage, a message already due waits in the distributor queue while its cancel waits in
check-in; a gateway of every role starts its other consumers only once its check-in read
that cancel (session.py), and a `--role distributor` process now waits likewise: it cancels
an id no message has, which queues behind them (once a check-in consumer runs), and consumes
once that is recorded. Before, it released the cancelled message the moment it connected. The
same for a rule. (With nothing queued in check-in and no check-in consumer, there is nothing
to wait for.)"""

import pika
import pytest

from ..support import GatewayProcess, Receiver, connect, now_ms, publish_sentinel, wait_until

CHAIN = dict(max_level=3, resolution_ms=250)


def ready_in(chain, queue: str) -> int:
    with connect() as c:
        return c.channel().queue_declare(queue, passive=True).method.message_count


@pytest.mark.parametrize("fault", ["none", "kill"])
def test_a_distributor_of_its_own_releases_nothing_before_check_in_records_the_outages_cancels(make_chain, fault):
    """`kill`: the distributor is SIGKILLed while it waits at the gate, and another starts (its
    own gate queues behind the first's)."""
    chain = make_chain(**CHAIN)
    receiver = Receiver(chain)
    started = []
    try:
        # Two messages go into the chain (due in 1.5 s), then check-in stops: an outage.
        first = GatewayProcess(chain, "--role", "check-in").wait_ready()
        started.append(first)
        due = now_ms() + 1500
        with connect() as c:
            ch = c.channel()
            ch.confirm_delivery()
            for mid in ("cancelled", "ruled", "kept"):
                ch.basic_publish(chain.names.check_in, mid, b"x", pika.BasicProperties(
                    message_id=mid, delivery_mode=2, headers={"x-deliver-at": due}), mandatory=True)
        # both through the chain into the distributor queue, unread (no distributor runs)
        wait_until(lambda: first.metric("delay_gateway_messages_total", queue=chain.names.check_in) >= 3, 30,
                   what="check-in to send them on")
        first.terminate()
        # (together in one carrier, or a delivery each)
        wait_until(lambda: ready_in(chain, chain.names.distributor) >= 1 and now_ms() > due, 30,
                   what="them in the distributor queue, due")
        waiting = ready_in(chain, chain.names.distributor)
        assert ready_in(chain, chain.names.check_in) == 0
        # During the outage, one is cancelled by id and one by a rule (both wait in check-in): all are due by now.
        with connect() as c:
            ch = c.channel()
            ch.confirm_delivery()
            ch.basic_publish(chain.names.cancel, "", b"", pika.BasicProperties(message_id="cancelled"),
                             mandatory=True)
            ch.basic_publish(chain.names.rules, "", b"", pika.BasicProperties(
                headers={"x-cancel-key": "ruled"}, delivery_mode=2), mandatory=True)
        # The distributor starts first, alone: it must not release before check-in records the cancel.
        for attempt in range(2 if fault == "kill" else 1):
            distributor = GatewayProcess(chain, "--role", "distributor")
            started.append(distributor)
            wait_until(lambda distributor=distributor: distributor.events("check_in_gate")
                       or ready_in(chain, chain.names.distributor) != waiting, 30,
                       what="the distributor waiting for check-in")
            assert ready_in(chain, chain.names.distributor) == waiting, "released before check-in recorded the cancel"
            assert not distributor.ready
            if fault == "kill" and attempt == 0:
                distributor.kill()
        check_in = GatewayProcess(chain, "--role", "check-in").wait_ready()
        started.append(check_in)
        distributor.wait_ready()
        publish_sentinel(chain, 0)
        arrived = [m.properties.message_id for m in receiver.until_sentinel(30)]
        assert arrived == ["kept"]
        assert not distributor.events("check_in_catch_up_slow")
    finally:
        for process in started:
            process.terminate()
        receiver.close()
