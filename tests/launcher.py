"""Start the real gateway (`delay-gateway run`) as a process and watch it from the outside.

The tests' machinery (tests/support.py re-exports it), borrowed by the benchmark: bench/
imports it from here, never the other way round, so both start the gateway the same way: a
subprocess with a metrics port of its own, ready when /readyz says so (connected and
consuming every queue of its role), observed through /metrics and its JSON log lines. It
imports nothing from the gateway: it sees only what an operator sees.
"""

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from typing import Dict, List, Optional, Set, Tuple

from topology import ChainSettings

from .wait import wait_until

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def chain_args(chain: ChainSettings) -> List[str]:
    return ["--prefix", chain.prefix, "--max-level", str(chain.max_level),
            "--resolution-ms", str(chain.resolution_ms), "--queue-type", chain.queue_type,
            "--zero-bits", chain.zero_bits]


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent dies (Linux), so a benchmark
    killed by a timeout leaves no gateway consuming behind it."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def free_port(low: int = 10000, high: int = 19999, avoid: Tuple[int, ...] = ()) -> int:
    """A port free now, from below the kernel's ephemeral range (32768 up): a port the kernel
    handed out as free can be taken by any outgoing connection before our process binds it."""
    while True:
        port = random.randint(low, high)
        if port in avoid:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port


class PortNotOurs(AssertionError):
    """Something answered on the gateway's metrics port that is not the gateway."""


def listening_inodes(port: int, pid: int) -> List[int]:
    """The inodes of every TCP socket (IPv4 and IPv6, any address) listening on `port` in the
    network namespace of process `pid`."""
    inodes = []
    for table in (f"/proc/{pid}/net/tcp", f"/proc/{pid}/net/tcp6"):
        try:
            with open(table, encoding="ascii") as f:
                rows = f.read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for row in rows:
            fields = row.split()  # sl local_address rem_address st ... uid timeout inode
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.append(int(fields[9]))
    return inodes


def socket_inodes(pid: int) -> Set[int]:
    """The inodes of the sockets process `pid` holds open (empty once it has exited)."""
    found = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return found
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            found.add(int(target[len("socket:["):-1]))
    return found


class GatewayProcess:
    """`delay-gateway run` in a subprocess, serving /metrics, /healthz and /readyz on a port
    of its own; its JSON log lines are collected.

    `url` becomes DELAY_GATEWAY_URL (one URL, or several comma-separated); without it the
    process inherits the environment's, or the gateway's own default. `cwd`: where it runs
    (the repository's root by default, whose `gateway` it then imports first); `python`: the
    interpreter, when not the class's `python`. With
    `die_with_parent`, the process is stopped when the one that started it dies (the thread
    that started it, strictly: start it from a thread that lives as long)."""

    python = sys.executable  # the interpreter (the benchmark's --gateway-python sets another for a run)

    def __init__(self, chain: ChainSettings, *extra: str, url: Optional[str] = None,
                 env: Optional[Dict[str, str]] = None, die_with_parent: bool = False,
                 cwd: Optional[str] = None, python: Optional[str] = None) -> None:
        self.chain = chain
        self._port_checked = False
        self.lines: List[dict] = []
        self.raw: List[str] = []
        given = [extra[i + 1] for i, a in enumerate(extra[:-1]) if a == "--metrics-port"]
        self.port = int(given[-1]) if given else free_port()
        full_env = dict(os.environ, **(env or {}))
        if url is not None:
            full_env["DELAY_GATEWAY_URL"] = url
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        self.proc = subprocess.Popen(
            [python or self.python, "-m", "gateway", "run", *chain_args(chain), "--log-format", "json",
             *([] if given else ["--metrics-port", str(self.port)]), *extra],
            cwd=cwd or ROOT, env=full_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            preexec_fn=_die_with_parent if die_with_parent else None)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.raw.append(line)
            try:
                self.lines.append(json.loads(line))
            except json.JSONDecodeError:
                pass

    def events(self, name: str) -> List[dict]:
        return [entry for entry in list(self.lines) if entry.get("event") == name]

    def errors(self) -> List[dict]:
        return [entry for entry in list(self.lines) if entry.get("level") in ("error", "critical")]

    def get(self, path: str) -> Tuple[int, str]:
        """(status, body) of an HTTP GET on the metrics port; (0, error) when it does not answer.
        An answer from another process than this one is an error (`check_port`)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=2) as r:
                answer = r.status, r.read().decode()
        except urllib.error.HTTPError as exc:
            answer = exc.code, exc.read().decode()
        except OSError as exc:
            return 0, str(exc)
        if not self._port_checked or self.proc.poll() is not None:
            self.check_port()
        return answer

    def check_port(self) -> None:
        """Every socket listening on the metrics port is this process's: the port free_port
        picked may have been taken by another process before the gateway bound it, and then
        /metrics would be that one's. Checked at the first answer (and at any answer once the
        process has exited); raises PortNotOurs otherwise."""
        listening = listening_inodes(self.port, os.getpid())
        ours = socket_inodes(self.proc.pid)
        if not listening or not set(listening) <= ours:
            raise PortNotOurs(f"port {self.port} answered, but {len(set(listening) - ours)} of the "
                              f"{len(listening)} sockets listening on it are not the gateway's (pid "
                              f"{self.proc.pid}, {'exited' if self.proc.poll() is not None else 'running'}):\n"
                              f"{''.join(self.raw)}")
        self._port_checked = True

    @property
    def ready(self) -> bool:
        return self.get("/readyz")[0] == 200

    def metric(self, name: str, strict: bool = False, **labels: str) -> float:
        """The sum of the samples on /metrics of `name` that carry these labels (others, such
        as `vhost`, of any value); 0 when there are none. `strict`: see `samples`."""
        return sum(value for have, value in self.samples(name, strict) if labels.items() <= have.items())

    def samples(self, name: str, strict: bool = False) -> List[Tuple[Dict[str, str], float]]:
        """Every sample of one metric on /metrics, with its labels (empty when it does not
        answer; `strict`: asked up to 5 times, then an error, for a figure that must not read
        a busy machine's late answer as 0)."""
        status, text = self.get("/metrics")
        for _ in range(4 if strict else 0):
            if status == 200:
                break
            status, text = self.get("/metrics")
        if strict and status != 200:
            raise RuntimeError(f"/metrics of the gateway (pid {self.proc.pid}) did not answer: {text}")
        out = []
        for line in text.splitlines():
            if not line.startswith(name) or line.startswith("#"):
                continue
            sample, _, value = line.rpartition(" ")
            metric, _, labels = sample.partition("{")
            if metric != name:
                continue
            pairs = dict(p.split("=", 1) for p in labels.rstrip("}").split(",") if "=" in p)
            out.append(({k: v.strip('"') for k, v in pairs.items()}, float(value)))
        return out

    def wait_ready(self, timeout: float = 30) -> "GatewayProcess":
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited with {self.proc.returncode}:\n{''.join(self.raw)}")
            return self.ready
        if not wait_until(ready, timeout, fail=False):
            raise TimeoutError(f"gateway not ready after {timeout}s:\n{''.join(self.raw)}")
        self.check_port()  # ready said by this process, not by another on the same port
        return self

    def terminate(self, timeout: float = 20) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            self._reader.join(timeout=2)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
