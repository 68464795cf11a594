"""Group cancels (rules) end to end, on every suite broker (3.10 without the arrival stamp,
4.3 with it): a rule published while no gateway runs cancels exactly its group, wherever its
messages are (unread in check-in, held by the distributor, moved from the plugin, lapping
meditation for 200 days), through a SIGKILL of the gateway or its connections cut the moment
check-in has read the rule; bystanders with near keys (orders.421) and messages published
after the rule arrive, none early. `pending cancel` refuses what it must, `pending rules`
shows the rule, `pending withdraw` ends one, and an AMQP client publishes one with headers."""

import json
import subprocess
import sys
from typing import Dict, List

import pika
import pytest

from gateway.broker.plumbing import lazy_properties
from gateway.broker.tools.plugin_table import PluginMessage
from gateway.commands import move
from gateway.core import cancels
from gateway.core.wire import Properties

from .faults.proxy import Proxy
from .support import SENTINEL, GatewayProcess, ROOT, Receiver, broker_url, chain_args, connect, now_ms, \
    parked_report, report_figures, wait_until

DAY_MS = 86_400_000
CHAIN = dict(max_level=4, resolution_ms=250)  # the chain holds 3.75 s; longer waits lap meditation (3.75 s laps)


def cli(chain, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gateway", *args, *chain_args(chain), "--url", broker_url()],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def listed(chain, *filters: str) -> List[dict]:
    r = cli(chain, "pending", "list", "--json", "--limit", "0", *filters)
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in r.stdout.splitlines()]


def publish(chain, messages) -> None:
    """(routing key, message id or None, due epoch ms), confirmed, in order, to check-in."""
    with connect() as c:
        ch = c.channel()
        ch.confirm_delivery()
        for key, mid, due in messages:
            ch.basic_publish(chain.names.check_in, key, b"body-" + key.encode(), pika.BasicProperties(
                message_id=mid, delivery_mode=2, headers={"x-deliver-at": due}), mandatory=True)


def move_from_plugin(chain, messages) -> None:
    """(routing key, message id, due epoch ms) into the distributor as move-from-plugin puts
    them there: the gateway's format, a negative read time."""
    read = cancels.Sequencer()
    entries = [PluginMessage(due, key.encode(), Properties.build(message_id=mid.encode(), delivery_mode=2).raw,
                             b"moved", f"ref-{n}") for n, (key, mid, due) in enumerate(messages)]
    with connect() as c:
        ch = c.channel()
        ch.confirm_delivery()
        for exchange, key, props, body in move.outgoing(move.held_as_gateway(entries, read, now_ms()),
                                                        chain.names.distributor):
            ch.basic_publish(exchange, key, body, lazy_properties.WireProperties(props), mandatory=True)


