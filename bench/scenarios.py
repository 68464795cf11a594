"""The named scenarios. Each returns a list of JSON-able dicts, one per run.

A *load* says what is published (how many, with which delays, how fast); a *target* says
what delays it (the plugin, or the gateway with one topology and one delay header). The
delayed scenarios run every target on the same load, alternating plugin and gateway runs
round after round, so both see the same machine at nearly the same time.
"""

import os
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import pika

from topology import ChainSettings, build, units_for
from topology.broker.declare import declare, delete

from gateway.settings import default

from tests.launcher import GatewayProcess

from .broker import Broker, cpu_seconds, delta, system_seconds
from .clients import Publisher, Receiver, blocking, body, declare_receiver_queue, now_ms
from .sampler import Sampler
from .stats import lateness_stats, per_message, per_second, thin
from .systems import DELAY, DELIVER_AT, Gateway, Kombu, Plugin, Target, headers_for, unique_prefix

GATEWAY_DEFAULT_LEAD_MS = default("lead_ms")  # the gateway's own default


@dataclass
class Context:
    url: str
    out_dir: str
    broker: Broker
    messages: Optional[int] = None  # overrides each scenario's default size
    rounds: int = 1
    plugin: bool = False  # run the plugin beside the gateway (--compare-plugin, and the broker has it)
    kombu: bool = False  # run Celery's native delayed delivery beside the gateway (--compare-kombu)
    headers: Sequence[str] = (DELAY, DELIVER_AT)
    queue_types: Sequence[str] = ("quorum",)
    zero_bits: Sequence[str] = ("queue",)
    rate: Optional[float] = None  # paced: overrides 1,000 msg/s
    rates: Sequence[int] = (1000, 2000, 4000, 6000, 8000)  # steady ladder
    duration_s: float = 20.0  # per steady step
    min_delay_ms: Optional[int] = None
    max_delay_ms: Optional[int] = None
    at_once_ms: int = 60_000
    size: int = 1024
    gateway_args: Sequence[str] = ()  # passed to every `run` process (e.g. --lead-ms 20)
    split_roles: bool = False  # one `run` process per role instead of one with both
    replicas: int = 1  # gateway processes (of each role, with split_roles), competing consumers
    receiver_queue_type: str = "quorum"
    max_level: int = 20
    resolution_ms: int = 1000
    max_in_memory_length: Optional[int] = None  # pending: set as a policy on the chain
    index_off: bool = False  # also each gateway load with the index of what waits off (--compare-index)
    idle_s: float = 2.0  # the idle broker's CPU is measured this long before each run
    log: Callable[[str], None] = print
    extra: Dict[str, object] = field(default_factory=dict)

    def n(self, default: int) -> int:
        return self.messages if self.messages is not None else default

    def delays(self, lo: int, hi: int) -> Tuple[int, int]:
        return (self.min_delay_ms if self.min_delay_ms is not None else lo,
                self.max_delay_ms if self.max_delay_ms is not None else hi)

    def chain(self, tag: str, queue_type: str, zero_bits: str) -> ChainSettings:
        return ChainSettings(prefix=unique_prefix(tag), max_level=self.max_level,
                             resolution_ms=self.resolution_ms, queue_type=queue_type, zero_bits=zero_bits)

    def topologies(self):
        for qt in self.queue_types:
            for zb in self.zero_bits:
                yield qt, zb

    @property
    def lead_ms(self) -> int:
        args = list(self.gateway_args)
        for i, a in enumerate(args):
            if a == "--lead-ms" and i + 1 < len(args):
                return int(args[i + 1])
            if a.startswith("--lead-ms="):
                return int(a.split("=", 1)[1])
        return GATEWAY_DEFAULT_LEAD_MS


@dataclass(frozen=True)
class Load:
    scenario: str
    messages: int
    delay_ms: Tuple[int, int]  # each message's delay, drawn uniformly (fixed seed)
    rate: Optional[float] = None  # msg/s; None: as fast as confirms allow
    at_once_ms: Optional[int] = None  # instead: every message due this long after publishing starts
    seed: int = 1


def gateway_targets(ctx: Context, headers: Optional[Sequence[str]] = None) -> List[Target]:
    return [Target("gateway", h, qt, zb, index) for qt, zb in ctx.topologies() for h in (headers or ctx.headers)
            for index in ((True, False) if ctx.index_off else (True,))]


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


