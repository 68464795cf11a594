"""Releases: one version, pyproject.toml's, named alike by `delay-gateway --version`, the
Helm chart (its version and appVersion, so the image tag it runs by default), the kustomize
base and the guides; CHANGELOG.md's newest entry is that version's, and every entry says
what changed, what to do when upgrading and which formats it touches. scripts/release
refuses, in one line, a version without its entry or a chart of another version.

And the wheel as a user installs it: built from this checkout once per session by
scripts/build-dist, the very step of scripts/release that builds the released sdist and wheel
(python -m build with isolation: the sdist, then the wheel from it; twine check --strict),
installed with its dependencies into a fresh virtual environment, and run from there, away
from the source tree: its `delay-gateway run` against each suite broker, and its
`delay-gateway selftest` seeing a message delivered through it. A few seconds per broker,
plus the build (about 8 s: the isolated build environments) and the install once."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import tomllib
import urllib.request
import zipfile
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest
import yaml

from .k8s.manifests import CHART, pod_spec, render
from .support import ROOT, broker_url, chain_args, free_port, report_figures, wait_until

HEADINGS = ["What changed", "What to do when upgrading", "Formats touched"]
ENTRY = re.compile(r"^## (\d+\.\d+\.\d+) - (unreleased|\d{4}-\d{2}-\d{2})$")


def version() -> str:
    return tomllib.loads((Path(ROOT) / "pyproject.toml").read_text())["project"]["version"]


def changelog() -> List[Tuple[str, str, Dict[str, str]]]:
    """(version, date or "unreleased", {heading: text}) of each entry, newest first."""
    entries: List[Tuple[str, str, Dict[str, str]]] = []
    heading = None
    for line in (Path(ROOT) / "CHANGELOG.md").read_text().splitlines():
        if line.startswith("## "):
            found = ENTRY.match(line)
            assert found, f"CHANGELOG.md: {line!r} is not \"## X.Y.Z - YYYY-MM-DD\" (or \"- unreleased\")"
            entries.append((found.group(1), found.group(2), {}))
            heading = None
        elif line.startswith("### ") and entries:
            heading = line[4:].strip()
            entries[-1][2][heading] = ""
        elif heading is not None:
            entries[-1][2][heading] += line + "\n"
    return entries


def test_the_version_has_one_source_and_every_place_that_names_it_agrees():
    """pyproject.toml's version is what `delay-gateway --version` says (the installed
    metadata), the chart's version and appVersion, CHANGELOG.md's newest entry, and every
    image tag and version label the kustomize base, the Dockerfile and the guides name."""
    v = version()
    out = subprocess.run([sys.executable, "-m", "gateway", "--version"], cwd=ROOT, capture_output=True, text=True)
    assert out.stdout.strip() == f"delay-gateway {v}", \
        f"{out.stdout.strip()!r}: stale metadata of the installed project? scripts/bootstrap installs it again"
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert (chart["version"], chart["appVersion"]) == (v, v)
    assert changelog()[0][0] == v
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    named: Dict[str, set] = {}
    for relative in tracked:
        if relative == "CHANGELOG.md" or not relative.endswith((".md", ".yaml", ".yml", "Dockerfile")):
            continue
        text = (Path(ROOT) / relative).read_text()
        for pattern in (r"rabbitmq-delay-gateway:(\d+\.\d+\.\d+)", r"app\.kubernetes\.io/version: \"([^\"]+)\"",
                        r"newTag: \"?(\d+\.\d+\.\d+)"):
            named.setdefault(relative, set()).update(re.findall(pattern, text))
    assert {path: found for path, found in named.items() if found - {v}} == {}
    assert len([path for path, found in named.items() if found]) >= 5  # the patterns still find them


def test_the_chart_runs_the_image_of_its_version_by_default():
    v = version()
    images, labels = set(), set()
    for doc in render({}):
        labels.add(doc["metadata"].get("labels", {}).get("app.kubernetes.io/version"))
        if doc["kind"] in ("Deployment", "Job", "Pod"):
            spec = pod_spec(doc)
            images |= {c["image"] for c in spec["containers"] + spec.get("initContainers", [])}
    assert images == {f"rabbitmq-delay-gateway:{v}"}
    assert labels == {v}


def test_every_changelog_entry_says_what_changed_what_to_do_and_the_formats_touched():
    entries = changelog()
    assert len(entries) >= 2
    versions = [tuple(int(n) for n in v.split(".")) for v, _, _ in entries]
    assert versions == sorted(versions, reverse=True) and len(set(versions)) == len(versions)
    assert [when for _, when, _ in entries[1:] if when == "unreleased"] == [], "only the newest may be unreleased"
    dates = [date.fromisoformat(when) for _, when, _ in entries if when != "unreleased"]
    assert dates == sorted(dates, reverse=True)
    for v, when, sections in entries:
        assert list(sections) == HEADINGS, (v, list(sections))
        for heading, text in sections.items():
            assert text.strip(), f"{v}: nothing under {heading!r}"
            if when != "unreleased":
                assert "TODO" not in text, f"{v} is dated {when} but its {heading!r} still holds a TODO"


# -- scripts/release's checks, in a repository of their own -------------------------------------
RELEASE = Path(ROOT) / "scripts" / "release"
BUILD_DIST = Path(ROOT) / "scripts" / "build-dist"
CHART_YAML = "deploy/k8s/helm/delay-gateway/Chart.yaml"


def without_entry(text: str, version: str) -> str:
    """CHANGELOG.md less the entry of this version."""
    return re.sub(rf"^## {re.escape(version)} - .*?(?=^## )", "", text, flags=re.M | re.S)


def release_in(tmp_path: Path, changes: Dict[str, Optional[str]]) -> subprocess.CompletedProcess:
    """scripts/release run in a new git repository holding the script, pyproject.toml,
    CHANGELOG.md and the chart's Chart.yaml as they are here, but for `changes` (None:
    left out), committed. Its Python is one that does not exist: the checks come first."""
    repo = tmp_path / "repo"
    files = {name: (Path(ROOT) / name).read_text() for name in ("pyproject.toml", "CHANGELOG.md", CHART_YAML)}
    files.update(changes)
    for name, text in [("scripts/release", RELEASE.read_text()), *files.items()]:
        if text is not None:
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            (repo / name).write_text(text)
    (repo / "scripts" / "release").chmod(0o755)
    git = ["git", "-c", "user.name=release test", "-c", "user.email=release-test@example.invalid"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "a release to check"]):
        subprocess.run([*git, *args], cwd=repo, check=True, capture_output=True)
    return subprocess.run([str(repo / "scripts" / "release")], cwd=repo, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "DELAY_GATEWAY_RELEASE_PYTHON": str(tmp_path / "no-python")})


@pytest.mark.parametrize("case", ["no entry", "no changelog", "an older newest entry", "another chart version"])
def test_release_refuses_a_version_without_its_changelog_entry_or_chart(tmp_path, case):
    v, older = version(), changelog()[1][0]
    changelog_text = (Path(ROOT) / "CHANGELOG.md").read_text()
    changes: Dict[str, Optional[str]] = {
        "no entry": {"CHANGELOG.md": without_entry(changelog_text, v)},
        "no changelog": {"CHANGELOG.md": None},
        "an older newest entry": {"pyproject.toml": (Path(ROOT) / "pyproject.toml").read_text().replace(
            f'version = "{v}"', f'version = "{older}"')},
        "another chart version": {CHART_YAML: (CHART / "Chart.yaml").read_text().replace(
            f'appVersion: "{v}"', 'appVersion: "0.0.1"')},
    }[case]
    assert all(text != (Path(ROOT) / name).read_text() if text is not None else True
               for name, text in changes.items()), "the change did not apply"
    r = release_in(tmp_path, changes)
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and r.stdout == "", r.stderr
    said = {"no entry": f"no entry for {v}", "no changelog": "no CHANGELOG.md",
            "an older newest entry": f"newest entry is {v}, not {older}",
            "another chart version": f"appVersion 0.0.1: set both to {v}"}[case]
    assert said in r.stderr, r.stderr
    assert not (tmp_path / "repo" / "dist").exists()


def test_release_takes_this_repositorys_version_entry_and_chart(tmp_path):
    """The same checks pass here; the next step finds the test's missing Python."""
    r = release_in(tmp_path, {})
    assert r.returncode == 1 and "lacks build, twine or helm-python-sdk" in r.stderr, r.stderr


