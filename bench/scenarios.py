"""The named scenarios. Each returns a JSON-able dict; `series` entries feed the charts."""

import random
import subprocess
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import pika

from topology import ChainSettings, bit_key, units_for

from gateway import envelope
from .common import (Gateway, Publisher, Receiver, Sampler, blocking, body, declare_chain, delete_chain,
                     lateness_stats, now_ms, per_second, queue_depth, unique_prefix)


@dataclass
class Context:
    url: str
    out_dir: str
    messages: Optional[int] = None  # overrides each scenario's default size
    duration_s: float = 20.0  # per steady step
    rates: Sequence[int] = (1000, 2000, 4000, 6000, 8000)
    queue_types: Sequence[str] = ("quorum", "classic")
    zero_bits: Sequence[str] = ("queue", "exchange")
    size: int = 1024
    gateway_args: Sequence[str] = ()  # passed to both `run` processes (e.g. --lead-ms 20)
    max_level: int = 20
    resolution_ms: int = 1000
    min_delay_ms: Optional[int] = None
    max_delay_ms: Optional[int] = None
    rabbitmqctl: Sequence[str] = ("rabbitmqctl",)
    max_in_memory_length: Optional[int] = None  # pending: set as a policy on the chain
    log: Callable[[str], None] = print
    extra: Dict[str, object] = field(default_factory=dict)

    def n(self, default: int) -> int:
        return self.messages if self.messages is not None else default

    def delays(self, lo: int, hi: int):
        return (self.min_delay_ms if self.min_delay_ms is not None else lo,
                self.max_delay_ms if self.max_delay_ms is not None else hi)

    def chain(self, tag: str, queue_type: str, zero_bits: str) -> ChainSettings:
        return ChainSettings(prefix=unique_prefix(tag), max_level=self.max_level,
                             resolution_ms=self.resolution_ms, queue_type=queue_type, zero_bits=zero_bits)


def writes_per_message(delay_ms: int, chain: ChainSettings, lead_ms: int) -> int:
    """Queue writes one message costs: check-in, each chain queue, distributor, pick-up's queue."""
    units = min(units_for(delay_ms, chain.resolution_ms, lead_ms), chain.max_units)
    chain_queues = units.bit_length() if chain.zero_bits == "queue" else bin(units).count("1")
    return 3 + chain_queues


def _lead(ctx: Context) -> int:
    args = list(ctx.gateway_args)
    if "--lead-ms" in args:
        return int(args[args.index("--lead-ms") + 1])
    from gateway.settings import Settings
    return Settings().lead_ms


def _props(due: int) -> pika.BasicProperties:
    return pika.BasicProperties(delivery_mode=2, headers={envelope.DELIVER_AT: due})