def open_system(ctx: Context, target: Target, tag: str):
    if target.system == "plugin":
        return Plugin(ctx.url, unique_prefix(tag))
    if target.system == "kombu":
        return Kombu(ctx.url, unique_prefix(tag), ctx.receiver_queue_type)
    args = [*ctx.gateway_args, *(() if target.index else ("--no-pending-index",))]
    return Gateway(ctx.url, ctx.chain(tag, target.queue_type, target.zero_bits), args, ctx.split_roles, ctx.replicas)


def _psutil_process(pid: int):
    try:
        import psutil
    except ImportError:  # the bench dependency group is not installed: no CPU figures
        return None
    return psutil.Process(pid)


def wakeups(process) -> Optional[int]:
    """How often the process's main thread (the gateway's event loop) went to sleep and woke:
    its voluntary context switches (/proc/PID/status counts the main thread's)."""
    if process is None:
        return None
    try:
        return int(process.num_ctx_switches().voluntary)
    except Exception:  # gone, or no such figure on this system
        return None


def _psutil_processes(ctx: Context, system) -> Dict[str, object]:
    procs: Dict[str, object] = {"broker": ctx.broker.process()}
    for i, p in enumerate(system.processes):
        procs[f"gateway{i}"] = _psutil_process(p.proc.pid)
    return procs


def writes_model(delay_ms: int, chain: ChainSettings, lead_ms: int) -> int:
    """Queue writes of one message if it travelled alone, in no carrier: check-in, each chain
    queue, distributor, the user's queue. The upper bound; the broker's counters say what
    carriers save."""
    units = min(units_for(delay_ms, chain.resolution_ms, lead_ms), chain.max_units)
    chain_queues = units.bit_length() if chain.zero_bits == "queue" else bin(units).count("1")
    return 3 + chain_queues


def _delete_queue(url: str, queue: str) -> None:
    try:
        with blocking(url) as c:
            c.channel().queue_delete(queue)
    except pika.exceptions.AMQPError:
        pass


class _Costs:
    """CPU time of the broker and the gateway processes, and the broker's write counters,
    between `start()` and `stop()`."""

    def __init__(self, ctx: Context, procs: Dict[str, object]) -> None:
        self.ctx, self.procs = ctx, procs

    def start(self) -> None:
        idle_s = self.ctx.idle_s
        self.counters0 = self.ctx.broker.counters()
        # What the idle broker burns (quorum queue ticks, timers), measured after the
        # rabbitmqctl call settled: part of every per-message CPU figure below.
        b0 = cpu_seconds(self.procs.get("broker"))
        time.sleep(idle_s)
        b1 = cpu_seconds(self.procs.get("broker"))
        self.idle_pct = round((b1 - b0) * 100 / idle_s, 1) if b0 is not None and b1 is not None else None
        self.cpu0 = {k: cpu_seconds(p) for k, p in self.procs.items()}
        self.wakeups0 = {k: wakeups(p) for k, p in self.procs.items() if k.startswith("gateway")}
        self.system0 = {k: system_seconds(p) for k, p in self.procs.items() if k.startswith("gateway")}
        self.t0 = time.monotonic()

    def stop(self) -> None:
        self.seconds = time.monotonic() - self.t0
        self.cpu1 = {k: cpu_seconds(p) for k, p in self.procs.items()}
        self.wakeups1 = {k: wakeups(p) for k, p in self.procs.items() if k.startswith("gateway")}
        self.system1 = {k: system_seconds(p) for k, p in self.procs.items() if k.startswith("gateway")}
        self.counters1 = self.ctx.broker.counters()

    def gateway_system_share(self) -> Optional[float]:
        """The kernel's share of the gateway processes' CPU time."""
        spent = [self.system1[k] - self.system0[k] for k in self.system0
                 if self.system0[k] is not None and self.system1.get(k) is not None]
        total = self.cpu("gateway")
        return round(sum(spent) / total, 2) if spent and total else None

    def gateway_wakeups(self) -> Optional[int]:
        spent = [self.wakeups1[k] - self.wakeups0[k] for k in self.wakeups0
                 if self.wakeups0[k] is not None and self.wakeups1.get(k) is not None]
        return sum(spent) if spent else None

    def cpu(self, prefix: str) -> Optional[float]:
        spent = [self.cpu1[k] - self.cpu0[k] for k in self.procs
                 if k.startswith(prefix) and self.cpu0.get(k) is not None and self.cpu1.get(k) is not None]
        return sum(spent) if spent else None

    def figures(self, messages: int) -> dict:
        d = delta(self.counters1, self.counters0)
        broker_cpu, gateway_cpu = self.cpu("broker"), self.cpu("gateway")
        out = {"window_seconds": round(self.seconds, 2), "broker_idle_cpu_pct": self.idle_pct,
               "broker_cpu_seconds": None if broker_cpu is None else round(broker_cpu, 2),
               "broker_cpu_us_per_message": per_message(broker_cpu, messages, 1e6, 1),
               "gateway_cpu_seconds": None if gateway_cpu is None else round(gateway_cpu, 2),
               "gateway_cpu_us_per_message": per_message(gateway_cpu, messages, 1e6, 1),
               "gateway_wakeups_per_message": per_message(self.gateway_wakeups(), messages, digits=2),
               "gateway_cpu_system_share": self.gateway_system_share(),
               "gateway_cpu_pct": None if gateway_cpu is None else round(gateway_cpu * 100 / self.seconds, 2),
               "broker_counters": d}
        if d:
            out["queue_writes_per_message"] = per_message(d.get("routed", 0) + d.get("dead_lettered", 0), messages)
            if "wal_writes" in d:
                out["wal_writes_per_message"] = per_message(d["wal_writes"], messages)
                out["wal_batches_per_message"] = per_message(d["wal_batches"], messages, digits=3)
            if "mnesia_log_writes" in d:
                out["mnesia_log_writes_per_message"] = per_message(d["mnesia_log_writes"], messages)
        return out


