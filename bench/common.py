"""Building blocks of the scenarios: a confirming publisher, a receiver process, the gateway
processes, a resource sampler, and lateness statistics."""

import json
import multiprocessing
import os
import re
import signal
import struct
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from typing import Callable, Dict, List, Optional, Tuple
from urllib.parse import urlsplit

import pika

from topology import ChainSettings, build
from topology.declare import declare, delete

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAD = struct.Struct("<qq")  # message number, due time (epoch ms)


def now_ms() -> float:
    return time.time() * 1000.0


def body(i: int, due_ms: int, size: int) -> bytes:
    return HEAD.pack(i, due_ms) + b"x" * max(0, size - HEAD.size)


def unique_prefix(tag: str) -> str:
    return f"bench-{tag}-{uuid.uuid4().hex[:6]}"


def blocking(url: str, name: str = "delay-gateway bench") -> pika.BlockingConnection:
    params = pika.URLParameters(url)
    params.client_properties = {"connection_name": name}
    return pika.BlockingConnection(params)


def declare_chain(url: str, chain: ChainSettings) -> None:
    with blocking(url) as c:
        declare(c.channel(), build(chain))


def delete_chain(url: str, chain: ChainSettings) -> None:
    try:
        with blocking(url) as c:
            delete(c.channel(), build(chain))
    except pika.exceptions.AMQPError:
        pass


def queue_depth(url: str, queue: str) -> int:
    with blocking(url) as c:
        return c.channel().queue_declare(queue, passive=True).method.message_count


class _Pending(dict):
    """An insertion-ordered dict of sequence numbers with a cheap 'pop the oldest'."""

    def popitem_first(self) -> int:
        key = next(iter(self))
        del self[key]
        return key


# -- publisher -------------------------------------------------------------------------
Make = Callable[[int], Tuple[str, str, pika.BasicProperties, bytes, int]]


class Publisher:
    """Publishes n messages with confirms, at most `window` unconfirmed, optionally at a
    fixed rate. `make(i)` returns (exchange, routing key, properties, body, due ms)."""

    def __init__(self, url: str, n: int, make: Make, rate: Optional[float] = None, window: int = 2000,
                 confirm_timeout_s: float = 60.0) -> None:
        self.url, self.n, self.make, self.rate, self.window = url, n, make, rate, window
        self.confirm_timeout_s = confirm_timeout_s
        self._last_confirm = 0.0
        self._pending = _Pending()  # publish sequence numbers not yet confirmed, in order
        self.due: List[int] = []
        self.sent = 0
        self.acked = 0
        self.nacked = 0
        self.confirm_times: List[float] = []  # one per confirmed message, s since start (for the chart)
        self.start = self.end = 0.0
        self.error: Optional[str] = None

    def run(self) -> "Publisher":
        self._conn = pika.SelectConnection(
            pika.URLParameters(self.url), on_open_callback=self._on_open,
            on_open_error_callback=lambda c, e: self._fail(e), on_close_callback=lambda c, r: c.ioloop.stop())
        self._conn.ioloop.start()
        if self.error:
            raise RuntimeError(f"publisher failed: {self.error}")
        return self

    def _close(self) -> None:
        if self._conn.is_open:
            self._conn.close()

    def _fail(self, error) -> None:
        self.error = str(error)
        self._conn.ioloop.stop()

    def _on_open(self, conn) -> None:
        conn.channel(on_open_callback=self._on_channel)

    def _on_channel(self, ch) -> None:
        self._ch = ch
        ch.add_on_close_callback(lambda c, r: self._close())
        ch.confirm_delivery(self._on_confirm, callback=lambda _: self._begin())

    def _begin(self) -> None:
        self.start = time.monotonic()
        self._tick()

    def _tick(self, timer: bool = True) -> None:
        allowed = self.n if self.rate is None else min(
            self.n, int((time.monotonic() - self.start) * self.rate) + 1)
        while self.sent < allowed and self.sent - self.acked - self.nacked < self.window:
            exchange, key, props, payload, due = self.make(self.sent)
            self._ch.basic_publish(exchange, key, payload, props)
            self.due.append(due)
            self.sent += 1
            self._pending[self.sent] = True  # delivery tags count from 1 on a channel
        if timer and self.sent < self.n:
            self._conn.ioloop.call_later(0.002, self._tick)
        elif timer:
            self._watch()

    def _watch(self) -> None:
        """All sent: give up on confirms that do not come (reported as unconfirmed)."""
        if self.acked + self.nacked >= self.n:
            return
        if time.monotonic() - max(self._last_confirm, self.start) > self.confirm_timeout_s:
            self.end = time.monotonic()
            self._close()
        else:
            self._conn.ioloop.call_later(0.5, self._watch)

    @property
    def unconfirmed(self) -> int:
        return self.sent - self.acked - self.nacked

    def _on_confirm(self, frame) -> None:
        m = frame.method
        self._last_confirm = time.monotonic()
        # Confirms may come out of order (a single ack for a later message before a
        # multiple ack that covers earlier ones): track each publish, never count by tag.
        if m.multiple:
            tags = []
            while self._pending and next(iter(self._pending)) <= m.delivery_tag:
                tags.append(self._pending.popitem_first())
        else:
            tags = [m.delivery_tag] if self._pending.pop(m.delivery_tag, False) else []
        count = len(tags)
        if isinstance(m, pika.spec.Basic.Ack):
            self.acked += count
            t = time.monotonic() - self.start
            self.confirm_times.extend([t] * count)
        else:
            self.nacked += count
        if self.acked + self.nacked >= self.n:
            self.end = time.monotonic()
            self._close()
        elif self.rate is None or self.sent >= self.n:
            self._tick(timer=False)

    @property
    def seconds(self) -> float:
        return self.end - self.start

    @property
    def rate_achieved(self) -> float:
        return self.acked / self.seconds if self.seconds > 0 else 0.0


