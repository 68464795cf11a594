"""The gateway on a broker that stamps arrival times (RabbitMQ 3.12+ with
`message_interceptors.incoming.set_header_timestamp.overwrite = false`: the 4.x nodes of
these tests). Every publish, the gateway's own to the chain and to pick-up included, gets
`timestamp_in_ms` unless it has one; the stamp of the publisher's message must be the one
the receiver sees, and nothing may arrive before that stamp plus its delay. The gateway
says at start that x-delay counts from arrival (and gives no warning). About 2 s.
"""

import pytest
import pika

from .support import CHAIN_PATH, Receiver, connect, now_ms
from .support import RMQ4


@pytest.mark.brokers(*RMQ4, reason='message interceptors exist from 3.12 on')
def test_the_receiver_sees_the_stamp_of_the_original_publish(make_chain, run_gateway):
    chain = make_chain(max_level=3, resolution_ms=100)
    gateway = run_gateway(chain, *CHAIN_PATH)  # (every hop keeps the first stamp: levels and a meditation lap too)
    [said] = gateway.events("arrival_stamp")
    assert said["state"] == "on" and said["x_delay_counts_from"] == "arrival" and said["cancels"] == "exact", said
    assert gateway.events("arrival_stamp_off") == gateway.events("cancels_need_one_check_in_consumer") == []
    receiver = Receiver(chain)
    delays = [0, 450, 1200]  # now; the chain; a meditation lap (the chain holds 700 ms)
    window = {}
    with connect() as connection:
        channel = connection.channel()
        channel.confirm_delivery()
        for delay in delays:
            before = now_ms()
            channel.basic_publish(chain.names.check_in, f"stamp.{delay}", str(delay).encode(),
                                  pika.BasicProperties(headers={"x-delay": delay}), mandatory=True)
            window[delay] = (before, now_ms())  # the broker stamped it in between
    got = receiver.collect(len(delays), timeout=15)
    assert sorted(int(m.body) for m in got) == delays
    for m in got:
        delay = int(m.body)
        stamp = m.properties.headers["timestamp_in_ms"]
        first, last = window[delay]
        # The check-in arrival, kept through every hop: not re-stamped at pick-up.
        assert first <= stamp <= last, (delay, stamp, window[delay])
        assert m.at_ms >= stamp + delay  # never early, counted from the broker's own stamp
        assert m.properties.headers["x-delay"] == delay
