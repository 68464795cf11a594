import pika

from .support import Receiver, connect, now_ms


def test_a_delayed_message_arrives_on_time(make_chain, run_gateway):
    chain = make_chain(max_level=3, resolution_ms=100)
    run_gateway(chain)
    receiver = Receiver(chain)
    with connect() as c:
        ch = c.channel()
        ch.confirm_delivery()
        sent = now_ms()
        ch.basic_publish(chain.names.check_in, "a.b", b"hi", pika.BasicProperties(headers={"x-delay": 450}),
                         mandatory=True)
    [m] = receiver.collect(1, timeout=10)
    assert m.body == b"hi" and m.routing_key == "a.b"
    assert m.at_ms - sent >= 450