@pytest.mark.parametrize("fault", ["kill", "cut"])
def test_a_rule_published_while_no_gateway_runs_cancels_exactly_its_group(make_chain, fault, request):
    chain = make_chain(**CHAIN)
    proxy = Proxy(broker_url())
    receiver = Receiver(chain)
    args = ("--carrier-wait-ms", "100")
    first = GatewayProcess(chain, *args, url=proxy.url).wait_ready()
    gateways = [first]
    t0 = now_ms()
    try:
        # Before the rule: 200 days away (lapping meditation), and moved from the plugin (held
        # by the distributor, unacknowledged, until the gateway dies).
        far = [(f"orders.42.far.{n}", f"42-far-{n}", t0 + 200 * DAY_MS) for n in range(20)] + \
              [(f"orders.421.far.{n}", f"421-far-{n}", t0 + 200 * DAY_MS) for n in range(5)]
        publish(chain, far)
        moved = [(f"orders.42.moved.{n}", f"42-moved-{n}", t0 + 16_000) for n in range(10)] + \
                [(f"orders.421.moved.{n}", f"421-moved-{n}", t0 + 16_000) for n in range(5)]
        move_from_plugin(chain, moved)
        wait_until(lambda: first.metric("delay_gateway_held_messages") >= len(moved)
                   and first.metric("delay_gateway_batched_messages_total", queue=chain.names.check_in) >= len(far),
                   30, 0.1, "the far ones sent round meditation and the moved ones held")
        first.kill()  # no gateway runs from here
        group = [(f"orders.42.{n}", f"42-{n}" if n < 90 else None, t0 + 12_000) for n in range(100)]
        near = [(f"orders.421.{n}", f"421-{n}", t0 + 12_000) for n in range(100)]
        publish(chain, [m for pair in zip(group, near, strict=True) for m in pair])
        queued = cli(chain, "pending", "cancel", "--key", "orders.42.#", "--yes", "--wait", "0.5",
                     "--name", "customer-42")
        assert queued.returncode == 0 and "queued: no gateway recorded rule customer-42" in queued.stdout, \
            queued.stdout + queued.stderr
        assert "message(s) wait in check-in, not read by a gateway yet" in queued.stdout  # said, not hidden
        after = [(f"orders.42.after.{n}", f"42-after-{n}", t0 + 12_000) for n in range(10)]  # a reschedule
        sentinel = [("orders.zz.sentinel", SENTINEL, t0 + 20_000)]  # due after everything else
        publish(chain, after + sentinel)

        second = GatewayProcess(chain, *args, url=proxy.url)
        gateways.append(second)
        # The worst moment: check-in has read the rule, its record may or may not be confirmed.
        wait_until(lambda: second.metric("delay_gateway_cancels_total") >= 1, 30, 0.005, "check-in read the rule")
        if fault == "kill":
            second.kill()
            gateways.append(GatewayProcess(chain, *args, url=proxy.url))
        else:
            assert proxy.cut() >= 1
        receiver.until_sentinel(max(0, t0 + 20_000 - now_ms()) / 1000 + 30)  # (not kept among the messages)
        got = receiver.messages
        arrived: Dict[str, int] = {}
        for m in got:
            key = m.routing_key
            arrived[key] = arrived.get(key, 0) + 1
            due = t0 + 16_000 if ".moved." in key else t0 + 12_000
            assert m.at_ms >= due, f"{key} early by {due - m.at_ms} ms"
        cancelled = [k for k in arrived if k.startswith("orders.42.") and ".after." not in k]
        expected = {k for k, _, _ in near + after} | {k for k, _, _ in moved if k.startswith("orders.421.")}
        assert not cancelled, f"cancelled by the rule but delivered: {sorted(cancelled)[:10]}"
        assert expected <= set(arrived), f"lost: {sorted(expected - set(arrived))[:10]}"
        # the far ones of the group are dropped at the end of their lap; the bystanders wait on
        wait_until(lambda: not listed(chain, "--key", "orders.42.far.#"), 30, 0.5, "the far ones of 42 removed")
        # (a message a fault copied is in the broker twice, each copy listed, as each would be
        # delivered: the first gateway's kill and this test's fault can each copy the far ones
        # of a lap under way, so each is there at most three times)
        waiting = [r["message_id"] for r in listed(chain, "--key", "orders.421.far.#")]
        assert set(waiting) == {mid for _, mid, _ in far[20:]} and len(waiting) <= 3 * 5, waiting
        [rule] = [json.loads(line) for line in cli(chain, "pending", "rules", "--json").stdout.splitlines()]
        assert rule["rule"] == "customer-42" and rule["filter"] == "--key orders.42.#"
        dropped = sum(g.metric("delay_gateway_cancelled_total") for g in gateways[-1:])
        duplicates = sum(n - 1 for n in arrived.values())
        report_figures("rule figures", f"rule-{fault} broker={request.node.callspec.params['broker']} group=130 "
                                       f"bystanders={len(near) + 10} cancelled_delivered=0 lost=0 "
                                       f"duplicates={duplicates} removed_reported={rule['removed']} "
                                       f"dropped_by_last_gateway={dropped:g}")
    finally:
        for g in gateways:
            if g.proc.poll() is None:
                g.terminate()
        receiver.close()
        proxy.close()


