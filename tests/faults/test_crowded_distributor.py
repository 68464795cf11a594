"""What falls due never waits behind what the distributor holds (every suite broker): its
prefetch (20 deliveries here) fills with messages held on the shorter path (40, due in 9 s,
each alone in its delivery); messages published after them and due in 1.5 s still arrive
first. Each held delivery keeps its place of the prefetch: before 2026-11-28 the broker sent
the distributor nothing more until a held one was released, and the later messages arrived
with the held ones, seconds late. Now, once held deliveries take nine tenths of the prefetch,
a message due later than two units goes back into the chain instead of being held."""

import pika

from ..support import GatewayProcess, Receiver, connect, now_ms, report_figures, wait_until

CHAIN = dict(max_level=4, resolution_ms=250)


def publish(chain, messages) -> None:
    with connect() as c:
        ch = c.channel()
        ch.confirm_delivery()
        for key, due in messages:
            ch.basic_publish(chain.names.check_in, key, b"x", pika.BasicProperties(
                message_id=key, delivery_mode=2, headers={"x-deliver-at": due}), mandatory=True)


def test_what_falls_due_is_released_while_the_prefetch_is_full_of_held_messages(make_chain):
    chain = make_chain(**CHAIN)
    receiver = Receiver(chain)
    gateway = GatewayProcess(chain, "--distributor-prefetch", "20", "--carrier-messages", "1").wait_ready()
    try:
        t0 = now_ms()
        held = [(f"held.{n}", t0 + 9_000) for n in range(40)]
        publish(chain, held)
        wait_until(lambda: gateway.metric("delay_gateway_held_deliveries", queue=chain.names.distributor) >= 18, 30,
                   what="the distributor's prefetch nearly full of held deliveries")
        assert gateway.metric("delay_gateway_held_deliveries", queue=chain.names.distributor) <= 20
        soon_at = now_ms() + 1_500
        soon = [(f"soon.{n}", soon_at) for n in range(10)]
        publish(chain, soon)
        arrived = receiver.collect(50, 60)
        order = [m.routing_key.split(".")[0] for m in arrived]
        lateness = [m.at_ms - soon_at for m in arrived if m.routing_key.startswith("soon.")]
        report_figures("crowded distributor", f"held 40 (prefetch 20): the 10 due sooner arrived "
                                              f"{min(lateness, default=-1)}-{max(lateness, default=-1)} ms late, "
                                              f"{order.index('held') if 'held' in order else -1} before the first "
                                              "held one")
        assert len(arrived) == 50 and order[:10] == ["soon"] * 10, order
        assert all(m.at_ms >= soon_at for m in arrived[:10]) and all(m.at_ms >= t0 + 9_000 for m in arrived[10:])
    finally:
        gateway.terminate()
        receiver.close()
