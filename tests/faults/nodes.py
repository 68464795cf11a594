"""Private RabbitMQ nodes for fault tests: their own names, ports, data and cookie.

The main node on 5672 is shared with other people's tests, so nothing here ever touches
it. Each node gets its own RABBITMQ_NODENAME, AMQP and distribution ports, data and log
directories, an empty plugins file and a HOME of its own (so its Erlang cookie is ours,
shared only by the nodes we start together and the rabbitmqctl calls that drive them).
"""

import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

SERVER = "/usr/lib/rabbitmq/bin/rabbitmq-server"  # the Debian wrapper in /usr/sbin would su to rabbitmq
CTL = "/usr/lib/rabbitmq/bin/rabbitmqctl"
HOST = "localhost"


class NodeError(RuntimeError):
    pass


def free_port() -> int:
    """A free port below 30000: rabbitmqctl talks to a node from its dist port + 10000."""
    while True:
        port = random.randint(20000, 29999)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        if port not in (25672,):
            return port


def port_open(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


@dataclass
class Node:
    """One RabbitMQ node; `start`, `stop`, `kill`, `ctl` drive it."""

    name: str  # short name; the node is name@localhost
    home: str  # shared by the nodes of one cluster: the cookie lives here
    amqp_port: int = field(default_factory=free_port)
    dist_port: int = field(default_factory=free_port)
    extra_config: List[str] = field(default_factory=list)
    advanced_config: str = "[]."
    process: Optional[subprocess.Popen] = None

    @property
    def node(self) -> str:
        return f"{self.name}@{HOST}"

    @property
    def dir(self) -> str:
        return os.path.join(self.home, self.name)

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.amqp_port}/%2F"

    def env(self) -> Dict[str, str]:
        d = self.dir
        env = {k: v for k, v in os.environ.items() if not k.startswith("RABBITMQ_")}
        env.update(
            HOME=self.home,
            RABBITMQ_NODENAME=self.node,
            RABBITMQ_USE_LONGNAME="false",
            RABBITMQ_NODE_IP_ADDRESS="127.0.0.1",
            RABBITMQ_NODE_PORT=str(self.amqp_port),
            RABBITMQ_DIST_PORT=str(self.dist_port),
            RABBITMQ_CONF_ENV_FILE=os.path.join(d, "rabbitmq-env.conf"),
            RABBITMQ_CONFIG_FILE=os.path.join(d, "rabbitmq.conf"),
            RABBITMQ_ADVANCED_CONFIG_FILE=os.path.join(d, "advanced.config"),
            RABBITMQ_ENABLED_PLUGINS_FILE=os.path.join(d, "enabled_plugins"),
            RABBITMQ_MNESIA_BASE=os.path.join(d, "mnesia"),
            RABBITMQ_LOG_BASE=os.path.join(d, "log"),
            RABBITMQ_PID_FILE=os.path.join(d, "pid"),
            RABBITMQ_PLUGINS_EXPAND_DIR=os.path.join(d, "plugins-expand"),
        )
        return env

    def _write_files(self) -> None:
        os.makedirs(os.path.join(self.dir, "log"), exist_ok=True)
        cookie = os.path.join(self.home, ".erlang.cookie")
        if not os.path.exists(cookie):
            with open(cookie, "w") as f:
                f.write("DELAYGATEWAYFAULTS" + os.urandom(8).hex().upper())
            os.chmod(cookie, 0o400)
        files = {
            "rabbitmq-env.conf": "",
            "enabled_plugins": "[].\n",
            "advanced.config": self.advanced_config + "\n",
            "rabbitmq.conf": "\n".join([
                f"listeners.tcp.default = 127.0.0.1:{self.amqp_port}",
                "loopback_users = none",
                # The default 40% of RAM and 50 MB disk limits would make a crowded CI box
                # raise alarms we did not ask for.
                "vm_memory_high_watermark.relative = 0.9",
                "disk_free_limit.absolute = 1MB",
                *self.extra_config, ""]),
        }
        for name, text in files.items():
            with open(os.path.join(self.dir, name), "w") as f:
                f.write(text)

    def start(self, timeout: float = 60) -> "Node":
        if not os.path.exists(SERVER):
            raise NodeError(f"{SERVER} not found: run scripts/ensure-rabbitmq to install rabbitmq-server")
        self._write_files()
        log = open(os.path.join(self.dir, "log", "console.log"), "ab")
        self.process = subprocess.Popen([SERVER], env=self.env(), stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
        self.await_startup(timeout)
        return self

    def await_startup(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise NodeError(f"{self.node} exited with {self.process.returncode}: {self.console_tail()}")
            if port_open(self.amqp_port) and self.ctl("await_startup", "--timeout", "10", check=False).returncode == 0:
                return
            time.sleep(0.3)
        raise NodeError(f"{self.node} did not start within {timeout}s: {self.console_tail()}")

    def console_tail(self, lines: int = 30) -> str:
        try:
            with open(os.path.join(self.dir, "log", "console.log"), errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return "(no console log)"

    def ctl(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        result = subprocess.run([CTL, "-n", self.node, *args], env=self.env(), capture_output=True,
                                text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise NodeError(f"rabbitmqctl -n {self.node} {' '.join(args)} failed:\n{result.stdout}{result.stderr}")
        return result

    def stop(self, timeout: float = 60) -> None:
        """A clean shutdown (what a broker restart does)."""
        if self.process is None or self.process.poll() is not None:
            return
        self.ctl("shutdown", check=False, timeout=timeout)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL the whole process group (beam, epmd child-less, erl_child_setup)."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def restart(self, timeout: float = 60) -> None:
        self.stop()
        self.start(timeout)


class Cluster:
    """Nodes sharing a cookie; with more than one they are joined into a cluster."""

    def __init__(self, names: Sequence[str], extra_config: Sequence[str] = (),
                 advanced_config: str = "[].") -> None:
        self.home = tempfile.mkdtemp(prefix="delay-gateway-nodes-")
        self.nodes = [Node(n, self.home, extra_config=list(extra_config), advanced_config=advanced_config)
                      for n in names]

    def start(self) -> "Cluster":
        first, *others = self.nodes
        first.start()
        for node in others:
            node.start()
            node.ctl("stop_app")
            node.ctl("join_cluster", first.node)
            node.ctl("start_app")
        for node in self.nodes:
            node.ctl("enable_feature_flag", "all", check=False)
        return self

    def start_or_fail(self, what: str) -> "Cluster":
        """Start, or clean up and fail the test with the node's reason."""
        import pytest
        try:
            return self.start()
        except NodeError as exc:
            self.close()
            pytest.fail(f"cannot start {what}: {exc}", pytrace=False)

    @property
    def urls(self) -> List[str]:
        return [n.url for n in self.nodes]

    def close(self) -> None:
        for node in self.nodes:
            node.kill()
        shutil.rmtree(self.home, ignore_errors=True)


def unique_names(count: int, tag: str = "faults") -> List[str]:
    stamp = f"{os.getpid()}{os.urandom(2).hex()}"
    return [f"{tag}{stamp}n{i}" for i in range(1, count + 1)]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m tests.faults.nodes --nodes 3`: start private nodes (clustered when more
    than one), print their URLs, keep them until Ctrl-C or SIGTERM, then remove them."""
    import argparse
    p = argparse.ArgumentParser(prog="scripts/rabbit-cluster", description=main.__doc__)
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--name", default="delaygw", help="node names are NAME1@localhost, NAME2@localhost, ...")
    args = p.parse_args(argv)
    cluster = Cluster([f"{args.name}{i}" for i in range(1, args.nodes + 1)])
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    try:
        cluster.start()
        print("DELAY_GATEWAY_URL=" + ",".join(cluster.urls), flush=True)
        for node in cluster.nodes:
            print(f"# {node.node}: HOME={node.home} {CTL} -n {node.node} cluster_status", flush=True)
        while not stop:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        cluster.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