# -- the wheel, installed into a fresh environment ------------------------------------------------
@dataclass(frozen=True)
class Installed:
    bin: Path  # the fresh environment's bin directory
    sdist: Path
    wheel: Path
    built: str  # what the build printed
    figures: str  # how long the build and the install took


def test_release_builds_the_package_with_the_step_this_test_runs():
    """scripts/release makes the sdist and the wheel with scripts/build-dist (the commit's, from
    the commit's files), the script the fixture below runs; nothing else under scripts/ runs
    `python -m build`."""
    assert RELEASE.read_text().count('"$SRC/scripts/build-dist" "$SRC" "$DIST"') == 1
    builders = [path.name for path in (Path(ROOT) / "scripts").iterdir() if path.is_file()
                and re.search(r"^\s*[^#\s].*-m build\b", path.read_text(errors="replace"), flags=re.M)]
    assert builders == ["build-dist"]


@pytest.fixture(scope="session")
def installed(tmp_path_factory) -> Installed:
    """A fresh virtual environment (no pip, no packages: pip of this environment installs
    into it, `--python`) holding the wheel scripts/build-dist builds from this checkout's files
    (tracked and new, as they are now), as scripts/release builds it from a commit's, and the
    dependencies pip resolves for it, as for a user."""
    where = tmp_path_factory.mktemp("release")
    source, dist, venv = where / "source", where / "dist", where / "venv"
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split("\0")
    for relative in filter(None, listed):
        if (Path(ROOT) / relative).is_file():
            (source / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(Path(ROOT) / relative, source / relative)
    started = time.monotonic()
    # isolated, as released: pip installs pyproject.toml's build backend into a build
    # environment of its own, from the index it is configured with (as for a user)
    built = subprocess.run([str(BUILD_DIST), str(source), str(dist)], capture_output=True, text=True, timeout=300,
                           env={**outside_env(), "DELAY_GATEWAY_RELEASE_PYTHON": sys.executable})
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-3000:]
    sdist, wheel = map(Path, built.stdout.split())
    build_s, started = time.monotonic() - started, time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60,
                   env=outside_env())
    pip = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
                          "--disable-pip-version-check", "--quiet", str(wheel)],
                         capture_output=True, text=True, timeout=600, cwd=where, env=outside_env())
    assert pip.returncode == 0 and (venv / "bin" / "delay-gateway").is_file(), pip.stdout + pip.stderr[-3000:]
    return Installed(venv / "bin", sdist, wheel, built.stderr,
                     f"sdist and wheel built by scripts/build-dist in {build_s:.1f} s, the wheel installed with its "
                     f"dependencies into a fresh environment in {time.monotonic() - started:.1f} s")