def delayed_run(ctx: Context, tag: str, chain: ChainSettings, n: int, lo: int, hi: int,
                rate: Optional[float] = None, at_once_ms: Optional[int] = None, seed: int = 1) -> dict:
    """Start both roles, publish n messages to check-in, collect them at pick-up."""
    declare_chain(ctx.url, chain)
    gateways: List[Gateway] = []
    try:
        receiver = Receiver(ctx.url, chain.names.pick_up, ctx.out_dir, n)
        gateways = [Gateway(ctx.url, chain, role, *ctx.gateway_args) for role in ("check-in", "distributor")]
        for g in gateways:
            g.wait_consuming()
        sampler = Sampler(ctx.url, gateways)
        sampler.start()
        rnd = random.Random(seed)
        delays: List[int] = []
        first_due = int(now_ms()) + at_once_ms if at_once_ms is not None else None
        exchange = chain.names.check_in

        def make(i: int):
            now = int(now_ms())
            due = first_due if first_due is not None else now + rnd.randint(lo, hi)
            delays.append(due - now)
            return exchange, "bench", _props(due), body(i, due, ctx.size), due

        t_pub = time.monotonic() - sampler.t0
        wall0 = now_ms()
        pub = Publisher(ctx.url, n, make, rate=rate).run()
        ctx.log(f"  {tag}: published {pub.acked} in {pub.seconds:.1f}s ({pub.rate_achieved:.0f}/s); waiting")
        wait_s = max(0.0, (max(pub.due) - now_ms()) / 1000) + 15 + n / 4000
        receiver.wait(wait_s)
        data = receiver.stop()
        sampler.sample()
        series = sampler.stop()
        resources = sampler.summary()
        errors = [e for g in gateways for e in g.errors()]
        distributor_lateness = gateways[1].lateness_buckets()
    finally:
        for g in gateways:
            g.stop()
        delete_chain(ctx.url, chain)
    stats = lateness_stats(data, pub.acked)
    lead = _lead(ctx)
    writes = sum(writes_per_message(d, chain, lead) for d in delays) / max(1, len(delays))
    checkin_done = next((r["t"] for r in series if r.get("check-in_forwarded", 0) >= pub.acked), None)
    recv_rel = [(t - wall0) / 1000 for t in data["recv"]]
    result = {
        "scenario": tag, "queue_type": chain.queue_type, "zero_bits": chain.zero_bits,
        "messages": n, "size": ctx.size, "delay_ms": [lo, hi] if at_once_ms is None else [at_once_ms, at_once_ms],
        "target_rate": rate, "publish_rate": round(pub.rate_achieved, 1), "publish_seconds": round(pub.seconds, 2),
        "nacked": pub.nacked,
        "checkin_drain_rate": round(pub.acked / (checkin_done - t_pub), 1) if checkin_done and checkin_done > t_pub else None,
        "delivered_peak_rate": max(per_second(recv_rel), default=0),
        "writes_per_message": round(writes, 2),
        **stats, "distributor_lateness_le_s": distributor_lateness, "resources": resources, "gateway_errors": errors[:5],
        "gateway_args": list(ctx.gateway_args),
        "series": {"published_per_s": per_second(pub.confirm_times), "delivered_per_s": per_second(recv_rel),
                   "sampler": series, "lateness_ms": _sample([r - d for r, d in zip(data["recv"], data["due"])])},
    }
    return result


def _sample(values: List[float], k: int = 20000) -> List[float]:
    """At most k values (evenly spaced in sorted order) for the lateness chart."""
    values = sorted(values)
    if len(values) <= k:
        return [round(v, 2) for v in values]
    step = len(values) / k
    return [round(values[int(i * step)], 2) for i in range(k)]


def _matrix(ctx: Context):
    for qt in ctx.queue_types:
        for zb in ctx.zero_bits:
            yield qt, zb


# -- scenarios -------------------------------------------------------------------------
def burst(ctx: Context) -> List[dict]:
    lo, hi = ctx.delays(5_000, 60_000)
    n = ctx.n(100_000)
    return [delayed_run(ctx, "burst", ctx.chain("burst", qt, zb), n, lo, hi) for qt, zb in _matrix(ctx)]


def at_once(ctx: Context) -> List[dict]:
    """Every message due at the same instant (the plugin's '1,000,000 due at once' case)."""
    lo, _ = ctx.delays(60_000, 60_000)
    n = ctx.n(100_000)
    return [delayed_run(ctx, "at-once", ctx.chain("atonce", qt, zb), n, lo, lo, at_once_ms=lo)
            for qt, zb in _matrix(ctx)]


def steady(ctx: Context, tag: str = "steady", lo_hi=(1_000, 30_000), limit_ms: float = 100.0) -> List[dict]:
    lo, hi = ctx.delays(*lo_hi)
    out = []
    for qt, zb in _matrix(ctx):
        best = None
        for rate in ctx.rates:
            n = ctx.n(int(rate * ctx.duration_s))
            r = delayed_run(ctx, tag, ctx.chain(tag, qt, zb), n, lo, hi, rate=rate)
            ok = (r.get("p99_ms", 1e9) < limit_ms and r["lost"] == 0 and r["early"] == 0
                  and r["publish_rate"] >= 0.95 * rate)
            r["meets_p99_limit"] = ok
            r["p99_limit_ms"] = limit_ms
            out.append(r)
            ctx.log(f"  {tag} {qt}/{zb} {rate}/s: p99 {r.get('p99_ms')} ms, lost {r['lost']}, "
                    f"early {r['early']}, published {r['publish_rate']}/s -> {'ok' if ok else 'over'}")
            if ok:
                best = rate
            else:
                break
        for r in out:
            if r["queue_type"] == qt and r["zero_bits"] == zb:
                r["best_rate"] = best
    return out


