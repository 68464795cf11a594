"""Private RabbitMQ nodes for fault tests: their own names, ports, data and cookie.

The main node on 5672 is shared with other people's tests, so nothing here ever touches
it. Each node gets its own RABBITMQ_NODENAME, AMQP and distribution ports, data and log
directories, an empty plugins file and a HOME of its own (so its Erlang cookie is ours,
shared only by the nodes we start together and the rabbitmqctl calls that drive them).

A node runs the host's RabbitMQ (Debian bookworm: 3.10.x) or the one in a RabbitMQ 4.x root
that scripts/ensure-rabbitmq4 caches (Debian trixie's 4.0.x or forky's 4.3.x in a chroot):
see `Runtime`. The same Node and Cluster drive all of them.
"""

import functools
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from .. import launcher
from ..wait import wait_until

SERVER = "/usr/lib/rabbitmq/bin/rabbitmq-server"  # the Debian wrapper in /usr/sbin would su to rabbitmq
CTL = "/usr/lib/rabbitmq/bin/rabbitmqctl"
HOST = "localhost"
# label -> (the variable that may name its root, the default root): as scripts/ensure-rabbitmq4
ROOTS = {
    "rmq4.0": ("DELAY_GATEWAY_RABBITMQ4_ROOT", "/var/cache/delay-gateway/rabbitmq-4.0-trixie"),
    "rmq4.3": ("DELAY_GATEWAY_RABBITMQ43_ROOT", "/var/cache/delay-gateway/rabbitmq-4.3-forky"),
}
RABBITMQ4_MARK = ".delay-gateway-complete"
# Adds header timestamp_in_ms and the timestamp property to every incoming publish that has
# none: the broker's arrival time, which the gateway counts x-delay from where present.
ARRIVAL_STAMP = "message_interceptors.incoming.set_header_timestamp.overwrite = false"


class NodeError(RuntimeError):
    pass


@dataclass(frozen=True)
class Runtime:
    """Which RabbitMQ runs a node: the host's own package (root "/"), or the one installed
    in a chroot by scripts/ensure-rabbitmq4 (4.0 or 4.3), run as that root's `rabbitmq` user in a mount
    namespace of its own where /proc, /dev and /sys are bind-mounted (without /proc the
    node's memory monitor is broken). The mounts die with the node's last process, so the
    host keeps no trace and the cached root is never written to but below /srv."""

    label: str  # "rmq3.10", "rmq4.0" or "rmq4.3": what test ids show
    root: str = "/"

    @property
    def chroot(self) -> bool:
        return self.root != "/"

    def inside(self, path: str) -> str:
        """`path` on the host as the node sees it."""
        return "/" + os.path.relpath(path, self.root) if self.chroot else path

    def data_dir(self) -> Optional[str]:
        return os.path.join(self.root, "srv", "delay-gateway") if self.chroot else None

    def owner(self) -> Optional[tuple]:
        """(uid, gid) of the root's rabbitmq user, who must own the node's files."""
        if not self.chroot:
            return None
        with open(os.path.join(self.root, "etc", "passwd")) as f:
            for line in f:
                fields = line.split(":")
                if fields[0] == "rabbitmq":
                    return int(fields[2]), int(fields[3])
        raise NodeError(f"no rabbitmq user in {self.root}/etc/passwd: run {self.provision}")

    @property
    def version(self) -> str:
        return self.label[len("rmq"):]

    @property
    def provision(self) -> str:
        return f"scripts/ensure-rabbitmq4 --version {self.version}"

    def check(self) -> None:
        if self.chroot and not os.path.exists(os.path.join(self.root, RABBITMQ4_MARK)):
            raise NodeError(f"no complete RabbitMQ {self.version} root at {self.root}: run {self.provision}")
        if not os.path.exists(os.path.join(self.root, SERVER.lstrip("/"))):
            raise NodeError(f"{SERVER} not found: run scripts/ensure-rabbitmq to install rabbitmq-server")

    def command(self, argv: Sequence[str], env: Dict[str, str], netns: Optional[str] = None) -> tuple:
        """(argv, environment) that run `argv` with `env` in this runtime (and in `netns`)."""
        prefix = ["ip", "netns", "exec", netns] if netns else []
        if not self.chroot:
            full = {k: v for k, v in os.environ.items() if not k.startswith("RABBITMQ_")}
            full.update(env)
            return prefix + list(argv), full
        uid, gid = self.owner()
        # Mounted in the namespace unshare made: they go away with the node's last process.
        script = ('set -e; r="$1"; u="$2"; shift 2; for d in proc dev sys; do mount --rbind "/$d" "$r/$d"; done; '
                  'exec chroot --userspec="$u" "$r" /usr/bin/env -i "$@"')
        clean = dict(PATH="/usr/sbin:/usr/bin:/sbin:/bin", LANG="C.UTF-8", LC_ALL="C.UTF-8", **env)
        return (prefix + ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c", script, "sh",
                          self.root, f"{uid}:{gid}",
                          *[f"{k}={v}" for k, v in clean.items()], *argv],
                dict(os.environ))