# -- receiver --------------------------------------------------------------------------
def _receive(url: str, exchange: str, key: str, out: str, ready, stop, expected: int,
             queue_type: str, count=None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = blocking(url, "delay-gateway bench receiver")
    ch = conn.channel()
    args = {"x-queue-type": queue_type} if queue_type != "classic" else {}
    q = ch.queue_declare("", exclusive=True, arguments=args).method.queue
    ch.queue_bind(q, exchange, key)
    ids, dues, recv = [], [], []
    unpack, clock = HEAD.unpack_from, time.time

    def on_message(_ch, _m, _p, payload):
        t = clock() * 1000.0
        i, due = unpack(payload)
        ids.append(i)
        dues.append(due)
        recv.append(t)

    ch.basic_qos(prefetch_count=5000)
    ch.basic_consume(q, on_message, auto_ack=True)
    ready.set()
    while not stop.is_set() and len(ids) < expected:
        conn.process_data_events(time_limit=0.05)
        if count is not None:
            count.value = len(ids)
    conn.close()
    with open(out, "w") as f:
        json.dump({"id": ids, "due": dues, "recv": recv}, f)


class Receiver:
    """A child process with its own queue bound to `exchange`; records (id, due, receive
    time) of everything that arrives."""

    def __init__(self, url: str, exchange: str, out_dir: str, expected: int, key: str = "#") -> None:
        ctx = multiprocessing.get_context("spawn")
        self.path = os.path.join(out_dir, f"recv-{uuid.uuid4().hex[:8]}.json")
        self.ready, self.stop_event = ctx.Event(), ctx.Event()
        self.count = ctx.Value("q", 0, lock=False)
        self.proc = ctx.Process(target=_receive, daemon=True, args=(
            url, exchange, key, self.path, self.ready, self.stop_event, expected, "classic", self.count))
        self.proc.start()
        if not self.ready.wait(30):
            raise RuntimeError("receiver did not start")

    def wait(self, timeout: float, idle_s: float = 15.0) -> None:
        """Until everything arrived, or `timeout` has passed and nothing more arrived for
        `idle_s` (so a slow drain is measured as late, and only what never comes as lost)."""
        self.proc.join(timeout)
        last, last_change = self.count.value, time.monotonic()
        while self.proc.is_alive():
            self.proc.join(1.0)
            if self.count.value != last:
                last, last_change = self.count.value, time.monotonic()
            elif time.monotonic() - last_change > idle_s:
                break

    def stop(self) -> Dict[str, list]:
        self.stop_event.set()
        self.proc.join(30)
        with open(self.path) as f:
            data = json.load(f)
        os.remove(self.path)
        return data


# -- the gateway under test ------------------------------------------------------------
def chain_args(chain: ChainSettings) -> List[str]:
    return ["--prefix", chain.prefix, "--max-level", str(chain.max_level),
            "--resolution-ms", str(chain.resolution_ms), "--queue-type", chain.queue_type,
            "--zero-bits", chain.zero_bits]


_PORTS = iter(range(19400 + (os.getpid() % 200) * 10, 65000))


class Gateway:
    """`python -m gateway run --role ROLE` in a subprocess, with its metrics endpoint."""

    def __init__(self, url: str, chain: ChainSettings, role: str, *extra: str) -> None:
        self.role = role
        self.port = next(_PORTS)
        self.lines: List[dict] = []
        env = dict(os.environ, DELAY_GATEWAY_URL=url, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "run", "--role", role, *chain_args(chain),
             "--log-format", "json", "--metrics-port", str(self.port), "--no-declare", *extra],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            try:
                self.lines.append(json.loads(line))
            except json.JSONDecodeError:
                self.lines.append({"event": line.rstrip()})

    def wait_consuming(self, timeout: float = 30) -> "Gateway":
        pipes = {"check-in": 1, "distributor": 2}.get(self.role, 3)
        deadline = time.monotonic() + timeout
        while sum(1 for e in list(self.lines) if e.get("event") == "consuming") < pipes:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"gateway {self.role} did not start: {self.lines[-5:]}")
            time.sleep(0.02)
        return self

    def counters(self) -> Dict[str, float]:
        """Messages forwarded, by outcome (chain, distributor, delivered, ...)."""
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=2).read().decode()
        except OSError:
            return {}
        out: Dict[str, float] = {}
        for m in re.finditer(r'^delay_gateway_messages_total\{[^}]*outcome="([^"]+)"[^}]*\} (\S+)$', text, re.M):
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
        return out

    def lateness_buckets(self) -> Dict[str, float]:
        """The gateway's own lateness histogram (cumulative counts by upper bound, seconds):
        how late the distributor published, before the hop to pick-up and the receiver."""
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=2).read().decode()
        except OSError:
            return {}
        return {m.group(1): float(m.group(2)) for m in re.finditer(
            r'^delay_gateway_lateness_seconds_bucket\{le="([^"]+)"\} (\S+)$', text, re.M)}

    def forwarded(self) -> float:
        return sum(self.counters().values())

    def errors(self) -> List[dict]:
        return [e for e in list(self.lines) if e.get("level") in ("error", "critical")]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# -- resources -------------------------------------------------------------------------
