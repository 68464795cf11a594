"""`delay-gateway move --to` against real brokers, at its worst moments: messages wait in an
old topology's levels, meditation, check-in (no gateway reading it) and its cancels; the move
is SIGKILLed (or loses its connection to the old cluster) just after the new cluster confirmed
a batch the old one never hears removed, and is run again to the end; a gateway on the
new topology delivers everything: nothing lost, nothing early, nothing cancelled, duplicates
only from the batch the kill interrupted. Between two prefixes of each suite broker (what
`--to-prefix` is for), and from RabbitMQ 3.10 to 4.3 (the blue-green upgrade)."""

import json
import os
import signal
import subprocess
import sys
import threading

import pika
import pytest

from .faults.proxy import Proxy
from .launcher import ROOT, chain_args
from .support import GatewayProcess, Receiver, broker_url, chains, connect, now_ms, publish_sentinel, \
    report_figures, wait_until

BATCH = 50
CARRIER = 20  # the old gateway's --carrier-messages: a batch takes whole carriers
CANCELLED = {f"m-{n}" for n in range(0, 400, 40)}
DELAYS = (5_000, 8_000, 12_000, 21_000)  # levels, and past the chain's 15.5 s: meditation


def publish(url, chain, ids, delay_of, sent_at, key="k") -> None:
    with connect(url) as c:
        ch = c.channel()
        ch.confirm_delivery()
        for message_id in ids:
            sent_at[message_id] = now_ms()
            ch.basic_publish(chain.names.check_in, f"{key}.{message_id}", message_id.encode(),
                             pika.BasicProperties(message_id=message_id, delivery_mode=2,
                                                  headers={"x-delay": delay_of(message_id)}), mandatory=True)


def cancel(url, chain, ids) -> None:
    with connect(url) as c:
        ch = c.channel()
        ch.confirm_delivery()
        for message_id in sorted(ids):
            ch.basic_publish(chain.names.cancel, "", b"", pika.BasicProperties(message_id=message_id, delivery_mode=2))


def cancel_group(url, chain, pattern) -> None:
    with connect(url) as c:
        ch = c.channel()
        ch.confirm_delivery()
        ch.basic_publish(chain.names.rules, "", b"", pika.BasicProperties(delivery_mode=2, headers={
            "x-cancel-key": pattern, "x-cancel-rule": "before-the-move"}))


def check_in_ready(url, chain) -> int:
    with connect(url) as c:
        return c.channel().queue_declare(chain.names.check_in, passive=True).method.message_count