# -- one delayed run ---------------------------------------------------------------------
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
        procs = _psutil_processes(ctx, system)
        check_in = system.chain.names.check_in if target.system == "gateway" else None
        sampler = Sampler(procs, (lambda: system.forwarded(check_in)) if check_in else None)
        costs = _Costs(ctx, procs)
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
        _delete_queue(ctx.url, queue)
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


# -- the side-by-side loads --------------------------------------------------------------------
def paced(ctx: Context) -> List[dict]:
    """1,000 msg/s, delays 2-10 s, 20,000 messages."""
    rate = ctx.rate or 1000.0
    return compared(ctx, Load("paced", ctx.n(20_000), ctx.delays(2_000, 10_000), rate=rate))


def burst(ctx: Context) -> List[dict]:
    """20,000 published as fast as confirms allow, each with a delay of 5 s."""
    return compared(ctx, Load("burst", ctx.n(20_000), ctx.delays(5_000, 5_000)))


def at_once(ctx: Context) -> List[dict]:
    """100,000 due at the same instant, `at_once_ms` after publishing starts ("everyone gets
    the reminder at 9:00"): with x-delay each message says how long until then."""
    return compared(ctx, Load("at-once", ctx.n(100_000), (ctx.at_once_ms, ctx.at_once_ms),
                              at_once_ms=ctx.at_once_ms))


def steady(ctx: Context, limit_ms: float = 100.0) -> List[dict]:
    """A ladder of rates (delays 1-30 s): the highest rate each target keeps p99 < limit."""
    lo, hi = ctx.delays(1_000, 30_000)
    out = []
    targets = ([Target("plugin", DELAY)] if ctx.plugin else []) + gateway_targets(ctx, (DELAY,))
    for target in targets:
        best = None
        for rate in ctx.rates:
            n = ctx.n(int(rate * ctx.duration_s))
            r = delayed_run(ctx, Load("steady", n, (lo, hi), rate=rate), target)
            ok = (r.get("p99_ms", 1e9) < limit_ms and r["lost"] == 0 and r["early"] == 0
                  and r["publish_rate"] >= 0.95 * rate)
            r["meets_p99_limit"], r["p99_limit_ms"] = ok, limit_ms
            out.append(r)
            if not ok:
                break
            best = rate
        for r in out:
            if r["label"] == target.label:
                r["best_rate"] = best
    return out


# -- pending: memory with many messages waiting ----------------------------------------------
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
        procs = _psutil_processes(ctx, system)
        check_in = system.chain.names.check_in if target.system == "gateway" else None
        sampler = Sampler(procs, (lambda: system.forwarded(check_in)) if check_in else None)
        before = sampler.sample()
        costs = _Costs(ctx, procs)
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