def accuracy(ctx: Context) -> List[dict]:
    """The issue's accuracy goal: 1,000 msg/s, delays 2-10 s, p99 <= 10 ms, none early."""
    saved = ctx.rates
    ctx.rates = list(ctx.rates[:1])  # the default ladder starts at 1,000 msg/s
    try:
        return steady(ctx, "accuracy", (2_000, 10_000), limit_ms=10.0)
    finally:
        ctx.rates = saved


def pending(ctx: Context) -> List[dict]:
    """Publish n messages due in 10-20 min with check-in running; memory, not delivery."""
    lo, hi = ctx.delays(600_000, 1_200_000)
    n = ctx.n(1_000_000)
    out = []
    for qt in ctx.queue_types:
        chain = ctx.chain("pending", qt, ctx.zero_bits[0])
        policy = None
        if ctx.max_in_memory_length is not None and qt == "quorum":
            policy = f"{chain.prefix}-mem"
            subprocess.run([*ctx.rabbitmqctl, "set_policy", policy, f"^{chain.prefix}\\.", 
                            f'{{"max-in-memory-length": {ctx.max_in_memory_length}}}', "--apply-to", "queues"],
                           check=True, capture_output=True)
        declare_chain(ctx.url, chain)
        gateways: List[Gateway] = []
        try:
            gateways = [Gateway(ctx.url, chain, role, *ctx.gateway_args) for role in ("check-in", "distributor")]
            for g in gateways:
                g.wait_consuming()
            sampler = Sampler(ctx.url, gateways)
            sampler.sample()
            before = dict(sampler.series[-1])
            sampler.start()
            rnd = random.Random(7)
            exchange = chain.names.check_in

            def make(i: int):
                due = int(now_ms()) + rnd.randint(lo, hi)
                return exchange, "bench", _props(due), body(i, due, ctx.size), due

            pub = Publisher(ctx.url, n, make).run()
            ctx.log(f"  pending {qt}: published {pub.acked} in {pub.seconds:.0f}s ({pub.rate_achieved:.0f}/s)")
            t_end = time.monotonic() + 600
            while gateways[0].forwarded() < pub.acked and time.monotonic() < t_end:
                time.sleep(0.5)
            checked_in = gateways[0].forwarded()
            time.sleep(5)
            sampler.sample()
            after = dict(sampler.series[-1])
            series = sampler.stop()
            mem = _broker_memory(ctx)
        finally:
            for g in gateways:
                g.stop()
            delete_chain(ctx.url, chain)
            if policy:
                subprocess.run([*ctx.rabbitmqctl, "clear_policy", policy], capture_output=True)
        r = {"scenario": "pending", "queue_type": qt, "zero_bits": chain.zero_bits, "messages": n,
             "size": ctx.size, "delay_ms": [lo, hi], "publish_rate": round(pub.rate_achieved, 1),
             "publish_seconds": round(pub.seconds, 1), "checked_in": checked_in,
             "max_in_memory_length": ctx.max_in_memory_length if qt == "quorum" else None,
             "before": before, "after": after, "resources": sampler.summary(), "broker_memory": mem,
             "series": {"published_per_s": per_second(pub.confirm_times), "sampler": series}}
        for k in ("broker", "check-in", "distributor"):
            if f"{k}_rss_mb" in before and f"{k}_rss_mb" in after:
                r[f"{k}_rss_mb_delta"] = round(after[f"{k}_rss_mb"] - before[f"{k}_rss_mb"], 1)
        out.append(r)
    return out


