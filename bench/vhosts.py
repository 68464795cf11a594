"""`vhosts`: one `run` serving many virtual hosts, at rest and under a paced load spread over them.

Creates `--vhosts-count` vhosts (100) in one `rabbitmqctl import_definitions` (the URL's user
gets every permission in each), starts one gateway with `--vhosts` naming them all (it
declares its chain in each), and measures: how long it took to be ready; at rest over
`--idle-window`, the gateway's RSS, threads and CPU, and the broker's connections, channels,
processes and memory; then `--rate` msg/s (100) for `--duration` s (20) published round
robin over the vhosts, x-delay 2-10 s, each vhost with its own receiver queue: lateness on
this process's clock, lost and early, the gateway's CPU and RSS. The vhosts (and all in them)
are deleted afterwards, also when the run fails.
"""

import random
import threading
import time
import uuid
from typing import Any, Dict, List, Optional
from urllib.parse import urlsplit, urlunsplit

import pika

from tests.launcher import GatewayProcess

from gateway.urls import with_vhost

from .broker import cpu_seconds
from .clients import blocking
from .context import Context
from .costs import psutil_process
from .footprint import at_rest
from .stats import percentile

_CONNECTIONS = ("[{connections, try length(rabbit_networking:connections()) catch _:_ -> -1 end}, "
                "{channels, try length(rabbit_channel:list()) catch _:_ -> -1 end}].")


def _base_url(url: str) -> str:
    """The URL without a vhost: `--vhosts` names them."""
    return urlunsplit(urlsplit(url)._replace(path="/"))


def _create(ctx: Context, names: List[str]) -> None:
    """The vhosts, and every permission in each for the URL's user: one `rabbitmqctl eval`
    (a call per vhost would take minutes; `import_definitions` reads no stdin on 4.x)."""
    user = urlsplit(ctx.url).username or "guest"
    listed = ", ".join(f'<<"{n}">>' for n in names)
    out = ctx.broker.ctl("eval", f'[begin ok = rabbit_vhost:add(V, <<"bench">>), ok = rabbit_auth_backend_internal:'
                                 f'set_permissions(<<"{user}">>, V, <<".*">>, <<".*">>, <<".*">>, <<"bench">>) end '
                                 f'|| V <- [{listed}]], created.', timeout=600)
    if out is None or "created" not in out:
        raise SystemExit(f"bench vhosts: creating the vhosts with rabbitmqctl eval failed: {out!r}")


def _delete(ctx: Context, names: List[str]) -> None:
    listed = ", ".join(f'<<"{n}">>' for n in names)
    if ctx.broker.ctl("eval", f'[rabbit_vhost:delete(V, <<"bench">>) || V <- [{listed}]], ok.', timeout=600) is None:
        for n in names:  # (a version without rabbit_vhost:delete/2: one at a time)
            ctx.broker.ctl("delete_vhost", n, timeout=120)


def _connections(ctx: Context) -> Dict[str, int]:
    out = ctx.broker.ctl("eval", _CONNECTIONS) or ""
    found = dict(part.strip("{} ").split(",") for part in out.strip().strip("[].\n").split("},") if "," in part)
    return {k.strip(): int(v) for k, v in found.items()}


class _Receivers:
    """A queue bound to pick-up in each vhost and one consumer each, on a thread of its own:
    arrival times (ms, this process's clock) by message id."""

    def __init__(self, urls: List[str], pick_up: str) -> None:
        self.arrived: Dict[str, float] = {}
        self.duplicates = 0
        self._stop = threading.Event()
        self._connections = []
        for url in urls:
            c = blocking(url, "delay-gateway bench vhosts receiver")
            ch = c.channel()
            q = ch.queue_declare(f"bench-vhosts-{uuid.uuid4().hex[:6]}", durable=True,
                                 arguments={"x-queue-type": "quorum"}).method.queue
            ch.queue_bind(q, pick_up, "#")
            ch.basic_qos(prefetch_count=500)
            ch.basic_consume(q, self._on_message)
            self._connections.append(c)
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _on_message(self, channel, method, properties, body) -> None:
        now = time.time() * 1000
        if properties.message_id in self.arrived:
            self.duplicates += 1
        else:
            self.arrived[properties.message_id] = now
        channel.basic_ack(method.delivery_tag)

    def _loop(self) -> None:
        while not self._stop.is_set():
            for c in self._connections:
                c.process_data_events(time_limit=0)
            time.sleep(0.002)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        for c in self._connections:
            try:
                c.close()
            except pika.exceptions.AMQPError:
                pass


def _gateway_figures(gateway: GatewayProcess) -> dict:
    p = psutil_process(gateway.proc.pid)
    return {"rss_mib": round(p.memory_info().rss / 2**20, 1), "threads": p.num_threads()} if p else {}


