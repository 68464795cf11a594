"""The `roles` scenario: each role of the gateway (check-in, distributor) alone drains a
preloaded queue; its rate and its CPU time per message."""

import random
import time
from typing import Callable, List, Optional

import pika

from topology import ChainSettings, build
from topology.broker.declare import declare, delete

from tests.launcher import GatewayProcess

from .broker import cpu_seconds
from .clients import Publisher, blocking, body, declare_receiver_queue, delete_queue, now_ms, queue_depth
from .context import Context
from .costs import psutil_process, wakeups
from .profile import Profiler
from .profile import per_message as steps_per_message
from .stats import per_message
from .systems import DELAY, headers_for


def roles(ctx: Context) -> List[dict]:
    """Each role alone drains a preloaded queue: msg/s and CPU per message.

    check-in: its queue is filled by publishing to check-in while no gateway runs (delays of
    10-20 min, so everything stays in the long levels and few messages share a carrier; or
    --min-delay and --max-delay: 5 s each is a burst's, whose messages share their carriers),
    then it is started alone.
    distributor: on a chain of its own, a check-in process alone carries messages with delays
    of 1-7 s through the real levels into the distributor queue; once all are there and due,
    it is stopped and the distributor started alone, timed until the user's queue holds them
    all."""
    n = ctx.n(50_000)
    out = []
    for qt, zb in ctx.topologies():
        for _role, alone in (("check-in", _check_in_alone), ("distributor", _distributor_alone)):
            chain = ctx.chain("roles", qt, zb)
            sink = f"{chain.prefix}.receiver"
            topology = build(chain)
            with blocking(ctx.url) as c:
                declare(c.channel(), topology)
            try:
                declare_receiver_queue(ctx.url, sink, ctx.receiver_queue_type, chain.names.pick_up)
                out.append(alone(ctx, chain, topology, n, sink))
            finally:
                try:
                    with blocking(ctx.url) as c:
                        delete(c.channel(), topology)
                except pika.exceptions.AMQPError:
                    pass
                delete_queue(ctx.url, sink)
    return out


def _publish_to_check_in(ctx: Context, chain: ChainSettings, n: int, lo: int, hi: int, seed: int) -> Publisher:
    rnd = random.Random(seed)

    def make(i: int):
        headers, due = headers_for(DELAY, now_ms(), rnd.randint(lo, hi))
        return (chain.names.check_in, "bench", pika.BasicProperties(delivery_mode=2, headers=headers),
                body(i, due, ctx.size), due)

    pub = Publisher(ctx.url, n, make, confirm_timeout_s=30).run()
    if pub.unconfirmed or pub.nacked:
        ctx.log(f"    roles: {pub.unconfirmed} unconfirmed, {pub.nacked} refused of {n} preloaded")
    return pub


def _forwarded(process: GatewayProcess, queue: str) -> float:
    return sum(v for labels, v in process.samples("delay_gateway_messages_total") if labels.get("queue") == queue)