def outside_env() -> Dict[str, str]:
    """The environment for the installed command: no setting of this run's and no Python
    path of its (the fresh environment finds only its own packages)."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("DELAY_GATEWAY_", "PYTHON"))}


def test_the_wheel_installs_its_version_and_runs_from_its_own_files(installed, tmp_path):
    report_figures("release", installed.figures)
    v = version()
    assert installed.wheel.name == f"rabbitmq_delay_gateway-{v}-py3-none-any.whl"
    said = subprocess.run([str(installed.bin / "delay-gateway"), "--version"], cwd=tmp_path, env=outside_env(),
                          capture_output=True, text=True, timeout=60)
    assert said.stdout.strip() == f"delay-gateway {v}", said.stderr
    code = "import gateway, topology, pika; print(gateway.__file__, topology.__file__, pika.__file__)"
    where = subprocess.run([str(installed.bin / "python"), "-c", code], cwd=tmp_path, env=outside_env(),
                           capture_output=True, text=True, timeout=60, check=True)
    assert where.stdout.count(str(installed.bin.parent)) == 3, where.stdout  # the wheel's code, its own pika
    licence = (Path(ROOT) / "LICENSE").read_bytes()
    info = f"rabbitmq_delay_gateway-{v}.dist-info"
    with zipfile.ZipFile(installed.wheel) as wheel:  # the licence the metadata names, in the wheel
        assert wheel.read(f"{info}/licenses/LICENSE") == licence
        metadata = wheel.read(f"{info}/METADATA").decode()
        assert "License-Expression: Apache-2.0" in metadata and "License-File: LICENSE" in metadata
    [site] = installed.bin.parent.glob(f"lib/python*/site-packages/{info}")  # and as installed
    assert (site / "licenses" / "LICENSE").read_bytes() == licence
    assert installed.sdist.name == f"rabbitmq_delay_gateway-{v}.tar.gz"
    with tarfile.open(installed.sdist) as sdist:
        member = sdist.extractfile(f"rabbitmq_delay_gateway-{v}/LICENSE")
        assert member is not None and member.read() == licence
    # no warning of the build backend's (python -m build shows each as "WARNING ..."): such as
    # setuptools' for a licence file it cannot find, which it says fails builds from 2027
    assert "WARNING" not in installed.built, installed.built[-3000:]


def readyz(port: int) -> Optional[int]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
            return int(r.status)
    except OSError:
        return None


def test_the_installed_wheels_gateway_delivers_its_selftest(installed, make_chain, tmp_path):
    """The installed `delay-gateway run` against this broker, ready on its metrics port; the
    installed `delay-gateway selftest` publishes through it and sees its message delivered,
    not early; SIGTERM stops the gateway with exit 0."""
    chain = make_chain(max_level=4)
    env = {**outside_env(), "DELAY_GATEWAY_URL": broker_url()}
    port = free_port()
    log = tmp_path / "gateway.log"
    with log.open("w") as out:
        gateway = subprocess.Popen([str(installed.bin / "delay-gateway"), "run", *chain_args(chain),
                                    "--metrics-port", str(port), "--log-format", "json"],
                                   cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: readyz(port) == 200 or gateway.poll() is not None, 60, interval=0.1,
                   what="the installed gateway's /readyz")
        assert gateway.poll() is None, log.read_text()[-3000:]
        started = time.monotonic()
        r = subprocess.run([str(installed.bin / "delay-gateway"), "selftest", *chain_args(chain), "--delay-ms", "1000",
                            "--timeout", "30"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        result = json.loads(r.stdout.strip().splitlines()[-1])
        assert result["delivered"] is True and result["late_ms"] >= 0, result
        report_figures("release", f"selftest of the installed wheel: {time.monotonic() - started:.1f} s")
    finally:
        gateway.send_signal(signal.SIGTERM)
        code = gateway.wait(60)
    assert code == 0, log.read_text()[-3000:]
