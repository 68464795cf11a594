"""A small stand-in for the kubelet: runs the containers the chart renders as local processes,
with exactly their arguments and environment. ConfigMap references resolve to the rendered
ConfigMaps, the broker Secret to the test's broker, files mounted from Secrets to files in
a directory of the pod's own (paths in the environment point there), and the metrics port
to a free port of the host (all pods share one network here). Readiness is the readiness
probe's: GET /readyz on that port."""

import itertools
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Dict, List, Optional

from ..launcher import free_port
from ..wait import wait_until

from .manifests import by_kind, effective_env, pod_spec

DELAY_GATEWAY = str(Path(sys.executable).parent / "delay-gateway")


class Kubelet:
    def __init__(self, root: Path, secrets: Dict[str, Dict[str, str]]) -> None:
        self.root, self.secrets = root, secrets
        self.pods: List[Pod] = []
        self._numbers = itertools.count()

    def start(self, doc: dict, docs: List[dict], name: Optional[str] = None) -> "Pod":
        pod = Pod(self, doc, by_kind(docs, "ConfigMap"), name or f"{doc['metadata']['name']}-{next(self._numbers)}")
        self.pods.append(pod)
        return pod

    def run_to_completion(self, doc: dict, docs: List[dict], timeout: float = 60) -> subprocess.CompletedProcess:
        pod = self.start(doc, docs)
        try:
            pod.proc.wait(timeout)
        finally:
            pod.kill()
        return subprocess.CompletedProcess(pod.argv, pod.proc.returncode, pod.stdout.read_text(), pod.logs())

    def stop_all(self) -> None:
        for pod in self.pods:
            pod.kill()


class Pod:
    def __init__(self, kubelet: Kubelet, doc: dict, config_maps: Dict[str, dict], name: str) -> None:
        spec = pod_spec(doc)
        [container] = spec["containers"]
        home = kubelet.root / name
        mounts = {}
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for m in container.get("volumeMounts", []):
            where = home / m["mountPath"].lstrip("/")
            where.mkdir(parents=True, exist_ok=True)
            volume = volumes[m["name"]]
            if "secret" in volume:
                data = kubelet.secrets[volume["secret"]["secretName"]]
                for item in volume["secret"]["items"]:
                    (where / item["path"]).write_text(data[item["key"]])
            mounts[m["mountPath"]] = str(where)
        env = {}
        for key, value in effective_env(container, config_maps).items():
            if isinstance(value, tuple):
                _, secret, item = value
                value = kubelet.secrets[secret][item]
            for path, local in sorted(mounts.items(), key=lambda m: -len(m[0])):
                if value.startswith(path + "/"):
                    value = local + value[len(path):]
                    break
            env[key] = value
        self.metrics_port = None
        if "DELAY_GATEWAY_METRICS_PORT" in env and container.get("ports"):
            self.metrics_port = free_port()
            env["DELAY_GATEWAY_METRICS_PORT"] = str(self.metrics_port)
        self.name, self.env = name, env
        self.argv = [DELAY_GATEWAY, *container.get("args", [])]
        clean = {k: v for k, v in os.environ.items() if not k.startswith("DELAY_GATEWAY_")}
        # logs go to files (a pipe nobody reads would block a chatty process)
        self.stdout, self.stderr = home / "stdout", home / "stderr"
        with open(self.stdout, "w") as out, open(self.stderr, "w") as err:
            self.proc = subprocess.Popen(self.argv, env={**clean, **env, "PYTHONUNBUFFERED": "1"}, cwd=home,
                                         stdout=out, stderr=err, text=True)

    def logs(self) -> str:
        return self.stderr.read_text()

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/readyz", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def wait_ready(self, timeout: float = 30) -> "Pod":
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: {self.logs()[-2000:]}")
            return self.ready()
        wait_until(ready, timeout, what=f"{self.name} ready")
        return self

    def terminate(self) -> None:
        """What Kubernetes does to a pod it removes: SIGTERM, then the grace period."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float = 30) -> int:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