def broker_pid(url: str) -> Optional[int]:
    """The pid of the beam.smp that listens on the URL's port (needs permission to see it)."""
    try:
        import psutil
    except ImportError:  # the optional 'bench' extra is not installed: no resource figures
        return None
    port = urlsplit(url).port or 5672
    try:
        for c in psutil.net_connections(kind="tcp"):
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
                return c.pid
    except (psutil.AccessDenied, PermissionError):
        pass
    return None


class Sampler(threading.Thread):
    """Every `interval` s: CPU % and RSS of the broker and each gateway process, and each
    gateway's forwarded counter."""

    def __init__(self, url: str, gateways: List[Gateway], interval: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.interval, self.gateways = interval, gateways
        self.procs = {}
        try:
            import psutil
        except ImportError:  # the optional 'bench' extra is not installed: no resource figures
            psutil = None
        if psutil is not None:
            pid = broker_pid(url)
            if pid:
                self.procs["broker"] = psutil.Process(pid)
            for g in gateways:
                self.procs[g.role] = psutil.Process(g.proc.pid)
        self.series: List[dict] = []
        self._halt = threading.Event()
        self.t0 = time.monotonic()

    def run(self) -> None:
        for p in self.procs.values():
            p.cpu_percent(None)
        while not self._halt.wait(self.interval):
            self.sample()

    def sample(self) -> None:
        row: dict = {"t": round(time.monotonic() - self.t0, 2)}
        for name, p in self.procs.items():
            try:
                row[f"{name}_cpu"] = p.cpu_percent(None)
                row[f"{name}_rss_mb"] = round(p.memory_info().rss / 2**20, 1)
            except Exception:  # the process is gone
                pass
        for g in self.gateways:
            row[f"{g.role}_forwarded"] = g.forwarded()
        self.series.append(row)

    def stop(self) -> List[dict]:
        self._halt.set()
        self.join(5)
        return self.series

    def summary(self) -> dict:
        out = {}
        for name in self.procs:
            cpu = [r[f"{name}_cpu"] for r in self.series if f"{name}_cpu" in r]
            rss = [r[f"{name}_rss_mb"] for r in self.series if f"{name}_rss_mb" in r]
            if rss:
                out[name] = {"rss_mb_start": rss[0], "rss_mb_max": max(rss), "rss_mb_end": rss[-1],
                             "cpu_pct_mean": round(sum(cpu) / len(cpu), 1), "cpu_pct_max": max(cpu)}
        return out


# -- statistics ------------------------------------------------------------------------
def percentile(sorted_values: List[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), without numpy."""
    k = (len(sorted_values) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def lateness_stats(data: Dict[str, list], published: int) -> dict:
    """From receiver data: lateness percentiles (ms), early, lost, duplicates."""
    late = sorted(r - d for r, d in zip(data["recv"], data["due"]))
    unique = len(set(data["id"]))
    out = {"published": published, "received": len(data["id"]), "unique": unique,
           "duplicates": len(data["id"]) - unique, "lost": published - unique,
           "early": sum(1 for v in late if v < 0)}
    if late:
        for p in (50, 90, 99, 99.9):
            out[f"p{p:g}_ms"] = round(percentile(late, p), 2)
        out["max_ms"] = round(late[-1], 2)
        out["min_ms"] = round(late[0], 2)
        out["mean_ms"] = round(sum(late) / len(late), 2)
    return out


def per_second(times_s, t0: float = 0.0) -> List[int]:
    """Counts per whole second since t0, for throughput-over-time charts."""
    counts: List[int] = []
    for t in times_s:
        k = int(t - t0)
        if k < 0:
            continue
        while len(counts) <= k:
            counts.append(0)
        counts[k] += 1
    return counts