def _broker_memory(ctx: Context) -> Optional[dict]:
    """erlang:memory() of the node, in MB, when rabbitmqctl can reach it."""
    try:
        p = subprocess.run([*ctx.rabbitmqctl, "eval",
                            "[{K, V div 1048576} || {K, V} <- erlang:memory()]."],
                           capture_output=True, text=True, timeout=60)
        return {"erlang_memory_mb": p.stdout.strip()} if p.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def roles(ctx: Context) -> List[dict]:
    """Each role alone: preload its queue with n messages, start it, time the drain."""
    n = ctx.n(50_000)
    out = []
    for qt, zb in _matrix(ctx):
        chain = ctx.chain("roles", qt, zb)
        declare_chain(ctx.url, chain)
        sink = f"{chain.prefix}.sink"
        try:
            with blocking(ctx.url) as c:
                ch = c.channel()
                ch.queue_declare(sink, durable=True, arguments={"x-queue-type": qt})
                ch.queue_bind(sink, chain.names.pick_up, "#")
            rnd = random.Random(3)
            names = chain.names

            def to_check_in(i: int):
                due = int(now_ms()) + rnd.randint(600_000, 1_200_000)  # stays in levels 9-10 meanwhile
                return names.check_in, "bench", _props(due), body(i, due, ctx.size), due

            def to_distributor(i: int):
                # Through 1-3 real levels (1-7 s), so each message carries the x-death history
                # the chain gives it; already due when it arrives, so nothing is held.
                units = rnd.randint(1, 7)
                due = int(now_ms())
                props = pika.BasicProperties(delivery_mode=2, headers={
                    envelope.DUE_AT: due, envelope.ROUTING_KEY: "bench", envelope.DELIVERY_MODE: 2,
                    envelope.DELIVER_AT: due})
                return names.level(units.bit_length() - 1), bit_key(units), props, body(i, due, ctx.size), due

            for role, make in (("check-in", to_check_in), ("distributor", to_distributor)):
                pre = Publisher(ctx.url, n, make, confirm_timeout_s=10).run()
                if pre.unconfirmed:
                    ctx.log(f"  roles: {pre.unconfirmed} of {n} preloaded messages never confirmed")
                if role == "distributor":  # wait until the chain has delivered them all
                    deadline = time.monotonic() + 120
                    while queue_depth(ctx.url, names.distributor) < n and time.monotonic() < deadline:
                        time.sleep(0.2)
                    ctx.log(f"  roles: {queue_depth(ctx.url, names.distributor)} in the distributor queue")
                g = Gateway(ctx.url, chain, role, *ctx.gateway_args)
                try:
                    g.wait_consuming()
                    sampler = Sampler(ctx.url, [g], interval=0.5)
                    sampler.start()
                    cpu0 = _cpu_seconds(g)
                    t0 = time.monotonic()
                    deadline = t0 + 300
                    while g.forwarded() < n and time.monotonic() < deadline:
                        time.sleep(0.1)  # each scrape costs the gateway CPU: not too often
                    seconds = time.monotonic() - t0
                    done = g.forwarded()
                    cpu = _cpu_seconds(g) - cpu0 if cpu0 is not None else None
                    sampler.stop()
                finally:
                    g.stop()
                r = {"scenario": "roles", "role": role, "queue_type": qt, "zero_bits": zb, "messages": n,
                     "forwarded": done, "seconds": round(seconds, 2), "rate": round(done / seconds, 1),
                     # CPU time per message: the role's cost, independent of other load on the machine
                     "cpu_us_per_message": round(cpu * 1e6 / done, 1) if cpu and done else None,
                     "rate_per_core": round(done / cpu, 1) if cpu else None,
                     "resources": sampler.summary(), "gateway_args": list(ctx.gateway_args)}
                ctx.log(f"  roles {qt}/{zb} {role}: {r['rate']:.0f} msg/s, {r['cpu_us_per_message']} us CPU/msg "
                        f"(cpu {r['resources'].get(role, {}).get('cpu_pct_mean')}%)")
                out.append(r)
        finally:
            delete_chain(ctx.url, chain)
            try:
                with blocking(ctx.url) as c:
                    c.channel().queue_delete(sink)
            except pika.exceptions.AMQPError:
                pass
    return out


