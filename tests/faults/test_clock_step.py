"""Never early, under a clock step (every suite broker): the distributor holds 100 messages on
the shorter path (due in 6-9 s, the default hold), its host's wall clock steps 5 s forward
(libfaketime, re-reading its offset from a file), and none arrives before it is due on the
publisher's clock. Before 2026-11-28 the distributor timed its holds by the wall clock, and
100 of 100 arrived early, by up to 5 s; now it times them on a steady clock (flow.Flow)."""

import pika

from ..support import GatewayProcess, Receiver, clock_env, connect, now_ms, report_figures, wait_until

CHAIN = dict(max_level=4, resolution_ms=250)


def test_a_wall_clock_stepped_forward_releases_nothing_early(make_chain, tmp_path):
    chain = make_chain(**CHAIN)
    offset = tmp_path / "faketime"
    offset.write_text("+0s\n")
    receiver = Receiver(chain)
    gateway = GatewayProcess(chain, env=clock_env(file=str(offset))).wait_ready()
    try:
        t0 = now_ms()
        due = {f"m-{n}": t0 + 6_000 + n * 30 for n in range(100)}
        with connect() as c:
            ch = c.channel()
            ch.confirm_delivery()
            for mid, at in due.items():
                ch.basic_publish(chain.names.check_in, mid, b"x", pika.BasicProperties(
                    message_id=mid, delivery_mode=2, headers={"x-deliver-at": at}), mandatory=True)
        wait_until(lambda: gateway.metric("delay_gateway_held_messages", queue=chain.names.distributor) == 100, 30,
                   what="the distributor to hold all 100")
        assert now_ms() < t0 + 6_000, "too slow: some were due before the step"
        offset.write_text("+5s\n")  # the host's clock steps 5 s forward
        arrived = receiver.collect(100, 60)
        early = [m.at_ms - due[m.properties.message_id] for m in arrived if m.at_ms < due[m.properties.message_id]]
        late = [m.at_ms - due[m.properties.message_id] for m in arrived]
        report_figures("clock step", f"stepped +5 s while holding 100: arrived={len(arrived)} early={len(early)} "
                                     f"latest={max(late, default=0)} ms broker={chain.prefix}")
        assert len(arrived) == 100 and not early, early
    finally:
        gateway.terminate()
        receiver.close()
