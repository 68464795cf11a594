"""The delay vocabularies of other schedulers over AMQP 0.9.1, on every suite broker:
Tanzu's and AMQP 1.0's `x-opt-delivery-delay` / `x-opt-delivery-time` and Service Bus's
`x-opt-scheduled-enqueue-time` as headers are honoured like `x-delay` / `x-deliver-at`
(never early), and two that disagree park the message with the reason. (The same as AMQP
1.0 annotations: tests/test_amqp10.py, on 4.x.)"""

import pika

from .support import Receiver, connect, now_ms, parked_report, publish_sentinel


def test_other_schedulers_headers_delay_the_message_and_disagreeing_ones_park_it(make_chain, run_gateway):
    chain = make_chain(max_level=4, resolution_ms=100)
    run_gateway(chain)
    receiver = Receiver(chain)
    sent = now_ms()
    cases = {"opt-delay": {"x-opt-delivery-delay": 1200},
             "opt-time": {"x-opt-delivery-time": sent + 1200},
             "service-bus": {"x-opt-scheduled-enqueue-time": sent + 1200},
             "disagree": {"x-delay": 1200, "x-opt-delivery-time": sent + 3_600_000}}
    with connect() as c:
        ch = c.channel()
        ch.confirm_delivery()
        for mid, headers in cases.items():
            ch.basic_publish(chain.names.check_in, "k", mid.encode(), pika.BasicProperties(
                message_id=mid, headers=headers, delivery_mode=2), mandatory=True)
    publish_sentinel(chain, 1200)  # once it came, the disagreeing one cannot come any more
    got = receiver.until_sentinel(15)
    assert sorted(m.properties.message_id for m in got) == ["opt-delay", "opt-time", "service-bus"], got
    assert all(m.at_ms >= sent + 1200 for m in got), [(m.properties.message_id, m.at_ms - sent) for m in got]
    [parked] = parked_report(chain)["messages"]
    assert parked["message_id"] == "disagree" and "x-delay and x-opt-delivery-time disagree by" in parked["reason"]
