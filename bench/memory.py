"""The `pending` scenario: memory with many messages waiting, and what publishing them cost."""

import random
import time
from typing import List

import pika

from .clients import Publisher, body, now_ms
from .context import Context, gateway_targets, open_system
from .costs import Costs, psutil_processes
from .sampler import Sampler
from .stats import per_second
from .systems import DELAY, Target, headers_for


def pending(ctx: Context) -> List[dict]:
    """Publish n messages due in 10-20 min; memory and publishing cost, no delivery. The
    gateway runs first: messages left in the plugin stay in its table (and the broker's
    memory) until due, so run this last, on a node of its own."""
    lo, hi = ctx.delays(600_000, 1_200_000)
    n = ctx.n(1_000_000)
    targets = gateway_targets(ctx, (DELAY,)) + ([Target("plugin", DELAY)] if ctx.plugin else [])
    return [_pending_run(ctx, t, n, lo, hi) for t in targets]


def _pending_run(ctx: Context, target: Target, n: int, lo: int, hi: int) -> dict:
    ctx.log(f"  pending: {target.label}, {n} messages")
    policy = None
    system = open_system(ctx, target, "pending")
    try:
        if target.system == "gateway" and ctx.max_in_memory_length is not None and target.queue_type == "quorum":
            policy = f"{system.prefix}-mem"
            ctx.broker.ctl("set_policy", policy, f"^{system.prefix}\\.",
                           f'{{"max-in-memory-length": {ctx.max_in_memory_length}}}', "--apply-to", "queues")
        procs = psutil_processes(ctx, system)
        check_in = system.chain.names.check_in if target.system == "gateway" else None
        sampler = Sampler(procs, (lambda: system.forwarded(check_in)) if check_in else None)
        before = sampler.sample()
        costs = Costs(ctx, procs)
        costs.start()
        sampler.start()
        rnd = random.Random(7)

        def make(i: int):
            published = now_ms()
            headers, due = headers_for(DELAY, published, rnd.randint(lo, hi))
            return (system.publish_exchange, "bench", pika.BasicProperties(delivery_mode=2, headers=headers),
                    body(i, due, ctx.size), due)

        pub = Publisher(ctx.url, n, make).run()
        ctx.log(f"    published {pub.acked} in {pub.seconds:.0f}s ({pub.rate_achieved:.0f}/s)")
        checked_in = None
        if check_in:
            deadline = time.monotonic() + 900
            while system.forwarded(check_in) < pub.acked and time.monotonic() < deadline:
                time.sleep(0.5)
            checked_in = system.forwarded(check_in)
        time.sleep(5)
        costs.stop()
        after = sampler.sample()
        series = sampler.stop()
        memory = ctx.broker.erlang_memory_mb()
    finally:
        system.close()
        if policy:
            ctx.broker.ctl("clear_policy", policy)
    r = {"scenario": "pending", "round": 1, "system": target.system, "header": DELAY, "label": target.label,
         "queue_type": target.queue_type, "zero_bits": target.zero_bits, "messages": n, "size": ctx.size,
         "delay_ms": [lo, hi], "publish_rate": round(pub.rate_achieved, 1), "publish_seconds": round(pub.seconds, 1),
         "unconfirmed": pub.unconfirmed, "checked_in": checked_in,
         "max_in_memory_length": ctx.max_in_memory_length if target.queue_type == "quorum" else None,
         "before": before, "after": after, "resources": sampler.summary(), "broker_erlang_memory_mb": memory,
         **costs.figures(pub.acked), "series": {"published_per_s": per_second(pub.confirm_times), "sampler": series}}
    for k in ("broker", "gateway0", "gateway1"):
        if f"{k}_rss_mb" in before and f"{k}_rss_mb" in after:
            r[f"{k}_rss_mb_delta"] = round(after[f"{k}_rss_mb"] - before[f"{k}_rss_mb"], 1)
    peak = r['resources'].get('broker', {}).get('rss_mb_max')
    ctx.log(f"    broker RSS {before.get('broker_rss_mb')} -> peak {peak} "
            f"-> {after.get('broker_rss_mb')} MB")
    return r