def test_pending_cancel_refuses_no_filter_without_all_and_a_count_it_did_not_expect(make_chain, run_gateway):
    # (a chain that holds 10 minutes: no lap of meditation ends while a count reads, which may
    # list a message twice: its lap's entry and the next one, docs/operating.md)
    chain = make_chain(max_level=10, resolution_ms=1000)
    run_gateway(chain)
    t0 = now_ms()
    publish(chain, [(f"orders.{n}", f"m-{n}", t0 + 600_000) for n in range(3)])
    # (exactly: --expect is refused while a beat says check-in holds messages it read)
    wait_until(lambda: (c := json.loads(cli(chain, "pending", "count", "--json").stdout))["total"] == 3
               and c["exact"], 15, 0.2, "the three in the index, exactly")
    bare = cli(chain, "pending", "cancel", "--yes")
    assert bare.returncode == 2 and bare.stdout == "" and bare.stderr.count("\n") == 1, bare
    assert "add --all to mean it" in bare.stderr
    preview = cli(chain, "pending", "cancel")
    assert preview.returncode == 0 and "add --all --yes to cancel every waiting message" in preview.stdout
    wrong = cli(chain, "pending", "cancel", "--key", "orders.*", "--expect", "2", "--yes")
    assert wrong.returncode == 2 and "3 waiting message(s) match, not 2 (--expect): nothing cancelled" in wrong.stderr
    assert len(listed(chain)) == 3 and cli(chain, "pending", "rules").stdout.startswith("no live rule")
    done = cli(chain, "pending", "cancel", "--all", "--expect", "3", "--yes", "--name", "everything")
    assert done.returncode == 0 and "recorded at" in done.stdout, done.stdout + done.stderr
    assert listed(chain) == []  # gone from the list as soon as the rule is recorded
    publish(chain, [("orders.new", "new", t0 + 600_000)])  # after the rule: not affected
    wait_until(lambda: [r["message_id"] for r in listed(chain)] == ["new"], 15, 0.2, "the new one listed")


def test_a_rule_withdrawn_cancels_nothing_more_and_an_amqp_client_publishes_one(make_chain, run_gateway):
    """A client's own publish (headers on <prefix>.rules) is a rule like the CLI's; withdrawn,
    it removes nothing more: each message it selected was either dropped as it passed a
    gateway while the rule was live, or arrives. The same rule sent to <prefix>.cancel (the
    right to cancel one's own ids) is parked with the reason and cancels nothing."""
    chain = make_chain(**CHAIN)
    gateway = run_gateway(chain)
    receiver = Receiver(chain)
    t0 = now_ms()
    due = t0 + 20_000  # (a listing or two before the rule, each a Python start and stream reads on a busy machine)
    publish(chain, [("jobs.a", "a", due), ("jobs.b", "b", due)])
    wait_until(lambda: len(listed(chain)) == 2, 15, 0.2, "both in the index")

    def client_rule(exchange: str) -> None:
        with connect() as c:
            ch = c.channel()
            ch.confirm_delivery()
            ch.basic_publish(exchange, "", b"", pika.BasicProperties(message_id="set-by-the-client", headers={
                "x-cancel-key": "jobs.*", "x-cancel-rule": "client-rule"}, delivery_mode=2), mandatory=True)
    client_rule(chain.names.cancel)
    [parked] = parked_report(chain)["messages"]
    assert parked["message_id"] == "set-by-the-client" and f"goes to {chain.names.rules!r}" in parked["reason"], parked
    # check-in has dealt with it: nothing recorded, no rule held, nothing cancelled
    assert gateway.metric("delay_gateway_cancels_total") == 0 and gateway.metric("delay_gateway_rules_held") == 0
    assert gateway.metric("delay_gateway_cancelled_total") == 0
    client_rule(chain.names.rules)
    [recorded] = wait_until(lambda: gateway.events("rule_recorded"), 15, 0.05, "the client's rule recorded")
    assert recorded["rule"] == "client-rule" and recorded["cancelled_us"] // 1000 < due, \
        ("too slow: the rule was recorded only once a and b were due", recorded, due)
    wait_until(lambda: listed(chain) == [], 15, 0.2, "both cancelled by the client's rule")
    out = cli(chain, "pending", "withdraw", "client-rule")
    assert out.returncode == 0 and out.stdout.startswith("withdrawn: rule client-rule cancels nothing more"), \
        out.stdout + out.stderr
    assert cli(chain, "pending", "rules").stdout.startswith("no live rule")
    publish(chain, [("jobs.c", "c", due + 2000)])  # (due after a and b)
    got = wait_until(lambda: [m.properties.message_id for m in receiver.take() if m.properties.message_id == "c"],
                     40, 0.2, "c, published after the withdrawal")
    arrived = {m.properties.message_id for m in receiver.messages} & {"a", "b"}
    dropped = gateway.metric("delay_gateway_cancelled_total")
    assert got and len(arrived) + dropped == 2, (arrived, dropped)
    assert parked_report(chain)["count"] == 1  # only the rule sent to the wrong exchange
    receiver.close()
