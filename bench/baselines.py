"""The broker alone, without the gateway: the bounds a delay through it is measured against.
`hops`: its raw rate through a row of 1 ms TTL queues; `floor`: a plain durable queue, the
least a replicated delay can cost; `naive`: one queue with per-message expiration, and its
head-of-line blocking."""

import random
import time
from typing import List

import pika

from .clients import Publisher, Receiver, blocking, body, declare_receiver_queue, delete_queue, now_ms, queue_depth
from .context import Context
from .costs import Costs
from .stats import lateness_stats, per_second, thin
from .systems import unique_prefix


def hops(ctx: Context, hops: int = 8) -> List[dict]:
    """The broker's raw rate: messages pumped through `hops` 1 ms TTL queues in a row."""
    n = ctx.n(20_000)
    out = []
    for qt in ctx.queue_types:
        prefix = unique_prefix("ceiling")
        names = [f"{prefix}.q{k}" for k in range(hops)] + [f"{prefix}.sink"]
        try:
            with blocking(ctx.url) as c:
                ch = c.channel()
                for k, q in enumerate(names):
                    args = {"x-queue-type": qt}
                    if k < hops:
                        args.update({"x-message-ttl": 1, "x-dead-letter-exchange": "",
                                     "x-dead-letter-routing-key": names[k + 1]})
                        if qt == "quorum":
                            args.update({"x-dead-letter-strategy": "at-least-once", "x-overflow": "reject-publish"})
                    ch.queue_declare(q, durable=True, arguments=args)
            payload = body(0, 0, ctx.size)
            props = pika.BasicProperties(delivery_mode=2)
            t0 = time.monotonic()
            message = ("", names[0], props, payload, 0.0)
            Publisher(ctx.url, n, lambda i, m=message: m).run()
            deadline = time.monotonic() + 600
            while queue_depth(ctx.url, names[-1]) < n and time.monotonic() < deadline:
                time.sleep(0.05)
            seconds = time.monotonic() - t0
            arrived = queue_depth(ctx.url, names[-1])
        finally:
            for q in names:
                delete_queue(ctx.url, q)
        r = {"scenario": "hops", "queue_type": qt, "messages": n, "hops": hops, "size": ctx.size,
             "arrived": arrived, "seconds": round(seconds, 2), "messages_per_s": round(arrived / seconds, 1),
             "hops_per_s": round(arrived * hops / seconds, 1),
             "writes_per_s": round(arrived * (hops + 1) / seconds, 1)}
        ctx.log(f"  hops {qt}: {r['hops_per_s']:.0f} hops/s, {r['writes_per_s']:.0f} queue writes/s")
        out.append(r)
    return out


def floor(ctx: Context) -> List[dict]:
    """What the broker cannot do for less: the paced load (1,000 msg/s, 20,000 messages,
    persistent) published straight to one plain durable queue of each type and received
    by the same receiver, no delay. A replicated delay pays at least one quorum queue's
    cost plus the user's own queue."""
    n, rate = ctx.n(20_000), ctx.rate or 1000.0
    out = []
    for qt in ("quorum", "classic"):
        queue = f"{unique_prefix('floor')}.{qt}"
        ctx.log(f"  floor: a plain {qt} queue, {n} messages at {rate:.0f}/s")
        with blocking(ctx.url) as c:
            c.channel().queue_declare(queue, durable=True, arguments={"x-queue-type": qt})
        try:
            receiver = Receiver(ctx.url, queue, ctx.out_dir, n)
            costs = Costs(ctx, {"broker": ctx.broker.process()})
            costs.start()
            payload_props = pika.BasicProperties(delivery_mode=2)

            def make(i: int, queue=queue, props=payload_props):
                due = now_ms()
                return "", queue, props, body(i, due, ctx.size), due

            pub = Publisher(ctx.url, n, make, rate=rate).run()
            receiver.wait(15 + n / 4000)
            data = receiver.stop()
            costs.stop()
        finally:
            delete_queue(ctx.url, queue)
        r = {"scenario": "floor", "round": 1, "system": "floor", "label": f"plain {qt} queue", "queue_type": qt,
             "messages": n, "size": ctx.size, "target_rate": rate, "publish_rate": round(pub.rate_achieved, 1),
             **lateness_stats(data, pub.acked), **costs.figures(pub.acked)}
        ctx.log(f"    broker CPU {r.get('broker_cpu_us_per_message')} us/msg, p99 {r.get('p99_ms')} ms")
        out.append(r)
    return out


def naive(ctx: Context) -> List[dict]:
    """One queue, per-message expiration, dead-lettered to a receiver: head-of-line blocking."""
    lo, hi = ctx.delays(1_000, 30_000)
    n = ctx.n(10_000)
    rate = 500.0
    prefix = unique_prefix("naive")
    wait_q, out_x, sink = f"{prefix}.wait", f"{prefix}.out", f"{prefix}.receiver"
    with blocking(ctx.url) as c:
        ch = c.channel()
        ch.exchange_declare(out_x, "fanout", durable=True)
        ch.queue_declare(wait_q, durable=True, arguments={"x-dead-letter-exchange": out_x})
    try:
        declare_receiver_queue(ctx.url, sink, ctx.receiver_queue_type, out_x)
        receiver = Receiver(ctx.url, sink, ctx.out_dir, n)
        rnd = random.Random(5)

        def make(i: int):
            delay = rnd.randint(lo, hi)
            due = now_ms() + delay
            return "", wait_q, pika.BasicProperties(delivery_mode=2, expiration=str(delay)), body(i, due, ctx.size), due

        wall0 = now_ms()
        pub = Publisher(ctx.url, n, make, rate=rate).run()
        receiver.wait(max(0.0, (max(pub.due) - now_ms()) / 1000) + hi / 1000 + 20)
        data = receiver.stop()
    finally:
        for q in (wait_q, sink):
            delete_queue(ctx.url, q)
        try:
            with blocking(ctx.url) as c:
                c.channel().exchange_delete(out_x)
        except pika.exceptions.AMQPError:
            pass
    stats = lateness_stats(data, pub.acked)
    ctx.log(f"  naive: p50 {stats.get('p50_ms')} ms, p99 {stats.get('p99_ms')} ms, max {stats.get('max_ms')} ms")
    recv_rel = [(t - wall0) / 1000 for t in data["recv"]]
    return [{"scenario": "naive", "queue_type": "classic", "messages": n, "delay_ms": [lo, hi],
             "target_rate": rate, "publish_rate": round(pub.rate_achieved, 1), **stats,
             "series": {"published_per_s": per_second(pub.confirm_times), "delivered_per_s": per_second(recv_rel),
                        "lateness_ms": thin([r - d for r, d in zip(data["recv"], data["due"], strict=False)])}}]