def vhosts(ctx: Context) -> List[dict]:
    """One gateway, `--vhosts-count` vhosts: at rest and at `--rate` msg/s spread over them."""
    count = int(ctx.extra.get("vhosts_count") or 100)
    window = float(ctx.extra.get("idle_window") or 60.0)
    rate, seconds = ctx.rate or 100.0, ctx.duration_s
    lo, hi = ctx.delays(2_000, 10_000)
    if ctx.broker.rabbitmqctl is None:
        raise SystemExit("bench vhosts: it creates the vhosts with rabbitmqctl: drop --rabbitmqctl none")
    names = [f"bench-vh-{uuid.uuid4().hex[:6]}-{i:03d}" for i in range(count)]
    base = _base_url(ctx.url)
    urls = {n: with_vhost(base, n) for n in names}
    broker_before = at_rest(ctx)
    _create(ctx, names)
    gateway: Optional[GatewayProcess] = None
    receivers: Optional[_Receivers] = None
    publishers: Dict[str, Any] = {}
    try:
        chain = ctx.chain("vhosts", ctx.queue_types[0], ctx.zero_bits[0])
        t0 = time.monotonic()
        gateway = GatewayProcess(chain, "--vhosts", ",".join(names), url=base, die_with_parent=True)
        gateway.wait_ready(timeout=max(120.0, 5.0 * count))
        ready_s = time.monotonic() - t0
        ctx.log(f"  vhosts: one gateway ready for {count} vhosts in {ready_s:.0f} s")
        proc = psutil_process(gateway.proc.pid)
        time.sleep(min(5.0, window))  # (its start-up settles: each vhost's first upkeep pass)
        cpu0, r0 = cpu_seconds(proc), time.monotonic()
        time.sleep(window)
        rest = dict(_gateway_figures(gateway), cpu_pct=round((cpu_seconds(proc) - cpu0) * 100 / (time.monotonic() - r0),
                                                             2))
        broker_rest = at_rest(ctx)
        links = _connections(ctx)
        ctx.log(f"  vhosts at rest: gateway {rest}, broker {links}")

        receivers = _Receivers(list(urls.values()), chain.names.pick_up)
        for n, u in urls.items():
            publishers[n] = blocking(u, "delay-gateway bench vhosts publisher").channel()
            publishers[n].confirm_delivery()
        rnd = random.Random(7)
        sent: Dict[str, float] = {}  # id -> due (ms, this clock)
        total = int(rate * seconds)
        cpu1, t1 = cpu_seconds(proc), time.monotonic()
        for i in range(total):
            pace = t1 + i / rate - time.monotonic()
            if pace > 0:
                time.sleep(pace)
            vhost = names[i % count]
            delay = rnd.randint(lo, hi)
            mid = f"vh-{i}"
            now = time.time() * 1000
            publishers[vhost].basic_publish(chain.names.check_in, "bench", b"x" * ctx.size, pika.BasicProperties(
                message_id=mid, delivery_mode=2, headers={"x-delay": delay}), mandatory=True)
            sent[mid] = now + delay
        publish_s = time.monotonic() - t1
        deadline = time.monotonic() + hi / 1000 + 60
        while len(receivers.arrived) < total and time.monotonic() < deadline:
            time.sleep(0.2)
        flow_s = time.monotonic() - t1
        loaded = dict(_gateway_figures(gateway), cpu_pct=round((cpu_seconds(proc) - cpu1) * 100 / flow_s, 2))
    finally:
        for ch in publishers.values():
            try:
                ch.connection.close()
            except pika.exceptions.AMQPError:
                pass
        if receivers is not None:
            receivers.close()
        if gateway is not None:
            gateway.terminate(60)
        _delete(ctx, names)
    late = sorted(receivers.arrived[m] - due for m, due in sent.items() if m in receivers.arrived)
    r = {"scenario": "vhosts", "vhosts": count, "ready_s": round(ready_s, 1), "window_s": window,
         "rest": rest, "broker_links": links, "rate": rate, "publish_rate": round(total / publish_s, 1),
         "messages": total, "received": len(late), "lost": total - len(late),
         "early": sum(1 for x in late if x < 0), "duplicates": receivers.duplicates,
         "p50_ms": round(percentile(late, 50), 1) if late else None,
         "p99_ms": round(percentile(late, 99), 1) if late else None,
         "max_ms": round(late[-1], 1) if late else None, "loaded": loaded}
    if broker_before and broker_rest:
        r["broker_per_vhost"] = {k: round((broker_rest[k] - broker_before[k]) / count, 1)
                                 for k in ("processes", "open_fds", "file_handles") if broker_before[k] >= 0}
        memory = broker_rest["memory"] - broker_before["memory"]
        r["broker_per_vhost"]["memory_mib"] = round(memory / count / 2**20, 2)
    ctx.log(f"  vhosts under {rate:g} msg/s: gateway {loaded}, p99 {r['p99_ms']} ms, lost {r['lost']}, "
            f"early {r['early']}")
    return [r]