def _cpu_seconds(g: Gateway) -> Optional[float]:
    try:
        import psutil
        t = psutil.Process(g.proc.pid).cpu_times()
        return t.user + t.system
    except Exception:
        return None


def ceiling(ctx: Context, hops: int = 8) -> List[dict]:
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
            pub = Publisher(ctx.url, n, lambda i: ("", names[0], props, payload, 0)).run()
            deadline = time.monotonic() + 600
            while queue_depth(ctx.url, names[-1]) < n and time.monotonic() < deadline:
                time.sleep(0.05)
            seconds = time.monotonic() - t0
            arrived = queue_depth(ctx.url, names[-1])
        finally:
            with blocking(ctx.url) as c:
                ch = c.channel()
                for q in names:
                    ch.queue_delete(q)
        r = {"scenario": "ceiling", "queue_type": qt, "messages": n, "hops": hops, "size": ctx.size,
             "arrived": arrived, "seconds": round(seconds, 2), "publish_rate": round(pub.rate_achieved, 1),
             "messages_per_s": round(arrived / seconds, 1),
             "hops_per_s": round(arrived * hops / seconds, 1),
             "writes_per_s": round(arrived * (hops + 1) / seconds, 1)}
        ctx.log(f"  ceiling {qt}: {r['hops_per_s']:.0f} hops/s, {r['writes_per_s']:.0f} queue writes/s")
        out.append(r)
    return out


def naive(ctx: Context) -> List[dict]:
    """One queue, per-message expiration, dead-lettered to a receiver: head-of-line blocking."""
    lo, hi = ctx.delays(1_000, 30_000)
    n = ctx.n(10_000)
    rate = 500.0
    prefix = unique_prefix("naive")
    wait_q, out_x = f"{prefix}.wait", f"{prefix}.out"
    with blocking(ctx.url) as c:
        ch = c.channel()
        ch.exchange_declare(out_x, "fanout", durable=True)
        ch.queue_declare(wait_q, durable=True, arguments={"x-dead-letter-exchange": out_x})
    try:
        receiver = Receiver(ctx.url, out_x, ctx.out_dir, n)
        rnd = random.Random(5)

        def make(i: int):
            delay = rnd.randint(lo, hi)
            due = int(now_ms()) + delay
            return "", wait_q, pika.BasicProperties(delivery_mode=2, expiration=str(delay)), body(i, due, ctx.size), due

        wall0 = now_ms()
        pub = Publisher(ctx.url, n, make, rate=rate).run()
        receiver.wait(max(0.0, (max(pub.due) - now_ms()) / 1000) + hi / 1000 + 20)
        data = receiver.stop()
    finally:
        with blocking(ctx.url) as c:
            ch = c.channel()
            ch.queue_delete(wait_q)
            ch.exchange_delete(out_x)
    stats = lateness_stats(data, pub.acked)
    ctx.log(f"  naive: p50 {stats.get('p50_ms')} ms, p99 {stats.get('p99_ms')} ms, max {stats.get('max_ms')} ms")
    recv_rel = [(t - wall0) / 1000 for t in data["recv"]]
    return [{"scenario": "naive", "queue_type": "classic", "messages": n, "delay_ms": [lo, hi],
             "target_rate": rate, "publish_rate": round(pub.rate_achieved, 1), **stats,
             "series": {"published_per_s": per_second(pub.confirm_times), "delivered_per_s": per_second(recv_rel),
                        "lateness_ms": _sample([r - d for r, d in zip(data["recv"], data["due"])])}}]


SCENARIOS = {"burst": burst, "steady": steady, "accuracy": accuracy, "at-once": at_once, "pending": pending,
             "ceiling": ceiling, "naive": naive, "roles": roles}
