"""Withdrawing a rule, end to end on every suite broker: a withdrawn rule spares what it
selected that had not passed a gateway yet, and the gateways' tallies say what it removed
while it was live. (The test fails if withdrawing does nothing: the spared message would be
dropped as the distributor releases it.)"""

import json
import subprocess
import sys

import pika

from .support import GatewayProcess, ROOT, Receiver, broker_url, chain_args, connect, now_ms, publish_sentinel, \
    wait_until

CHAIN = dict(max_level=4, resolution_ms=250)  # the chain holds 3.75 s: longer waits lap meditation


def cli(chain, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gateway", *args, *chain_args(chain), "--url", broker_url()],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_a_withdrawn_rule_spares_what_had_not_passed_a_gateway_and_its_tally_is_kept(make_chain):
    chain = make_chain(**CHAIN)
    receiver = Receiver(chain)
    # Check-in (and returning from meditation) only: what falls out of the chain waits unread in
    # the distributor queue until a distributor starts, after the withdrawal.
    check_in = GatewayProcess(chain, "--role", "check-in", "--hold-within-ms", "0").wait_ready()
    distributor = None
    try:
        t0 = now_ms()
        with connect() as c:
            ch = c.channel()
            ch.confirm_delivery()
            for mid, due in (("spared", t0 + 3_000), ("gone", t0 + 60_000)):  # (gone laps meditation)
                ch.basic_publish(chain.names.check_in, f"jobs.{mid}", b"x", pika.BasicProperties(
                    message_id=mid, delivery_mode=2, headers={"x-deliver-at": due}), mandatory=True)
            ch.basic_publish(chain.names.rules, "", b"", pika.BasicProperties(
                headers={"x-cancel-key": "jobs.*", "x-cancel-rule": "jobs"}, delivery_mode=2), mandatory=True)
        # gone passes a gateway at its next lap, while the rule is live: removed, and tallied
        wait_until(lambda: check_in.metric("delay_gateway_cancelled_total", where="returning") >= 1, 30,
                   what="gone removed by the rule at its next lap")

        def removed() -> int:
            out = cli(chain, "pending", "rules", "--json")
            rows = [json.loads(line) for line in out.stdout.splitlines()]
            return sum(r["removed"] for r in rows if r["rule"] == "jobs")
        wait_until(lambda: removed() == 1, 30, 0.5, "the tally of the rule: one removed")
        out = cli(chain, "pending", "withdraw", "jobs")
        assert out.returncode == 0 and "withdrawn: rule jobs cancels nothing more; it removed 1 message(s)" \
            in out.stdout, out.stdout + out.stderr
        assert now_ms() > t0 + 3_000  # spared is due, in the distributor queue, not released
        distributor = GatewayProcess(chain, "--role", "distributor").wait_ready()
        publish_sentinel(chain, 3_000, absolute=False)
        arrived = [m.properties.message_id for m in receiver.until_sentinel(60)]
        assert arrived == ["spared"], arrived
    finally:
        for process in (check_in, distributor):
            if process is not None:
                process.terminate()
        receiver.close()