# -- each role alone -------------------------------------------------------------------------
def roles(ctx: Context) -> List[dict]:
    """Each role alone drains a preloaded queue: msg/s and CPU per message.

    check-in: its queue is filled by publishing to check-in while no gateway runs (delays of
    10-20 min, so everything stays in the long levels), then it is started alone.
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
                _delete_queue(ctx.url, sink)
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


def _depth(ctx: Context, *queues: str) -> int:
    """Ready messages in these queues, together (a passive declare of each)."""
    with blocking(ctx.url) as c:
        ch = c.channel()
        return sum(ch.queue_declare(q, passive=True).method.message_count for q in queues)


def _forwarded(process: GatewayProcess, queue: str) -> float:
    return sum(v for labels, v in process.samples("delay_gateway_messages_total") if labels.get("queue") == queue)


def _timed(ctx: Context, chain: ChainSettings, role: str, done: Callable[[GatewayProcess], float], n: int) -> dict:
    """Start `role` alone and time it until `done(process)` reaches n (or stops moving)."""
    process = GatewayProcess(chain, "--role", role, *ctx.gateway_args, url=ctx.url, die_with_parent=True)
    try:
        process.wait_ready(60)
        proc = _psutil_process(process.proc.pid)
        cpu0, t0, d0 = cpu_seconds(proc), time.monotonic(), done(process)
        last, moved = d0, time.monotonic()
        while time.monotonic() - t0 < 600:
            time.sleep(0.1)  # each look costs the gateway a scrape: not too often
            d = done(process)
            if d >= n:
                break
            if d != last:
                last, moved = d, time.monotonic()
            elif time.monotonic() - moved > 10:
                break
        seconds, cpu1 = time.monotonic() - t0, cpu_seconds(proc)
        cpu = cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None
        finished = done(process)
    finally:
        process.terminate(30)
    timed = finished - d0
    r = {"scenario": "roles", "role": role, "queue_type": chain.queue_type, "zero_bits": chain.zero_bits,
         "messages": n, "done": finished, "timed_messages": timed, "seconds": round(seconds, 2),
         "rate": round(timed / seconds, 1) if seconds > 0 else None,
         # CPU time per message: the role's own cost, whatever else the machine runs
         "cpu_us_per_message": per_message(cpu, int(timed), 1e6, 1),
         "rate_per_core": round(timed / cpu, 1) if cpu else None, "gateway_args": list(ctx.gateway_args)}
    ctx.log(f"  roles {chain.queue_type}/{chain.zero_bits} {role}: {r['rate']} msg/s, "
            f"{r['cpu_us_per_message']} us CPU/msg")
    return r


def _check_in_alone(ctx: Context, chain: ChainSettings, topology, n: int, sink: str) -> dict:
    _publish_to_check_in(ctx, chain, n, 600_000, 1_200_000, seed=3)
    queue = chain.names.check_in
    return _timed(ctx, chain, "check-in", lambda p: _forwarded(p, queue), n)


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
        while _depth(ctx, *waiting) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        carrier.terminate(30)
    ctx.log(f"    roles: {_depth(ctx, chain.names.distributor)} messages ready in the distributor queue")
    return _timed(ctx, chain, "distributor", lambda p: _depth(ctx, sink), n)


# -- the broker alone ------------------------------------------------------------------------
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
            while _depth(ctx, names[-1]) < n and time.monotonic() < deadline:
                time.sleep(0.05)
            seconds = time.monotonic() - t0
            arrived = _depth(ctx, names[-1])
        finally:
            for q in names:
                _delete_queue(ctx.url, q)
        r = {"scenario": "hops", "queue_type": qt, "messages": n, "hops": hops, "size": ctx.size,
             "arrived": arrived, "seconds": round(seconds, 2), "messages_per_s": round(arrived / seconds, 1),
             "hops_per_s": round(arrived * hops / seconds, 1),
             "writes_per_s": round(arrived * (hops + 1) / seconds, 1)}
        ctx.log(f"  hops {qt}: {r['hops_per_s']:.0f} hops/s, {r['writes_per_s']:.0f} queue writes/s")
        out.append(r)
    return out


def ceiling(ctx: Context, limit_ms: float = 100.0) -> List[dict]:
    """Rising paced rates (`ceiling_rates`, delays 2-4 s, `ceiling_seconds` each), the plugin
    or kombu's chain and the gateway side by side at each rate: the highest rate each
    sustains with p99 under `limit_ms`, nothing lost or early. A target that misses at one
    rate is not tried at the next."""
    lo, hi = ctx.delays(2_000, 4_000)
    rates: Sequence[int] = ctx.extra.get("ceiling_rates") or (1000, 2000, 3000, 4500, 6000)  # type: ignore[assignment]
    seconds = float(ctx.extra.get("ceiling_seconds") or 10.0)  # type: ignore[arg-type]
    targets = [t for _, t in schedule(gateway_targets(ctx, (DELAY,)), 1, ctx.plugin, ctx.kombu)]
    alive = list(targets)
    out: List[dict] = []
    best: Dict[str, Optional[int]] = {t.label: None for t in targets}
    for rate in rates:
        for target in list(alive):
            r = delayed_run(ctx, Load("ceiling", ctx.n(int(rate * seconds)), (lo, hi), rate=rate), target)
            ok = (r.get("p99_ms", 1e9) < limit_ms and r["lost"] == 0 and r["early"] == 0
                  and r["publish_rate"] >= 0.95 * rate)
            r["meets_p99_limit"], r["p99_limit_ms"] = ok, limit_ms
            out.append(r)
            if ok:
                best[target.label] = rate
            else:
                alive.remove(target)
        if not alive:
            break
    for r in out:
        r["best_rate"] = best[r["label"]]
    return out


def idle(ctx: Context) -> List[dict]:
    """A gateway with nothing waiting and nothing arriving: its CPU (% of one core) and its
    event loop's wake-ups per second over `idle_window` seconds (60), after it is ready."""
    window = float(ctx.extra.get("idle_window") or 60.0)  # type: ignore[arg-type]
    out = []
    for target in gateway_targets(ctx, (DELAY,)):
        system = open_system(ctx, target, "idle")
        try:
            proc = _psutil_processes(ctx, system)
            gateways = {k: p for k, p in proc.items() if k.startswith("gateway")}
            time.sleep(min(5.0, window))  # (its start-up settles: the first upkeep pass, the follower's catch-up)
            cpu0 = {k: cpu_seconds(p) for k, p in gateways.items()}
            wake0 = {k: wakeups(p) for k, p in gateways.items()}
            rss = [p.memory_info().rss for p in gateways.values() if p is not None]
            t0 = time.monotonic()
            time.sleep(window)
            seconds = time.monotonic() - t0
            cpu = sum(cpu_seconds(p) - cpu0[k] for k, p in gateways.items() if p is not None)
            woke = sum(wakeups(p) - wake0[k] for k, p in gateways.items() if p is not None)
        finally:
            system.close()
        r = {"scenario": "idle", "label": target.label, "seconds": round(seconds, 1),
             "gateway_cpu_pct": round(cpu * 100 / seconds, 2), "gateway_wakeups_per_s": round(woke / seconds, 1),
             "gateway_rss_mib": round(sum(rss) / 2**20, 1) if rss else None}
        ctx.log(f"  idle {target.label}: {r['gateway_cpu_pct']} % of a core, "
                f"{r['gateway_wakeups_per_s']} wake-ups/s")
        out.append(r)
    return out


