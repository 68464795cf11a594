"""`delay-gateway move-from-plugin` against a private node holding tables of the plugin's
shape (tests/plugin_shape.py): 4,000 waiting messages of mixed due times moved with none
lost, none early and their properties intact, through a SIGKILL at the worst moment (the
batch confirmed, its removal from the plugin's table under way) and a run again, and then
listed by `pending`; through a cut connection; the dry run's counts equal what moves. The
refusals: no plugin table, a table of another shape, a Khepri broker, no gateway topology.

On 3.10 (the plugin's `#delivery{}`) and 4.0 when the run includes it (a message
container); on 4.3, where the plugin cannot run, the refusal. About 60 s a version."""

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from typing import Dict, List, Tuple

import pytest

from gateway.core import envelope, wire

from .. import plugin_shape
from ..support import SENTINEL, GatewayProcess, connect, publish_sentinel, report_figures, same_entries, wait_until
from .nodes import CTL

# The mover moves in due order: the near messages (delivered, and checked as they arrive) go
# in its first batches, the far ones (counted where they wait) after them.
NEAR, FAR = 1_000, 3_000  # (near ones first: a batch of them is the one the kill interrupts)
BATCH = 1000
CUT_BATCH = 1500
# The near messages are due from this long after the test fills the tables, over NEAR_SPAN_MS:
# on a busy machine filling and two runs of the mover take a while (CI measured 92 messages
# a second; a machine busier still, 40: 4,000 messages in 100 s, of which the near ones come
# first), and what is due within the mover's --leave-due-within-ms when it reads it is left
# to the plugin, not there to deliver it.
NEAR_FROM_MS, NEAR_SPAN_MS = 45_000, 10_000
LEAVE = ("--leave-due-within-ms", "1000")
CANCELLED = {"m-3", "m-4", "m-900"}  # near ones, cancelled before the move
EXCHANGE = "plugin.delayed"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# What publishers send through the plugin: headers of every AMQP type the gateway keeps
# exactly, and the other properties; the table's entries use them in turn. (A moved message
# counts as published at its due time less its x-delay: 60 s puts every near one's publish
# before the test fills the tables, as a real one's would be.)
TEMPLATES = [
    wire.Properties.build(content_type=b"application/json", delivery_mode=2, headers=wire.Table([
        wire.long("x-delay", 60_000), wire.longstr("tenant", b"acme"),
        wire.TableField(b"short", b"s", (-7).to_bytes(2, "big", signed=True)),
        wire.TableField(b"flag", b"t", b"\x01")])),
    wire.Properties.build(priority=3, correlation_id=b"corr-1", reply_to=b"replies", timestamp=1_700_000_000,
                          type=b"reminder", app_id=b"shop", expiration=b"86400000", delivery_mode=2),
    wire.Properties.build(content_encoding=b"gzip", user_id=b"guest", cluster_id=b"c1",
                          headers=wire.Table([wire.long("x-delay", 3_600_000)])),
]
KEYS = ["order.reminder", "", "kl\u00fcck.\u00e9"]


def ctl_of(node) -> Tuple[List[str], Dict[str, str]]:
    return node.runtime.command([CTL, "-n", node.node], node.env())