def open_files_raised() -> None:
    """In a node's process, before it runs the server: its open-files soft limit up to the hard
    one. RabbitMQ 3.x reserves file handles against it, and a node that reserved them all
    answers no one: at 1,024 that is about 309 quorum queues (six prefixes of the default
    chain); scripts/ensure-rabbitmq does the same for the main node."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    n = hard if hard != resource.RLIM_INFINITY else 1_048_576
    resource.setrlimit(resource.RLIMIT_NOFILE, (n, hard))


def open_files_set(limit: int) -> None:
    """In a node's process: this open-files limit, soft and hard (a test of what a low one does)."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))


def open_files_of(pid: int) -> tuple:
    """(soft, hard) open-files limit of a process, as /proc says ("unlimited" kept as text)."""
    with open(f"/proc/{pid}/limits") as f:
        for line in f:
            if line.startswith("Max open files"):
                soft, hard = line.split()[3:5]
                return soft, hard
    raise NodeError(f"no open-files limit for process {pid}")


PORT_ATTEMPTS = 3  # a node's first start, with its ports picked again when one was taken meanwhile
HOST_RUNTIME = Runtime("rmq3.10")
# Every broker version the tests know; test ids carry the label. Which of them a run uses is
# tests/conftest.py's choice (DELAY_GATEWAY_TEST_BROKERS).
BROKER_LABELS = ["rmq3.10", "rmq4.3", "rmq4.0"]
# The versions that can stamp arrival times (3.12+ has message interceptors).
HAS_ARRIVAL_STAMP = {"rmq4.0", "rmq4.3"}


def runtime_for(label: str) -> Runtime:
    """The runtime of "rmq4.3" or "4.3" (and so on)."""
    label = label if label.startswith("rmq") else "rmq" + label
    if label == HOST_RUNTIME.label:
        return HOST_RUNTIME
    if label not in ROOTS:
        raise NodeError(f"no RabbitMQ {label[3:]} here: the versions are "
                        + ", ".join(b[3:] for b in BROKER_LABELS))
    variable, default = ROOTS[label]
    return Runtime(label, os.environ.get(variable) or default)


def free_port() -> int:
    """A free port below 30000 (rabbitmqctl talks to a node from its dist port + 10000), and
    above the gateways' metrics ports."""
    return launcher.free_port(20000, 29999, avoid=(25672,))


