"""The broker under test, seen from outside: its version, its process (CPU, memory), its own
counters of what it wrote, and whether the delayed-message-exchange plugin is there.

Writes are counted by the broker itself, with `rabbitmqctl eval` on counters that RabbitMQ
keeps on 3.10 and 4.x alike (the Prometheus plugin exports the same ones):
- rabbit_global_counters `messages_routed_total` (a publish routed to a queue: our
  topologies route each publish to exactly one queue) plus
  `messages_dead_lettered_expired_total` (a TTL hop: the message is written again, to the
  queue behind the dead-letter exchange). Their sum is the number of times a message was
  written into a queue: the "queue writes".
- ra_counters `ra_log_wal` `writes`: entries the quorum queues appended to their write-ahead
  log (enqueues, but also settlements, consumer changes and dead-letter bookkeeping), the
  broker's real disk work for quorum queues.
- mnesia `transaction_log_writes`: writes to Mnesia's log, where the delayed-message-exchange
  plugin keeps its messages (a dirty write of the message and one of its index entry).
These counters are node-wide: the figures are ours only on a private node.
"""

import re
import shlex
import subprocess
from typing import Dict, Optional, Sequence
from urllib.parse import urlsplit

import pika

from .clients import blocking

# One eval, printed as {name,integer} pairs. Each part is guarded: a counter a version lacks
# reads -1 (unknown), never a crash.
_COUNTERS = r"""
G = try rabbit_global_counters:overview() catch _:_ -> #{} end,
S = fun(K) -> lists:sum([maps:get(K, M, 0) || M <- maps:values(G), is_map(M)]) end,
Wal = try maps:fold(fun(K, V, A) when is_map(V) ->
        N = lists:flatten(io_lib:format("~p", [K])),
        case {string:find(N, "ra_log_wal"), string:find(N, "coordination")} of
            {nomatch, _} -> A;
            {_, nomatch} -> {W, B} = A, {W + maps:get(writes, V, 0), B + maps:get(batches, V, 0)};
            _ -> A
        end;
      (_, _, A) -> A end, {0, 0}, ra_counters:overview())
  catch _:_ -> {-1, -1} end,
{WalWrites, WalBatches} = Wal,
Mn = try mnesia:system_info(transaction_log_writes) catch _:_ -> -1 end,
[{routed, S(messages_routed_total)}, {dead_lettered, S(messages_dead_lettered_expired_total)},
 {received, S(messages_received_total)},
 {unroutable, S(messages_unroutable_dropped_total) + S(messages_unroutable_returned_total)},
 {wal_writes, WalWrites}, {wal_batches, WalBatches}, {mnesia_log_writes, Mn}].
"""


class Broker:
    def __init__(self, url: str, rabbitmqctl: Optional[Sequence[str]] = ("rabbitmqctl",)) -> None:
        self.url = url
        self.rabbitmqctl = list(rabbitmqctl) if rabbitmqctl else None
        self._pid: Optional[int] = None

    # -- rabbitmqctl ----------------------------------------------------------------------
    def ctl(self, *args: str, timeout: float = 60) -> Optional[str]:
        """stdout of a rabbitmqctl command, or None when there is no rabbitmqctl or it fails."""
        if not self.rabbitmqctl:
            return None
        try:
            p = subprocess.run([*self.rabbitmqctl, *args], capture_output=True, text=True, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return p.stdout if p.returncode == 0 else None

    def version(self) -> str:
        out = self.ctl("version")
        return out.strip() if out else "?"

    def counters(self) -> Optional[Dict[str, int]]:
        out = self.ctl("eval", " ".join(_COUNTERS.split()))
        if out is None:
            return None
        found = {k: int(v) for k, v in re.findall(r"\{(\w+),(-?\d+)\}", out)}
        return found or None

    def erlang_memory_mb(self) -> Optional[Dict[str, int]]:
        out = self.ctl("eval", "[{K, V div 1048576} || {K, V} <- erlang:memory()].")
        return {k: int(v) for k, v in re.findall(r"\{(\w+),(\d+)\}", out)} if out else None

    def memory_limit_mb(self) -> Optional[int]:
        """The node's memory high watermark (above it, publishers are blocked)."""
        out = self.ctl("eval", "vm_memory_monitor:get_memory_limit() div 1048576.")
        return int(out.strip()) if out and out.strip().isdigit() else None

    # -- the process ---------------------------------------------------------------------
    def pid(self) -> Optional[int]:
        """The beam.smp listening on the URL's port (psutil), else the node's own answer."""
        if self._pid is None:
            self._pid = _listening_pid(urlsplit(self.url).port or 5672)
        if self._pid is None:
            out = self.ctl("eval", "os:getpid().")
            if out and out.strip().strip('"').isdigit():
                self._pid = int(out.strip().strip('"'))
        return self._pid

    def process(self):
        try:
            import psutil
        except ImportError:  # the bench dependency group is not installed: no resource figures
            return None
        pid = self.pid()
        return psutil.Process(pid) if pid else None

    # -- the plugin ----------------------------------------------------------------------
    def has_plugin(self, probe: str) -> bool:
        """Whether the broker knows the exchange type x-delayed-message: declare one (named
        `probe`, auto-deleted) and delete it. Without the plugin the broker refuses the
        type: 3.10 closes the connection (503 COMMAND_INVALID), 4.0 the channel (406
        PRECONDITION_FAILED, "unknown exchange type")."""
        try:
            with blocking(self.url, "delay-gateway bench probe") as c:
                ch = c.channel()
                ch.exchange_declare(probe, "x-delayed-message", durable=False, auto_delete=True,
                                    arguments={"x-delayed-type": "topic"})
                ch.exchange_delete(probe)
            return True
        except (pika.exceptions.ChannelClosedByBroker, pika.exceptions.ConnectionClosedByBroker) as exc:
            if exc.reply_code in (503, 540) or "exchange type" in str(exc.reply_text):
                return False
            raise


def _listening_pid(port: int) -> Optional[int]:
    try:
        import psutil
    except ImportError:
        return None
    try:
        for c in psutil.net_connections(kind="tcp"):
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
                return c.pid
    except (psutil.AccessDenied, PermissionError):
        pass
    return None


def split_command(text: str) -> Optional[Sequence[str]]:
    """--rabbitmqctl: a command line, or '' / 'none' for no rabbitmqctl at all."""
    return None if text.strip().lower() in ("", "none") else shlex.split(text)


def cpu_seconds(proc) -> Optional[float]:
    """User + system CPU time of a psutil process (and its threads), None if gone."""
    if proc is None:
        return None
    try:
        t = proc.cpu_times()
        return t.user + t.system
    except Exception:  # the process is gone, or psutil refuses
        return None


def system_seconds(proc) -> Optional[float]:
    """The kernel's part of cpu_seconds: for the gateway, mostly its sockets' sends and reads
    (on loopback the receiver's side of TCP is paid by the sender too)."""
    if proc is None:
        return None
    try:
        return float(proc.cpu_times().system)
    except Exception:
        return None


def delta(after: Optional[Dict[str, int]], before: Optional[Dict[str, int]]) -> Optional[Dict[str, int]]:
    if not after or not before:
        return None
    return {k: after[k] - before[k] for k in after if k in before and after[k] >= 0 and before[k] >= 0}