def evaluator(node):
    argv, env = ctl_of(node)

    def run(program: str) -> str:
        r = subprocess.run(argv + ["eval", program], capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout
    return run


def mover(node, chain, *extra: str) -> subprocess.Popen:
    argv, env = ctl_of(node)
    return subprocess.Popen(
        [sys.executable, "-m", "gateway", "move-from-plugin", "--url", node.url, "--prefix", chain.prefix,
         "--rabbitmqctl", shlex.join(argv), "--batch", str(BATCH), "--json", *extra],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def move(node, chain, *extra: str, timeout: float = 300) -> Tuple[int, dict, str]:
    p = mover(node, chain, *extra)
    out, err = p.communicate(timeout=timeout)
    return p.returncode, (json.loads(out) if p.returncode == 0 and out.strip() else {}), err


@pytest.fixture
def plugin_tables(own_node):
    """The node's plugin-shaped tables, created empty; dropped after the test."""
    run = evaluator(own_node)
    with connect(own_node.url) as c:
        c.channel().exchange_declare(EXCHANGE, "topic", durable=True)
    yield run
    run('[mnesia:delete_table(T) || T <- mnesia:system_info(tables), '
        'lists:prefix("rabbit_delayed_message", atom_to_list(T))].')


def removal_under_way(pgid: int) -> bool:
    """Whether the mover's rabbitmqctl is running a removal (its batch confirmed)."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if os.getpgid(int(pid)) != pgid:
                continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"mnesia:transaction" in f.read():
                    return True
        except (OSError, ProcessLookupError):
            continue
    return False


@pytest.mark.brokers("rmq3.10", "rmq4.0", reason="the plugin runs up to 4.2; 4.3 has its refusal below")
def test_every_waiting_message_moves_through_a_kill(own_node, node_chain, plugin_tables):
    chain = node_chain()
    plugin_shape.create(plugin_tables)
    with connect(own_node.url) as c:
        ch = c.channel()
        queue = ch.queue_declare("", durable=True).method.queue
        ch.queue_bind(queue, chain.names.pick_up, "#")
    # The gateway first: on a busy machine its start takes a while, and the near messages
    # must still be more than the mover's 10 s from due when it reads them (or it leaves
    # them to the plugin, which is not there to deliver them).
    gateway = GatewayProcess(chain, url=own_node.url).wait_ready()
    start = int(time.time() * 1000)
    near = [(start + NEAR_FROM_MS + (i * 7919) % NEAR_SPAN_MS, i % 3, KEYS[i % 3]) for i in range(NEAR)]
    far = [(start + 2 * 3_600_000 + i * 86_400_000, i % 3, KEYS[i % 3]) for i in range(FAR)]
    plugin_shape.fill(plugin_tables, "/", EXCHANGE, [t.raw for t in TEMPLATES], near + far)
    due = {f"m-{i}": d for i, (d, _, _) in enumerate(near + far)}
    try:
        # SIGKILL once a batch is confirmed and its removal from the plugin's table has begun
        # (the one window that can duplicate), then run again to the end. (A busy machine may
        # see a later batch's removal first: still one of the near ones.)
        # Cancels sent to the gateway before the move: the plugin's messages were published
        # before them, so they apply (docs/migrating-from-the-plugin.md).
        cancel = subprocess.run([sys.executable, "-m", "gateway", "cancel", "--url", own_node.url, "--prefix",
                                 chain.prefix, *CANCELLED], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert cancel.returncode == 0 and cancel.stdout.count(": cancelled at ") == len(CANCELLED), cancel
        first = mover(own_node, chain, *LEAVE)
        pgid = os.getpgid(first.pid)
        wait_until(lambda: first.poll() is not None or removal_under_way(pgid), 120, 0.001,
                   "the first removal")
        assert first.poll() is None, first.communicate()
        os.killpg(pgid, signal.SIGKILL)
        first.wait()
        code, moved, err = move(own_node, chain, *LEAVE)
        assert code == 0, err
        # due after the last near one (the cancelled ones too) by more than the lead and a unit
        publish_sentinel(chain, max(at for at, _, _ in near), absolute=True, url=own_node.url)
        got = receive(own_node.url, queue, set(due) - {f"m-{NEAR + i}" for i in range(FAR)} - CANCELLED,
                      timeout=max(30.0, (start + NEAR_FROM_MS + NEAR_SPAN_MS) / 1000 - time.time() + 90))
        held = status_total(own_node, chain)
        waiting = pending_ids(own_node, chain)
    finally:
        gateway.terminate()
    ids = [m for m, _, _, _ in got]
    lost = sorted(set(due) - set(ids) - {f"m-{NEAR + i}" for i in range(FAR)} - CANCELLED, key=lambda s: int(s[2:]))
    early = [(m, at - due[m]) for m, at, _, _ in got if at < due[m]]
    duplicates = len(ids) - len(set(ids))
    late = sorted(at - due[m] for m, at, _, _ in got)
    report_figures("move figures", f"move-from-plugin broker={own_node.runtime.label} waiting={NEAR + FAR} "
                   f"moved_after_kill={moved['moved']} per_second={moved['per_second']} lost={len(lost)} "
                   f"early={len(early)} duplicates={duplicates} chain_holds={held} "
                   f"late_p50_ms={late[len(late) // 2]} late_max_ms={late[-1]}")
    assert not lost, f"{len(lost)} lost: {lost[:10]}"
    assert not CANCELLED & set(ids), sorted(CANCELLED & set(ids))
    assert not early, early[:10]
    assert duplicates <= BATCH
    # the far ones wait in the chain, listed by id, each once unless the kill was in their batch
    assert set(waiting) == {f"m-{NEAR + i}" for i in range(FAR)}
    assert FAR <= held <= FAR + BATCH - duplicates and FAR <= len(waiting) <= FAR + BATCH - duplicates, \
        (held, len(waiting))
    assert moved["left_to_plugin"] == 0 and moved["still_movable"] == 0, moved
    for mid, _, props, body in got:
        assert body == f"body-{mid}".encode()
        # as the publisher sent it through the plugin, but user_id (the broker checks it
        # against the gateway's own login)
        sent = envelope.for_pick_up(TEMPLATES[int(mid[2:]) % 3].replace(message_id=mid.encode()))
        assert without_headers(props.wire) == without_headers(sent), mid
        assert same_entries(props.wire.headers, sent.headers), (mid, props.wire.headers, sent.headers)


def without_headers(props: wire.Properties) -> dict:
    return {k: v for k, v in props.values.items() if k != "headers"}


def receive(url: str, queue: str, expected: set, timeout: float) -> List[tuple]:
    """(message id, arrival ms, properties, body) of what arrives until every expected id
    and the sentinel have (the sentinel is not kept): due after all of them, and after the
    cancelled ones, it says that no more copies, and no cancelled one, can come."""
    got: List[tuple] = []
    seen: set = set()

    def arrived(channel, method, props, body) -> None:
        seen.add(props.message_id)
        if props.message_id != SENTINEL:
            got.append((props.message_id, int(time.time() * 1000), props, body))
    with connect(url) as c:
        ch = c.channel()
        ch.basic_qos(prefetch_count=500)
        tag = ch.basic_consume(queue, arrived, auto_ack=True)
        # (the connection's sleep delivers to `arrived`; what did not come is counted after)
        wait_until(lambda: SENTINEL in seen and expected <= seen, timeout, sleep=c.sleep, fail=False)
        ch.basic_cancel(tag)
    return got


def status_total(node, chain) -> int:
    r = subprocess.run([sys.executable, "-m", "gateway", "status", "--url", node.url, "--prefix", chain.prefix,
                        "--json"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["total"]


@pytest.mark.brokers("rmq3.10", "rmq4.0", reason="the plugin runs up to 4.2")
def test_a_lost_connection_moves_nothing_twice_but_the_batch_and_loses_nothing(own_node, node_chain,
                                                                              plugin_tables):
    """The connection cut while a batch is being published: the command stops (exit 1) with
    that batch still in the plugin's table; run again, everything waits in the gateway, the
    cut batch at most twice; the dry run before counts exactly what moves. (Due in hours:
    where they wait is checked, with `pending list` and `status`; delivery and its timing
    are the test above's.)"""
    from .proxy import Proxy
    chain = node_chain()
    plugin_shape.create(plugin_tables)
    start = int(time.time() * 1000)
    messages = [(start + 7_200_000 + (i * 7919) % 600_000, i % 3, KEYS[i % 3]) for i in range(2 * CUT_BATCH)]
    plugin_shape.fill(plugin_tables, "/", EXCHANGE, [t.raw for t in TEMPLATES], messages)
    expected = {f"m-{i}" for i in range(len(messages))}
    gateway = GatewayProcess(chain, url=own_node.url).wait_ready()
    code, dry, err = move(own_node, chain, "--dry-run")
    assert code == 0, err
    assert dry["would_move"] == len(messages) and dry["left_to_plugin"] == 0, dry
    assert dry["by_due"]["from 1 h to 1 day"] == len(messages), dry
    proxy = Proxy(own_node.url)
    # its second connection publishes the first batch (the first checked the topology): cut
    # some 200 messages into it, where nothing of the batch is confirmed yet
    proxy.cut_at(2, 100_000)
    try:
        argv, env = ctl_of(own_node)
        first = subprocess.Popen(
            [sys.executable, "-m", "gateway", "move-from-plugin", "--url", proxy.url, "--prefix", chain.prefix,
             "--rabbitmqctl", shlex.join(argv), "--batch", str(CUT_BATCH)],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _, err = first.communicate(timeout=120)
        assert first.returncode == 1, err
        assert "run again" in err and len(err.strip().splitlines()) == 1, err
        code, moved, err = move(own_node, chain)
        assert code == 0, err
        assert moved["left_to_plugin"] == 0 and moved["still_movable"] == 0, moved
        ids: List[str] = []

        def all_listed() -> bool:
            ids[:] = pending_ids(own_node, chain)
            return expected <= set(ids)
        wait_until(all_listed, 60, 0.5, "every moved message listed as waiting")
        held = status_total(own_node, chain)
    finally:
        gateway.terminate()
        proxy.close()
    report_figures("move figures", f"move-from-plugin-connection-cut broker={own_node.runtime.label} "
                   f"waiting={len(messages)} moved_on_rerun={moved['moved']} listed={len(ids)} held={held}")
    assert set(ids) == expected
    assert len(messages) <= held <= len(messages) + CUT_BATCH, held


def pending_ids(node, chain) -> List[str]:
    r = subprocess.run([sys.executable, "-m", "gateway", "pending", "list", "--url", node.url, "--prefix",
                        chain.prefix, "--json", "--limit", "0"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return [json.loads(line)["message_id"] for line in r.stdout.splitlines() if line.strip()]


def refusal(node, chain) -> str:
    code, _, err = move(node, chain, "--dry-run")
    assert code == 3, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.brokers("rmq3.10", "rmq4.0", reason="4.3 refuses for Khepri, below")
def test_without_the_plugin_it_refuses(own_node, node_chain):
    assert "no table of the delayed-message plugin" in refusal(own_node, node_chain())


@pytest.mark.brokers("rmq3.10", reason="the table's shape is checked the same way on every version")
def test_a_table_of_another_shape_is_refused_untouched(own_node, node_chain, plugin_tables):
    plugin_tables('mnesia:create_table(list_to_atom("rabbit_delayed_message" ++ atom_to_list(node())), '
                  '[{record_name, delay_entry}, {attributes, [delay_key, message, ref, options]}, {type, bag}, '
                  '{ram_copies, [node()]}]).')
    err = refusal(own_node, node_chain())
    assert "not of the shape this command reads" in err and "[delay_key,message,ref,options]" in err, err


@pytest.mark.brokers("rmq4.3", reason="Khepri only: where the plugin cannot run")
def test_on_khepri_it_refuses(own_node, node_chain):
    assert "keeps its metadata in Khepri" in refusal(own_node, node_chain())


@pytest.mark.brokers("rmq3.10", reason="the topology check is AMQP, the same on every version")
def test_without_the_gateway_topology_nothing_moves(own_node, plugin_tables):
    from topology import ChainSettings
    plugin_shape.create(plugin_tables)
    plugin_shape.fill(plugin_tables, "/", EXCHANGE, [TEMPLATES[0].raw], [(int(time.time() * 1000) + 600_000, 0, "k")])
    chain = ChainSettings(prefix="nothing-declared-here")
    code, _, err = move(own_node, chain)
    assert code == 3 and "delay-gateway declare" in err, err
    code, dry, err = move(own_node, chain, "--dry-run")
    assert code == 0 and dry["would_move"] == 1, (dry, err)
