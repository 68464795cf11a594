"""Podman for the image tests: as root with runc and cgroupfs (no systemd here), the
host's network (no container network is set up), and explicit ulimits within this
machine's hard limits (podman's defaults exceed them). scripts/ensure-podman installs
podman and runc and imports the local base image (no registry is reachable)."""

import resource
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Dict, List, Optional, Sequence
from urllib.parse import urlsplit, urlunsplit

from ..support import ROOT, wait_until

PODMAN = ["podman", "--runtime", "runc", "--cgroup-manager", "cgroupfs"]
DOCKERFILE = Path(ROOT) / "deploy" / "k8s" / "Dockerfile"


def ulimits() -> List[str]:
    """--ulimit for open files and processes: podman's defaults (1048576 files) exceed what
    this machine lets a process raise its limits to."""
    out = []
    for name, limit, wanted in (("nofile", resource.RLIMIT_NOFILE, 16384), ("nproc", resource.RLIMIT_NPROC, 4096)):
        hard = resource.getrlimit(limit)[1]
        value = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        out += ["--ulimit", f"{name}={value}:{value}"]
    return out


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run([*PODMAN, *args], capture_output=True, text=True, timeout=timeout)
    if check:
        assert r.returncode == 0, f"podman {' '.join(args[:2])}: {r.stderr[-3000:]}"
    return r


def base_image(pypy: bool = False) -> str:
    """The Dockerfile's PYTHON_IMAGE: the local Debian bookworm root scripts/ensure-podman
    imported (with `pypy`, its Debian trixie root with PyPy)."""
    r = subprocess.run([str(Path(ROOT) / "scripts" / "ensure-podman"), "--check", *(["--pypy"] if pypy else [])],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"{r.stderr.strip()} (scripts/test does it)"
    return r.stdout.strip().splitlines()[-1]


def build(tag: str, pypy: bool = False) -> float:
    """Builds the image from the repository's root as its README says (with `pypy`, its PyPy
    variant); returns the seconds it took."""
    started = time.monotonic()
    podman("build", "--network", "host", *ulimits(), "--build-arg", f"PYTHON_IMAGE={base_image(pypy)}",
           *(["--build-arg", "PYTHON=pypy3"] if pypy else []), "-f", str(DOCKERFILE), "-t", tag, str(ROOT),
           timeout=900)
    return time.monotonic() - started


def without_password(url: str) -> tuple:
    """(the URL less its password, the password): the chart's Secret holds them apart."""
    parts = urlsplit(url)
    netloc = parts.hostname or ""
    if parts.port:
        netloc = f"{netloc}:{parts.port}"
    if parts.username:
        netloc = f"{parts.username}@{netloc}"
    return urlunsplit(parts._replace(netloc=netloc)), parts.password or ""


class Container:
    """One container on the host's network, removed by remove()."""

    def __init__(self, name: str, image: str, args: Sequence[str], env: Dict[str, str],
                 options: Sequence[str] = (), metrics_port: Optional[int] = None) -> None:
        self.name, self.metrics_port = name, metrics_port
        flags = [f for k, v in sorted(env.items()) for f in ("--env", f"{k}={v}")]
        podman("run", "--detach", "--name", name, "--network", "host", *ulimits(), *options, *flags, image, *args)

    def inspect(self, template: str) -> str:
        return podman("inspect", "--format", template, self.name).stdout.strip()

    def running(self) -> bool:
        return self.inspect("{{.State.Running}}") == "true"

    def logs(self) -> str:
        r = podman("logs", self.name, check=False)
        return r.stdout + r.stderr

    def stdout(self) -> str:
        return str(podman("logs", self.name).stdout)

    def wait(self, timeout: float = 120) -> int:
        return int(podman("wait", self.name, timeout=timeout).stdout.strip())

    def readyz(self) -> Optional[int]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/readyz", timeout=2) as r:
                return int(r.status)
        except OSError:
            return None

    def wait_ready(self, timeout: float = 60) -> None:
        def ready() -> bool:
            if self.readyz() == 200:
                return True
            assert self.running(), f"{self.name} exited: {self.logs()[-3000:]}"
            return False
        if not wait_until(ready, timeout, 0.2, fail=False):
            raise AssertionError(f"{self.name} not ready after {timeout} s: {self.logs()[-3000:]}")

    def remove(self) -> None:
        podman("rm", "--force", "--time", "5", self.name, check=False, timeout=60)


def from_pod(doc: dict, container: dict, env: Dict[str, str], home: Path, secrets: Dict[str, Dict[str, str]]) \
        -> List[str]:
    """podman options for what a rendered pod asks of its container: the user and group, a
    read-only root, no privilege escalation, dropped capabilities, and its volumes (a
    Secret's items as read-only files, an emptyDir as a tmpfs). Podman 4.3's play kube
    crashes on a Secret volume, so the pod is taken apart here instead."""
    spec = doc["spec"] if doc["kind"] == "Pod" else doc["spec"]["template"]["spec"]
    pod_context, context = spec.get("securityContext", {}), container.get("securityContext", {})
    uid = context.get("runAsUser", pod_context.get("runAsUser"))
    gid = context.get("runAsGroup", pod_context.get("runAsGroup"))
    options: List[str] = []
    if uid is not None:
        options += ["--user", f"{uid}:{gid}" if gid is not None else str(uid)]
    if context.get("readOnlyRootFilesystem"):
        options.append("--read-only")
    if context.get("allowPrivilegeEscalation") is False:
        options += ["--security-opt", "no-new-privileges"]
    for capability in context.get("capabilities", {}).get("drop", []):
        options += ["--cap-drop", capability]
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        if "secret" in volume:
            where = home / mount["name"]
            where.mkdir(parents=True, exist_ok=True)
            data = secrets[volume["secret"]["secretName"]]
            for item in volume["secret"]["items"]:
                path = where / item["path"]
                path.write_text(data[item["key"]])
                path.chmod(0o444)
            options += ["--volume", f"{where}:{mount['mountPath']}:ro"]
        elif "emptyDir" in volume:
            options += ["--tmpfs", f"{mount['mountPath']}:rw,size=16m,mode=1777"]
    return options