def port_open(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


def write_cookie(home: str) -> None:
    """The Erlang cookie the nodes of one cluster (and their rabbitmqctl) share."""
    cookie = os.path.join(home, ".erlang.cookie")
    if not os.path.exists(cookie):
        with open(cookie, "w") as f:
            f.write("DELAYGATEWAYFAULTS" + os.urandom(8).hex().upper())
        os.chmod(cookie, 0o400)


@dataclass
class Node:
    """One RabbitMQ node; `start`, `stop`, `kill`, `ctl` drive it.

    On loopback by default (name@localhost). Given a network namespace and its address
    (tests/faults/netns.py), it lives there as name@ADDRESS and clients on the host reach it
    through a forwarder on 127.0.0.1:client_port."""

    name: str  # short name; the node is name@localhost
    home: str  # shared by the nodes of one cluster: the cookie lives here
    amqp_port: int = field(default_factory=free_port)
    dist_port: int = field(default_factory=free_port)
    extra_config: List[str] = field(default_factory=list)
    advanced_config: str = "[]."
    plugins: List[str] = field(default_factory=list)  # enabled at boot (rabbitmq_management, ...)
    ports: Dict[str, int] = field(default_factory=dict)  # more listeners: config key -> port
    open_files: Optional[int] = None  # this open-files limit (soft and hard); None: the most allowed
    process: Optional[subprocess.Popen] = None
    runtime: Runtime = HOST_RUNTIME
    netns: Optional[str] = None
    ip: str = "127.0.0.1"
    client_port: Optional[int] = None  # the forwarder's port on the host, for a node in a namespace

    @property
    def node(self) -> str:
        return f"{self.name}@{self.ip if self.netns else HOST}"

    @property
    def dir(self) -> str:
        return os.path.join(self.home, self.name)

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.client_port or self.amqp_port}/%2F"

    def env(self) -> Dict[str, str]:
        d = self.runtime.inside(self.dir)
        return dict(
            HOME=self.runtime.inside(self.home),
            RABBITMQ_NODENAME=self.node,
            RABBITMQ_USE_LONGNAME="true" if self.netns else "false",
            RABBITMQ_NODE_IP_ADDRESS=self.ip,
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

    def _write_files(self) -> None:
        os.makedirs(os.path.join(self.dir, "log"), exist_ok=True)
        write_cookie(self.home)
        files = {
            "rabbitmq-env.conf": "",
            "enabled_plugins": f"[{','.join(self.plugins)}].\n",
            "advanced.config": self.advanced_config + "\n",
            "rabbitmq.conf": "\n".join([
                f"listeners.tcp.default = {self.ip}:{self.amqp_port}",
                "loopback_users = none",
                # The default 40% of RAM and 50 MB disk limits would make a crowded CI box
                # raise alarms we did not ask for.
                "vm_memory_high_watermark.relative = 0.9",
                "disk_free_limit.absolute = 1MB",
                *(f"{key} = {port}" for key, port in self.ports.items()),
                *self.extra_config, ""]),
        }
        for name, text in files.items():
            with open(os.path.join(self.dir, name), "w") as f:
                f.write(text)
        owner = self.runtime.owner()
        if owner:  # the chroot's rabbitmq user runs the node and rabbitmqctl
            for base, dirs, names in os.walk(self.home):
                for entry in [base] + [os.path.join(base, n) for n in dirs + names]:
                    os.lchown(entry, *owner)

    def start(self, timeout: float = 90) -> "Node":
        self.runtime.check()
        first = self.process is None
        for attempt in range(PORT_ATTEMPTS):
            self._write_files()
            log = open(os.path.join(self.dir, "log", "console.log"), "ab")
            argv, env = self.runtime.command([SERVER], self.env(), self.netns)
            self.process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True,
                                            preexec_fn=open_files_raised if self.open_files is None else
                                            functools.partial(open_files_set, self.open_files))
            try:
                self.await_startup(timeout)
                return self
            except NodeError as exc:
                # A port picked as free, taken by another test's node before this one bound it:
                # on a first start (no client knows its ports yet), pick them all again.
                if not first or self.netns or "eaddrinuse" not in str(exc) or attempt == PORT_ATTEMPTS - 1:
                    raise
                self.amqp_port, self.dist_port = free_port(), free_port()
                self.ports = {key: free_port() for key in self.ports}
        return self

    def await_startup(self, timeout: float = 90) -> None:
        def started() -> bool:
            if self.process is not None and self.process.poll() is not None:
                raise NodeError(f"{self.node} exited with {self.process.returncode}: {self.console_tail()}")
            # A node in a namespace cannot be probed from here: its rabbitmqctl tells.
            return bool((self.netns or port_open(self.amqp_port))
                        and self.ctl("await_startup", "--timeout", "10", check=False).returncode == 0)
        if not wait_until(started, timeout, 0.3, fail=False):
            raise NodeError(f"{self.node} did not start within {timeout}s: {self.console_tail()}")

    def log_lines(self, *words: str, lines: int = 40) -> str:
        """The last lines of the node's own log that mention any of `words`."""
        path = os.path.join(self.dir, "log", f"{self.node}.log")
        try:
            with open(path, errors="replace") as f:
                found = [line for line in f if any(w in line for w in words)]
        except OSError:
            return f"(no log at {path})"
        return "".join(found[-lines:])

    def console_tail(self, lines: int = 30) -> str:
        try:
            with open(os.path.join(self.dir, "log", "console.log"), errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return "(no console log)"

    def ctl(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        longname = ["-l"] if self.netns else []
        argv, env = self.runtime.command([CTL, *longname, "-n", self.node, *args], self.env(), self.netns)
        result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
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

    def restart(self, timeout: float = 90) -> None:
        self.stop()
        self.start(timeout)


class Cluster:
    """Nodes sharing a cookie; with more than one they are joined into a cluster.

    `runtime` says which RabbitMQ runs them; `lan` (tests/faults/netns.Lan) puts each node
    in a network namespace of its own, so that one can be cut off from the others."""

    def __init__(self, names: Sequence[str], extra_config: Sequence[str] = (),
                 advanced_config: str = "[].", runtime: Runtime = HOST_RUNTIME, lan=None,
                 plugins: Sequence[str] = (), open_files: Optional[int] = None, ports: Sequence[str] = ()) -> None:
        self.runtime, self.lan = runtime, lan
        base = runtime.data_dir()
        if base:
            os.makedirs(base, exist_ok=True)
        self.home = tempfile.mkdtemp(prefix="delay-gateway-nodes-", dir=base)
        os.chmod(self.home, 0o755)
        self.nodes = [Node(n, self.home, extra_config=list(extra_config), advanced_config=advanced_config,
                           runtime=runtime, plugins=list(plugins), open_files=open_files,
                           ports={key: free_port() for key in ports}) for n in names]
        if lan is not None:
            for i, node in enumerate(self.nodes):
                node.netns, node.ip = lan.namespaces[i], lan.addresses[i]
                node.amqp_port = 5672  # each namespace has its own ports
                node.dist_port = 25672
                node.client_port = lan.forward(i, node.amqp_port)

    @property
    def version(self) -> str:
        return self.nodes[0].ctl("version").stdout.strip()

    def start(self) -> "Cluster":
        # Booting is most of the cost: boot every node at once, then join them one by one.
        write_cookie(self.home)
        errors: List[BaseException] = []

        def boot(node: Node) -> None:
            try:
                node.start()
            except BaseException as exc:  # noqa: B036 - re-raised below, in this thread
                errors.append(exc)
        threads = [threading.Thread(target=boot, args=(n,)) for n in self.nodes]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        first, *others = self.nodes
        for node in others:
            node.ctl("stop_app")
            node.ctl("join_cluster", first.node)
            node.ctl("start_app")
        for node in self.nodes:
            node.ctl("enable_feature_flag", "all", check=False)
        return self

    def enable_khepri(self) -> None:
        """Move the cluster's metadata store to Khepri (Raft), as RabbitMQ 4.3 has nothing
        else; on 4.0.x the `khepri_db` feature flag is experimental and must be named."""
        self.nodes[0].ctl("enable_feature_flag", "--experimental", "khepri_db", timeout=180)

    def metadata_store(self) -> str:
        out = self.nodes[0].ctl("eval", "rabbit_khepri:is_enabled().", check=False).stdout.strip()
        return "khepri" if out == "true" else "mnesia"

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
        if self.lan is not None:
            self.lan.close()
        shutil.rmtree(self.home, ignore_errors=True)


def unique_names(count: int, tag: str = "faults") -> List[str]:
    stamp = f"{os.getpid()}{os.urandom(2).hex()}"
    return [f"{tag}{stamp}n{i}" for i in range(1, count + 1)]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m tests.faults.nodes --nodes 3`: start private nodes (clustered when more
    than one), print their URLs, keep them until Ctrl-C or SIGTERM, then remove them."""
    import argparse
    import shlex
    p = argparse.ArgumentParser(prog="scripts/rabbit-cluster", description=main.__doc__)
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--name", default="delaygw", help="node names are NAME1@localhost, NAME2@localhost, ...")
    p.add_argument("--broker", choices=["3.10", "4.0", "4.3"], default="3.10",
                   help="3.10: the host's rabbitmq-server; 4.0: Debian trixie's, 4.3: Debian forky's, from "
                        "the roots scripts/ensure-rabbitmq4 caches")
    p.add_argument("--arrival-stamp", action="store_true",
                   help="4.x: stamp incoming messages with the arrival time (timestamp_in_ms)")
    p.add_argument("--khepri", action="store_true",
                   help="4.0: enable the experimental khepri_db feature flag (4.3 has Khepri only)")
    p.add_argument("--advanced-config", default="[].", metavar="TERMS",
                   help="each node's advanced.config, Erlang terms ending in a dot (default: [].)")
    p.add_argument("--plugins", default="", metavar="NAMES",
                   help="plugins each node enables at boot, comma-separated (rabbitmq_management, ...)")
    args = p.parse_args(argv)
    if args.nodes < 1:
        p.error("--nodes must be at least 1")
    if args.arrival_stamp and args.broker == "3.10":
        p.error("--arrival-stamp needs --broker 4.0 or 4.3")
    if args.khepri and args.broker != "4.0":
        p.error("--khepri needs --broker 4.0 (4.3 has Khepri from the first boot)")
    runtime = runtime_for(args.broker)
    try:
        runtime.check()
    except NodeError as exc:
        print(f"rabbit-cluster: {exc}", file=sys.stderr)
        return 1
    cluster = Cluster([f"{args.name}{i}" for i in range(1, args.nodes + 1)], runtime=runtime,
                      extra_config=[ARRIVAL_STAMP] if args.arrival_stamp else [], advanced_config=args.advanced_config,
                      plugins=[name.strip() for name in args.plugins.split(",") if name.strip()])
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    try:
        print(f"rabbit-cluster: starting {args.nodes} RabbitMQ {args.broker} node(s)...", file=sys.stderr, flush=True)
        cluster.start()
        if args.khepri:
            cluster.enable_khepri()
        print("DELAY_GATEWAY_URL=" + ",".join(cluster.urls), flush=True)
        print(f"# RabbitMQ {cluster.version}, metadata store {cluster.metadata_store()}", flush=True)
        for node in cluster.nodes:
            ctl, _ = runtime.command([CTL, "-n", node.node], node.env())
            if not runtime.chroot:  # the cookie is in the nodes' own HOME
                ctl = ["env", f"HOME={cluster.home}", *ctl]
            print(f"# {node.node}: rabbitmqctl is {shlex.join(ctl)}", flush=True)
        print("# Ctrl-C stops and removes them", flush=True)
        while not stop:  # until stopped (the command's own life, not a test's wait)
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    except NodeError as exc:
        print(f"rabbit-cluster: {exc}", file=sys.stderr)
        return 1
    finally:
        cluster.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