def _timed(ctx: Context, chain: ChainSettings, role: str, done: Callable[[GatewayProcess], float], n: int,
           read_from: Optional[str] = None) -> dict:
    """Start `role` alone and time it until `done(process)` reaches n (or stops moving).
    `read_from`: the queue it reads, looked at (a passive declare, on a connection of the
    benchmark's own) until it holds no ready message, before the gateway's metrics are: a
    scrape every tenth of a second costs the gateway several per cent of its CPU, which a
    Prometheus scraping every 15 s does not."""
    process = GatewayProcess(chain, "--role", role, *ctx.gateway_args, url=ctx.url, die_with_parent=True)
    try:
        process.wait_ready(60)
        proc = psutil_process(process.proc.pid)
        profiler = Profiler(process.proc.pid).start() if ctx.extra.get("profile") else None
        with blocking(ctx.url) as looking:
            channel = looking.channel()

            def ready() -> int:
                return channel.queue_declare(read_from, passive=True).method.message_count if read_from else 0

            wakeups0, broker = wakeups(proc), ctx.broker.process()
            cpu0, broker0, t0, d0 = cpu_seconds(proc), cpu_seconds(broker), time.monotonic(), done(process)
            last, moved = (ready(), d0), time.monotonic()
            while time.monotonic() - t0 < 600:
                time.sleep(0.1)
                left = ready()
                d = done(process) if not left else last[1]
                if d >= n:
                    break
                if (left, d) != last:
                    last, moved = (left, d), time.monotonic()
                elif time.monotonic() - moved > 10:
                    break
            seconds, cpu1, broker1 = time.monotonic() - t0, cpu_seconds(proc), cpu_seconds(broker)
        cpu = cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None
        broker_cpu = broker1 - broker0 if broker0 is not None and broker1 is not None else None
        finished, woke = done(process), wakeups(proc)
        woken = woke - wakeups0 if woke is not None and wakeups0 is not None else None
        step_shares, why = profiler.stop() if profiler is not None else ({}, None)
    finally:
        process.terminate(30)
    timed = finished - d0
    r = {"scenario": "roles", "role": role, "queue_type": chain.queue_type, "zero_bits": chain.zero_bits,
         "messages": n, "done": finished, "timed_messages": timed, "seconds": round(seconds, 2),
         "rate": round(timed / seconds, 1) if seconds > 0 else None,
         # CPU time per message: the role's own cost, whatever else the machine runs
         "cpu_us_per_message": per_message(cpu, int(timed), 1e6, 1),
         "rate_per_core": round(timed / cpu, 1) if cpu else None, "gateway_args": list(ctx.gateway_args),
         # what the broker spent meanwhile (every node process of the URL's broker; 2 cores here)
         "broker_cpu_us_per_message": per_message(broker_cpu, int(timed), 1e6, 1),
         "broker_cpu_pct": round(100 * broker_cpu / seconds, 1) if broker_cpu is not None and seconds > 0 else None,
         # the event loop's wake-ups (costs.wakeups): how many messages each handled, at what cost
         "wakeups": woken, "messages_per_wakeup": round(timed / woken, 1) if woken else None,
         "cpu_us_per_wakeup": per_message(cpu, woken, 1e6, 1) if woken else None}
    if profiler is not None:
        r["steps_us_per_message"] = steps_per_message(step_shares, r["cpu_us_per_message"])
        r["profile_note"] = why
    ctx.log(f"  roles {chain.queue_type}/{chain.zero_bits} {role}: {r['rate']} msg/s, "
            f"{r['cpu_us_per_message']} us CPU/msg, {r['messages_per_wakeup']} msg a wake-up")
    return r


def _check_in_alone(ctx: Context, chain: ChainSettings, topology, n: int, sink: str) -> dict:
    _publish_to_check_in(ctx, chain, n, *ctx.delays(600_000, 1_200_000), seed=3)
    queue = chain.names.check_in
    return _timed(ctx, chain, "check-in", lambda p: _forwarded(p, queue), n, read_from=queue)


def _distributor_alone(ctx: Context, chain: ChainSettings, topology, n: int, sink: str) -> dict:
    waiting = [q.name for q in topology.queues if q.role in ("delay", "pass")]
    carrier = GatewayProcess(chain, "--role", "check-in", *ctx.gateway_args, url=ctx.url, die_with_parent=True)
    try:
        carrier.wait_ready(60)
        pub = _publish_to_check_in(ctx, chain, n, 1_000, 7_000, seed=4)
        deadline = time.monotonic() + 300
        while _forwarded(carrier, chain.names.check_in) < n and time.monotonic() < deadline:
            time.sleep(0.2)
        # all due, and nothing left in the chain: everything waits in the distributor queue
        time.sleep(max(0.0, (max(pub.due) - now_ms()) / 1000) + 1)
        while queue_depth(ctx.url, *waiting) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        carrier.terminate(30)
    ctx.log(f"    roles: {queue_depth(ctx.url, chain.names.distributor)} messages ready in the distributor queue")
    return _timed(ctx, chain, "distributor", lambda p: queue_depth(ctx.url, sink), n)