def pending_total(url, chain) -> int:
    r = subprocess.run([sys.executable, "-m", "gateway", "pending", "count", "--json", "--url", url,
                        *chain_args(chain)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["total"]


class Move:
    """`delay-gateway move` in a subprocess; its progress lines on stderr are counted."""

    def __init__(self, old_url, old, new_url, new) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "move", "--url", old_url, *chain_args(old), "--to", new_url,
             "--to-prefix", new.prefix, "--batch", str(BATCH), "--json"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.progress, self.err = 0, []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.err.append(line.decode())
            self.progress += line.startswith(b"move: ")

    def finish(self, timeout: float = 240) -> dict:
        out, _ = self.proc.communicate(timeout=timeout)
        assert self.proc.returncode == 0, "".join(self.err[-5:])
        return json.loads(out)


def move_through_a_fault(old_url, old, new_url, new, chain_for_gateway, label, fault="kill") -> None:
    receiver = Receiver(new, url=new_url)
    old_receiver = Receiver(old, url=old_url)
    sent_at, delay = {}, {}
    ids = [f"m-{n}" for n in range(400)]
    for n, message_id in enumerate(ids):
        delay[message_id] = DELAYS[n % len(DELAYS)]
    gateway = GatewayProcess(old, "--carrier-messages", str(CARRIER), url=old_url).wait_ready()
    new_gateway = None
    try:
        publish(old_url, old, ids, delay.get, sent_at)
        grouped = [f"g-{n}" for n in range(5)]  # cancelled by a rule
        for message_id in grouped:
            delay[message_id] = 12_000
        publish(old_url, old, grouped, delay.get, sent_at, key="group")
        cancel(old_url, old, CANCELLED)
        cancel_group(old_url, old, "group.#")
        wait_until(lambda: gateway.metric("delay_gateway_cancels_total") >= len(CANCELLED) + 1
                   and gateway.metric("delay_gateway_messages_total", queue=old.names.check_in) >= len(ids)
                   + len(grouped) + len(CANCELLED) + 1, 60, 0.05, "every message and cancel read at the old check-in")
        gateway.terminate()
        # unread at the old check-in: messages, and a cancel behind them
        late = [f"c-{n}" for n in range(10)]
        for message_id in late:
            delay[message_id] = 7_000
        publish(old_url, old, late, delay.get, sent_at)
        cancel(old_url, old, {"c-3"})
        wait_until(lambda: check_in_ready(old_url, old) >= len(late) + 1, 30, 0.05, "the old check-in holding them")
        start = now_ms()
        # the worst moment: a batch confirmed by the new cluster, its removal from the old one
        # never heard (what the move sends the old cluster is dropped from then on)
        proxy = Proxy(old_url)
        done = old.names.waiting.encode()
        proxy.hold_at(bytes([len(done)]) + done + b"\x04done", 3)  # the third batch's done keys
        victim = Move(proxy.url, old, new_url, new)
        wait_until(lambda: proxy.dropped > 0 or victim.proc.poll() is not None, 120, 0.005,
                   "the move's third batch confirmed by the new cluster")
        assert victim.proc.poll() is None, "".join(victim.err)
        if fault == "kill":
            victim.proc.send_signal(signal.SIGKILL)
            victim.proc.wait()
        else:  # its connection to the old cluster lost: it stops by itself, in one line, and says to run again
            assert proxy.cut() >= 1
            assert victim.proc.wait(60) == 1
            wait_until(lambda: any("run again" in line for line in victim.err), 10, 0.01, "its last line")
            last = victim.err[-1]
            assert last.startswith("delay-gateway move: ") and "run again" in last, last
        proxy.close()
        outcome = Move(old_url, old, new_url, new).finish()
        took = now_ms() - start
        assert not outcome["left"], outcome
        assert outcome["cancels_carried"] >= len(CANCELLED) and outcome["rules_carried"] == 1, outcome
        # the list is right on both: nothing waits in the old cluster; what moved from its
        # chain waits in the new one's index, the batch moved twice twice (what moved unread
        # from check-in is indexed by the gateway that reads it there)
        assert pending_total(old_url, old) == 0
        listed = pending_total(new_url, new)
        assert listed >= len(ids) - len(CANCELLED), listed
        new_gateway = GatewayProcess(chain_for_gateway, url=new_url).wait_ready()
        cancelled = CANCELLED | {"c-3"} | set(grouped)
        wanted = set(sent_at) - cancelled
        wait_until(lambda: wanted <= {m.properties.message_id for m in receiver.take()}, 120, 0.01,
                   "every message not cancelled at the new pick-up")
        publish_sentinel(new, max(delay.values()), url=new_url)
        got = receiver.until_sentinel(90)
        got_ids = [m.properties.message_id for m in got]
        assert not set(got_ids) & cancelled, sorted(set(got_ids) & cancelled)
        assert set(got_ids) == wanted
        early = [m.properties.message_id for m in got if m.at_ms < sent_at[m.properties.message_id]
                 + delay[m.properties.message_id]]
        assert not early, early
        duplicates = len(got_ids) - len(set(got_ids))
        assert duplicates <= BATCH + CARRIER, duplicates
        assert listed - (len(ids) - len(CANCELLED)) <= duplicates, (listed, duplicates)
        assert not old_receiver.take(), "delivered on the old cluster: its gateway was stopped"
        report_figures("move to another cluster", f"{label} moved={outcome['moved']} took_ms={took} "
                                                  f"passes={outcome['passes']} duplicates={duplicates}")
    finally:
        for g in (gateway, new_gateway):
            if g is not None and g.proc.poll() is None:
                g.terminate()
        receiver.close()
        old_receiver.close()


@pytest.mark.parametrize("fault", ["kill", "cut"])
def test_move_to_another_prefix_through_a_kill_or_a_cut(make_chain, broker, fault, request):
    old = make_chain(max_level=5, resolution_ms=500)
    new = make_chain(max_level=5, resolution_ms=500)
    url = broker_url()
    move_through_a_fault(url, old, url, new, new, f"{fault} broker={request.node.callspec.params['broker']}", fault)


@pytest.mark.brokers("rmq3.10", reason="the upgrade users make: from the old cluster on 3.10 to a new one on 4.3")
def test_move_from_rabbitmq_3_10_to_4_3(make_chain, broker, private_broker):
    target = private_broker("rmq4.3").url
    old = make_chain(max_level=5, resolution_ms=500)
    with chains(target) as make_new:
        new = make_new(max_level=5, resolution_ms=500, prefix=old.prefix)
        move_through_a_fault(broker_url(), old, target, new, new, "kill 3.10->4.3")