def trickle(ctx: Context) -> List[dict]:
    """Low paced rates (10 and 100 msg/s, delays 2-10 s, 30 s each), side by side like the
    others: what each pays per wake-up rather than per message (with `idle` and `ceiling`,
    the gateway's CPU from 0 to thousands of messages a second)."""
    out = []
    for rate in (10, 100):
        out += compared(ctx, Load("trickle", ctx.n(rate * 30), ctx.delays(2_000, 10_000), rate=rate),
                        gateway_targets(ctx, (DELAY,)))
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
            costs = _Costs(ctx, {"broker": ctx.broker.process()})
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
            _delete_queue(ctx.url, queue)
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
            _delete_queue(ctx.url, q)
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


def waiting(ctx: Context) -> List[dict]:
    from .at_scale import waiting as run  # (its own module: the index of what waits at scale)
    return run(ctx)


SCENARIOS = {"paced": paced, "burst": burst, "at-once": at_once, "pending": pending, "steady": steady,
             "roles": roles, "ceiling": ceiling, "hops": hops, "idle": idle, "trickle": trickle, "naive": naive,
             "floor": floor, "waiting": waiting}
# Names for several at once.
GROUPS = {"issue": ["paced", "burst", "at-once", "floor", "ceiling", "idle", "trickle"],
          "all": [s for s in SCENARIOS if s not in ("pending", "waiting")]}
