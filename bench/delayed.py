"""One delayed run, and the same load through several targets side by side.

A *load* says what is published (how many, with which delays, how fast); a *target* says
what delays it (the plugin, kombu's chain, or the gateway with one topology and one delay
header). `compared` runs every target on the same load, alternating plugin and gateway runs
round after round, so both see the same machine at nearly the same time.
"""

import os
import random
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import pika

from topology import ChainSettings, units_for

from .clients import Publisher, Receiver, body, declare_receiver_queue, delete_queue, now_ms
from .context import Context, gateway_targets, open_system
from .costs import Costs, psutil_processes
from .sampler import Sampler
from .stats import lateness_stats, per_second, thin
from .systems import DELAY, Target, headers_for


@dataclass(frozen=True)
class Load:
    scenario: str
    messages: int
    delay_ms: Tuple[int, int]  # each message's delay, drawn uniformly (fixed seed)
    rate: Optional[float] = None  # msg/s; None: as fast as confirms allow
    at_once_ms: Optional[int] = None  # instead: every message due this long after publishing starts
    seed: int = 1


def schedule(targets: Sequence[Target], rounds: int, plugin: bool, kombu: bool = False) -> List[Tuple[int, Target]]:
    """Round after round: the plugin and kombu's chain first (when compared), then each
    gateway target."""
    out: List[Tuple[int, Target]] = []
    for r in range(1, rounds + 1):
        if plugin:
            out.append((r, Target("plugin", DELAY)))
        if kombu:
            out.append((r, Target("kombu", DELAY)))
        out += [(r, t) for t in targets]
    return out


def writes_model(delay_ms: int, chain: ChainSettings, lead_ms: int) -> int:
    """Queue writes of one message if it travelled alone, in no carrier: check-in, each chain
    queue, distributor, the user's queue. The upper bound; the broker's counters say what
    carriers save."""
    units = min(units_for(delay_ms, chain.resolution_ms, lead_ms), chain.max_units)
    chain_queues = units.bit_length() if chain.zero_bits == "queue" else bin(units).count("1")
    return 3 + chain_queues


def _maker(ctx: Context, load: Load, target: Target, route: Callable[[int], Tuple[str, str]], delays: List[int]):
    """make(i) for the publisher: the load's next message, its delay noted in `delays`."""
    lo, hi = load.delay_ms
    rnd = random.Random(load.seed)
    instant: List[float] = []  # the at-once due time, fixed by the first publish

    def make(i: int):
        published = now_ms()
        if load.at_once_ms is not None:
            if not instant:
                instant.append(published + load.at_once_ms)
            delay = max(0, int(instant[0] - published))
        else:
            delay = rnd.randint(lo, hi)
        delays.append(delay)
        headers, due = headers_for(target.header, published, delay)
        exchange, routing_key = route(delay)
        props = pika.BasicProperties(delivery_mode=2, headers=None if target.system == "kombu" else headers)
        return exchange, routing_key, props, body(i, due, ctx.size), due
    return make


def delayed_run(ctx: Context, load: Load, target: Target, round_: int = 1) -> dict:
    """Open the target, publish the load to it, collect every message in a separate
    receiver process, and measure what it cost."""
    n = load.messages
    lo, hi = load.delay_ms
    ctx.log(f"  {load.scenario} round {round_}: {target.label}, {n} messages")
    system = open_system(ctx, target, load.scenario)
    queue = f"{system.prefix}.receiver"
    try:
        declare_receiver_queue(ctx.url, queue, ctx.receiver_queue_type, system.deliver_exchange)
        receiver = Receiver(ctx.url, queue, ctx.out_dir, n)
        procs = psutil_processes(ctx, system)
        check_in = system.chain.names.check_in if target.system == "gateway" else None
        sampler = Sampler(procs, (lambda: system.forwarded(check_in)) if check_in else None)
        costs = Costs(ctx, procs)
        costs.start()
        load_start = os.getloadavg()[0]
        sampler.start()
        delays: List[int] = []
        make = _maker(ctx, load, target, system.route, delays)
        t_pub = time.monotonic() - sampler.t0
        wall0 = now_ms()
        pub = Publisher(ctx.url, n, make, rate=load.rate).run()
        ctx.log(f"    published {pub.acked} in {pub.seconds:.1f}s ({pub.rate_achieved:.0f}/s); waiting")
        receiver.wait(max(0.0, (max(pub.due) - now_ms()) / 1000) + 15 + n / 4000)
        data = receiver.stop()
        costs.stop()
        sampler.sample()
        series = sampler.stop()
        errors = system.errors()
        gateway_lateness = system.lateness_buckets()
    finally:
        system.close()
        delete_queue(ctx.url, queue)
    stats = lateness_stats(data, pub.acked)
    resources = sampler.summary()
    resources.setdefault("load_average", {})["start"] = round(load_start, 2)
    checkin_done = next((r["t"] for r in series if r.get("checked_in", 0) >= pub.acked), None)
    recv_rel = [(t - wall0) / 1000 for t in data["recv"]]
    result = {
        "scenario": load.scenario, "round": round_, "system": target.system, "header": target.header,
        "queue_type": target.queue_type, "zero_bits": target.zero_bits, "label": target.label,
        "messages": n, "size": ctx.size,
        "delay_ms": [lo, hi] if load.at_once_ms is None else [min(delays), max(delays)],
        "at_once_ms": load.at_once_ms, "target_rate": load.rate,
        "publish_rate": round(pub.rate_achieved, 1), "publish_seconds": round(pub.seconds, 2),
        "nacked": pub.nacked, "unconfirmed": pub.unconfirmed,
        "checkin_drain_rate": (round(pub.acked / (checkin_done - t_pub), 1)
                               if checkin_done and checkin_done > t_pub else None),
        "delivered_peak_rate": max(per_second(recv_rel), default=0),
        **stats, **costs.figures(pub.acked),
        "receiver_queue_type": ctx.receiver_queue_type,
        "gateway_lateness_le_s": gateway_lateness, "resources": resources, "gateway_errors": errors[:5],
        "gateway_args": list(ctx.gateway_args) if target.system == "gateway" else [],
        "split_roles": ctx.split_roles if target.system == "gateway" else None,
        "replicas": ctx.replicas if target.system == "gateway" else None,
        "series": {"published_per_s": per_second(pub.confirm_times), "delivered_per_s": per_second(recv_rel),
                   "sampler": series,
                   "lateness_ms": thin([r - d for r, d in zip(data["recv"], data["due"], strict=False)])},
    }
    if target.system == "gateway":
        chain = system.chain
        result["writes_model_per_message"] = round(
            sum(writes_model(d, chain, ctx.lead_ms) for d in delays) / max(1, len(delays)), 2)
    ctx.log(f"    p50 {result.get('p50_ms')} ms, p99 {result.get('p99_ms')} ms, max {result.get('max_ms')} ms, "
            f"early {result['early']}, lost {result['lost']}, "
            f"queue writes/msg {result.get('queue_writes_per_message')}, "
            f"broker CPU {result.get('broker_cpu_us_per_message')} us/msg")
    return result


def compared(ctx: Context, load: Load, targets: Optional[List[Target]] = None) -> List[dict]:
    return [delayed_run(ctx, load, t, r)
            for r, t in schedule(targets or gateway_targets(ctx), ctx.rounds, ctx.plugin, ctx.kombu)]
