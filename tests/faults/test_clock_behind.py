"""A replacement whose clock is behind cannot put messages after a rule (every suite broker:
3.10 has no arrival stamp, so read times decide there; 4.3 stamps).

One gateway consumes check-in at a time. It reads twenty messages and forwards them, and is
SIGKILLed; a rule selecting them is published; a gateway whose host clock is 10 s behind
(libfaketime) takes over. Before 2026-11-28 it recorded the rule with a read time below the
messages' (its clock said so), and all twenty were delivered. Now every check-in process
reserves its read times in the cancellations stream before it hands them out, and a new one
starts above every reservation: the rule comes after them, whatever the clocks say."""

import pika

from ..support import GatewayProcess, Receiver, clock_env, connect, now_ms, publish_sentinel, wait_until

CHAIN = dict(max_level=4, resolution_ms=250)  # the chain holds 3.75 s: longer waits lap meditation


def test_a_replacement_whose_clock_is_behind_cannot_undo_a_rule(make_chain, broker_ctl):
    chain = make_chain(**CHAIN)
    receiver = Receiver(chain)
    started = []

    def in_check_in() -> int:
        for line in broker_ctl("list_queues", "-q", "--no-table-headers", "name", "messages").splitlines():
            name, _, count = line.strip().rpartition("\t")
            if name == chain.names.check_in:
                return int(count)
        raise AssertionError(f"no queue {chain.names.check_in}")

    try:
        first = GatewayProcess(chain, "--role", "check-in").wait_ready()
        started.append(first)
        due = now_ms() + 6_000
        with connect() as c:
            ch = c.channel()
            ch.confirm_delivery()
            for key in [f"clock.{n}" for n in range(20)] + [f"other.{n}" for n in range(5)]:
                ch.basic_publish(chain.names.check_in, key, b"x", pika.BasicProperties(
                    message_id=key, delivery_mode=2, headers={"x-deliver-at": due}), mandatory=True)
        # every one read, sent on and acknowledged (none comes back to be read again), then SIGKILL
        wait_until(lambda: in_check_in() == 0, 30, what="check-in to acknowledge all 25")
        first.kill()
        with connect() as c:
            ch = c.channel()
            ch.confirm_delivery()
            ch.basic_publish(chain.names.rules, "", b"", pika.BasicProperties(
                headers={"x-cancel-key": "clock.#"}, delivery_mode=2), mandatory=True)
        behind = GatewayProcess(chain, env=clock_env("-10s")).wait_ready()
        started.append(behind)
        publish_sentinel(chain, due + 1000, absolute=True)
        arrived = sorted(m.routing_key for m in receiver.until_sentinel(60))
        assert arrived == [f"other.{n}" for n in range(5)]
        assert all(m.at_ms >= due for m in receiver.messages)
    finally:
        for process in started:
            process.terminate()
        receiver.close()
