"""A private network for cluster tests: each node in a network namespace of its own, all
plugged into a bridge in one more namespace, so that one node's link can be cut and the
cluster partitioned for real (no packet between that node and the others) while the rest
of the machine is untouched.

    switch namespace:  bridge ── s1 ──veth── eth0 (10.254.0.1/24)  node namespace 1
                              ├─ s2 ──veth── eth0 (10.254.0.2/24)  node namespace 2
                              └─ s3 ──veth── eth0 (10.254.0.3/24)  node namespace 3

The addresses exist only inside these namespaces (no route leads out of them, and the host
has no interface on the bridge): every namespace has its own stack, so concurrent runs can
use the same addresses. Clients on the host (the test, the gateway) reach a node through a
forwarder process that listens on 127.0.0.1 in the host's namespace and connects to the
node from inside the node's own namespace, so the client's path to a node is never the
link that is cut: a client of the cut-off node stays with it, as a client in the same rack
would.
"""

import asyncio
import ctypes
import os
import socket
import subprocess
import sys
import time
from typing import List, Optional, Sequence

from ..wait import wait_until

CLONE_NEWNET = 0x40000000
SUBNET = "10.254.0"


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result


class Lan:
    """`count` namespaces on one bridge; `cut(i)` / `heal(i)` take node i's link down / up."""

    def __init__(self, count: int, tag: str = "dg") -> None:
        stamp = f"{tag}{os.getpid() % 100000}{os.urandom(2).hex()}"
        self.switch = f"{stamp}sw"
        self.namespaces = [f"{stamp}n{i}" for i in range(1, count + 1)]
        self.addresses = [f"{SUBNET}.{i}" for i in range(1, count + 1)]
        self.forwarders: List[subprocess.Popen] = []
        self._made: List[str] = []
        try:
            self._create()
        except Exception:
            self.close()
            raise

    def _create(self) -> None:
        ip("netns", "add", self.switch)
        self._made.append(self.switch)
        ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        ip("-n", self.switch, "link", "set", "br0", "up")
        for i, (ns, address) in enumerate(zip(self.namespaces, self.addresses, strict=False), start=1):
            ip("netns", "add", ns)
            self._made.append(ns)
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", self.switch, "link", "add", f"s{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            ip("-n", self.switch, "link", "set", f"s{i}", "master", "br0", "up")
            ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")

    def cut(self, index: int) -> None:
        """Node `index` (0-based) loses its link: a partition, it alone against the others."""
        ip("-n", self.switch, "link", "set", f"s{index + 1}", "down")

    def heal(self, index: int) -> None:
        ip("-n", self.switch, "link", "set", f"s{index + 1}", "up")

    def forward(self, index: int, port: int) -> int:
        """A port on 127.0.0.1 of the host that leads to `port` of node `index`."""
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.faults.netns", self.namespaces[index], self.addresses[index], str(port)],
            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        self.forwarders.append(process)
        line = process.stdout.readline().strip()
        if not line.startswith("listening "):
            raise RuntimeError(f"forwarder for {self.namespaces[index]} did not start: {line!r}")
        return int(line.split()[1])

    def close(self) -> None:
        for process in self.forwarders:
            if process.poll() is None:
                process.kill()
            process.wait()
        # Whatever still runs inside our namespaces (a node's epmd daemon, say) was started
        # by this test: end it, or the namespace would live on.
        for ns in self._made:
            pids = ip("netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
        # (each until its processes are gone: best effort, 10 s for all of them)
        deadline = time.monotonic() + 10
        for ns in reversed(self._made):
            wait_until(lambda ns=ns: ip("netns", "del", ns, check=False).returncode == 0,
                       max(0.0, deadline - time.monotonic()), 0.2, fail=False)
        self._made.clear()


def enter(namespace: str) -> None:
    """Move this (single-threaded) process into a network namespace; sockets made before
    stay where they were made."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{namespace}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns {namespace}")
    finally:
        os.close(fd)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            data = await reader.read(65536)
            if not data:
                break
            writer.write(data)
            await writer.drain()
    except OSError:
        pass
    finally:
        writer.close()


async def _serve(listener: socket.socket, host: str, port: int) -> None:
    async def handle(client_reader, client_writer):
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 5)
        except (OSError, asyncio.TimeoutError):
            client_writer.close()
            return
        await asyncio.gather(_pipe(client_reader, writer), _pipe(reader, client_writer))

    server = await asyncio.start_server(handle, sock=listener)
    async with server:
        await server.serve_forever()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m tests.faults.netns NAMESPACE HOST PORT`: listen on a free port of
    127.0.0.1 here, print it, and forward every connection to HOST:PORT inside NAMESPACE."""
    namespace, host, port = argv or sys.argv[1:]
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    enter(namespace)
    print(f"listening {listener.getsockname()[1]}", flush=True)
    asyncio.run(_serve(listener, host, int(port)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
