"""Memory: `pending` (many messages waiting in the broker, and what publishing them cost) and
`holding` (what the distributor's memory costs per message it holds)."""

import random
import time
from typing import List, Sequence, Tuple

import pika

from .clients import Publisher, body, declare_receiver_queue, delete_queue, now_ms
from .context import Context, gateway_targets, open_system
from .costs import Costs, psutil_processes
from .sampler import Sampler
from .stats import per_second
from .systems import DELAY, DELIVER_AT, Gateway, Target, headers_for


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


# -- holding: what the distributor's memory costs per message it holds ------------------------
HOLDING_SIZES = (1024, 10_240)
HOLDING_COUNTS = (1_000, 10_000)
# Carriers of the default size, and each message alone (--carrier-messages 1). Every run
# raises --hold-messages so that the shorter path takes all of them however fast they come
# (the rate rule would send most of a fast burst down the chain), and --distributor-prefetch
# so that 10,000 deliveries of one message each are held rather than sent back (crowding).
HOLDING_CARRIERS = (("default", ()), ("1", ("--carrier-messages", "1")))
HOLDING_ARGS = ("--hold-messages", "1000000", "--distributor-prefetch", "65535")


def holding(ctx: Context) -> List[dict]:
    """The gateway's RSS at rest, then while its distributor holds n messages that came on the
    shorter path (due 7-9.8 s after publishing starts, within --hold-within-ms), then once they
    are released: bytes per held message and per held delivery, by body size, n and carrier
    size. A fresh gateway each run (Python keeps what it freed, so a run would inherit the
    last one's peak). `--messages` replaces the counts (1,000 and 10,000), `--holding-sizes`
    the body sizes (1 KB and 10 KB), `--min-delay`/`--max-delay` the due window."""
    sizes: Sequence[int] = ctx.extra.get("holding_sizes") or HOLDING_SIZES  # type: ignore[assignment]
    counts = (ctx.messages,) if ctx.messages is not None else HOLDING_COUNTS
    lo, hi = ctx.delays(7_000, 9_800)
    out = []
    for target in gateway_targets(ctx, (DELIVER_AT,)):
        for size in sizes:
            for n in counts:
                for carriers, args in HOLDING_CARRIERS:
                    out.append(_holding_run(ctx, target, int(size), n, carriers, args, lo, hi))
    return out


def _rss(procs: dict) -> int:
    """Bytes resident in the gateway's processes, together."""
    return sum(p.memory_info().rss for name, p in procs.items() if name.startswith("gateway") and p is not None)


def _holding_run(ctx: Context, target: Target, size: int, n: int, carriers: str, args, lo: int, hi: int) -> dict:
    ctx.log(f"  holding: {target.label}, {n} x {size} B, carriers of {carriers}")
    chain = ctx.chain("holding", target.queue_type or "quorum", target.zero_bits or "queue")
    system = Gateway(ctx.url, chain, [*ctx.gateway_args, *HOLDING_ARGS, *args,
                                      *(() if target.index else ("--no-pending-index",))],
                     ctx.split_roles, ctx.replicas)
    sink = f"{chain.prefix}.holding-sink"  # (released messages land here, rather than being parked)
    try:
        declare_receiver_queue(ctx.url, sink, "classic", chain.names.pick_up)
        procs = psutil_processes(ctx, system)

        def metric(name: str) -> float:
            return sum(p.metric(name, strict=True) for p in system.processes)

        time.sleep(5)  # (its start-up settles: the first upkeep pass, the follower's catch-up)
        rest = 0
        for _ in range(3):
            rest = max(rest, _rss(procs))
            time.sleep(0.3)
        rnd = random.Random(11)
        t0 = now_ms()

        def make(i: int):
            headers, due = headers_for(DELIVER_AT, t0, rnd.randint(lo, hi))
            return (system.publish_exchange, "bench", pika.BasicProperties(delivery_mode=2, headers=headers),
                    body(i, due, size), due)

        pub = Publisher(ctx.url, n, make).run()
        first_due = t0 + lo
        # every message held, or the first falling due (then what was held by then)
        while metric("delay_gateway_held_messages") < pub.acked and now_ms() < first_due - 300:
            time.sleep(0.1)
        held_ms = now_ms() - t0  # (when the holding was read: every one held, or the first due)
        samples: List[Tuple[int, float, float]] = []
        while now_ms() < first_due - 100 and len(samples) < 5:
            samples.append((_rss(procs), metric("delay_gateway_held_messages"),
                            metric("delay_gateway_held_deliveries")))
            time.sleep(0.2)
        holding_rss, held, deliveries = max(samples) if samples else (_rss(procs), 0.0, 0.0)
        # (what check-in sent straight to the distributor: all of them, unless the rate rule or crowding
        # sent some down the chain)
        straight = sum(p.metric("delay_gateway_batched_messages_total", strict=True, outcome="distributor")
                       for p in system.processes)
        deadline = time.monotonic() + (hi - (now_ms() - t0)) / 1000 + 30
        while metric("delay_gateway_held_messages") > 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(2)
        after = _rss(procs)
    finally:
        system.close()
        delete_queue(ctx.url, sink)
    grown = holding_rss - rest
    r = {"scenario": "holding", "label": target.label, "size": size, "messages": n, "carriers": carriers,
         "gateway_args": [*HOLDING_ARGS, *args], "published": pub.acked, "publish_rate": round(pub.rate_achieved, 1),
         "straight_to_distributor": straight, "held": held, "held_deliveries": deliveries,
         "held_at_ms": round(held_ms), "rss_rest_mib": round(rest / 2**20, 1),
         "rss_holding_mib": round(holding_rss / 2**20, 1), "rss_after_mib": round(after / 2**20, 1),
         "bytes_per_held_message": round(grown / held) if held else None,
         "bytes_per_held_delivery": round(grown / deliveries) if deliveries else None,
         "per_message_over_size": round(grown / held / size, 2) if held else None}
    ctx.log(f"    held {held:.0f} in {deliveries:.0f} deliveries: RSS {r['rss_rest_mib']} -> "
            f"{r['rss_holding_mib']} -> {r['rss_after_mib']} MiB; {r['bytes_per_held_message']} B/message "
            f"({r['per_message_over_size']} x its body)")
    return r
