"""Releases: one version, pyproject.toml's, named alike by `delay-gateway --version`, the
Helm chart (its version and appVersion, so the image tag it runs by default), the kustomize
base and the guides; CHANGELOG.md's newest entry is that version's, and every entry says
what changed, what to do when upgrading and which formats it touches."""

import re
import subprocess
import sys
import tomllib
from datetime import date
from pathlib import Path
from typing import Dict, List, Tuple

import yaml

from .k8s.manifests import CHART, pod_spec, render
from .support import ROOT

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
