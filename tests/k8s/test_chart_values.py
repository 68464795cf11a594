"""The chart's values as a user writes them: a misspelt key is an error that names it (the
schema is closed throughout), and each of the usual chart conventions (nameOverride,
fullnameOverride, existingSecret or an inline Secret, extraEnv, podLabels, podAnnotations,
topologySpreadConstraints, priorityClassName, serviceAccount, the security contexts) shows
up in the objects rendered by the real Helm engine, which stay valid Kubernetes objects.
About 10 s."""

import json
from typing import Iterator, List, Tuple

import helm_python as helm
import kubernetes_validate
import pytest

from .manifests import CHART, by_kind, effective_env, is_built_in, notes, pod_spec, render
from .test_chart import KUBERNETES

POD_KINDS = ("Deployment", "Job", "Pod")


def pods(docs: List[dict]) -> List[dict]:
    return [d for d in docs if d["kind"] in POD_KINDS]


def pod_metadata(doc: dict) -> dict:
    return doc["metadata"] if doc["kind"] == "Pod" else doc["spec"]["template"]["metadata"]


def valid(docs: List[dict]) -> List[dict]:
    for doc in docs:
        if is_built_in(doc):
            for version in KUBERNETES:
                kubernetes_validate.validate(doc, version, strict=True)
    return docs


# -- a typo is an error naming the key ---------------------------------------------------
@pytest.mark.parametrize("values,key", [
    ({"maxlevel": 24}, "maxlevel"),
    ({"max_level": 24}, "max_level"),
    ({"fullnameOveride": "gw"}, "fullnameOveride"),
    ({"image": {"tags": "1.0"}}, "tags"),
    ({"checkIn": {"replica": 3}}, "replica"),
    ({"distributor": {"resources": {"limit": {"memory": "1Gi"}}}}, "limit"),
    ({"broker": {"secretName": "rabbit"}}, "secretName"),
    ({"tls": {"caSecrets": "ca"}}, "caSecrets"),
    ({"topology": {"clustername": "rabbit"}}, "clustername"),
    ({"metrics": {"serviceMonitor": {"enable": True}}}, "enable"),
    ({"networkPolicy": {"metricsFrom": [{"namespaceSelecter": {}}]}}, "namespaceSelecter"),
    ({"podDisruptionBudget": {"minAvailable": 1}}, "minAvailable"),
    ({"test": {"delay": 5}}, "delay"),
    ({"serviceAccount": {"annotation": {"a": "b"}}}, "annotation"),
    ({"podSecurityContext": {"runAsUsr": 1000}}, "runAsUsr"),
    ({"securityContext": {"readOnlyRootFileSystem": True}}, "readOnlyRootFileSystem"),
    ({"securityContext": {"capabilities": {"drops": ["ALL"]}}}, "drops"),
    ({"extraEnv": [{"name": "A", "valu": "b"}]}, "valu"),
    ({"tolerations": [{"key": "k", "effects": "NoSchedule"}]}, "effects"),
    ({"affinity": {"podAntiaffinity": {}}}, "podAntiaffinity"),
    ({"topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule",
                                     "labelSelecter": {}}]}, "labelSelecter"),
    ({"imagePullSecrets": [{"nam": "registry"}]}, "nam"),
])
def test_a_misspelt_key_is_an_error_naming_it(values, key):
    with helm.Chart.load(str(CHART)) as chart:
        with pytest.raises(helm.HelmValuesError, match=rf"additional properties '{key}' not allowed"):
            chart.validate_schema(values)
    with pytest.raises(helm.HelmValuesError, match=key):
        render(values)  # install and upgrade validate the same way


FREE = {"global",  # Helm's own, shared with subcharts
        # Kubernetes' nested affinity terms: passed through as they are, checked by the API server
        "affinity.nodeAffinity", "affinity.podAffinity", "affinity.podAntiAffinity",
        "envVar.valueFrom.fieldRef", "resources.claims"}


def object_schemas(node: dict, path: str = "") -> Iterator[Tuple[str, dict]]:
    """Every schema of an object a user writes into the values: properties, definitions and
    array items (not the generated if/then clauses, which only narrow)."""
    if node.get("type") == "object" or "properties" in node:
        yield path, node
    for name, sub in node.get("properties", {}).items():
        yield from object_schemas(sub, f"{path}.{name}".lstrip("."))
    for name, sub in node.get("definitions", {}).items():
        yield from object_schemas(sub, name)
    if isinstance(node.get("items"), dict):
        yield from object_schemas(node["items"], path)
    if isinstance(node.get("additionalProperties"), dict):
        yield from object_schemas(node["additionalProperties"], f"{path}.*")


def test_the_schema_is_closed_throughout():
    schema = json.loads((CHART / "values.schema.json").read_text())
    seen = 0
    for path, node in object_schemas(schema):
        seen += 1
        if path in FREE:
            continue
        assert "additionalProperties" in node, f"{path or '(root)'} takes any key"
        if "properties" in node:
            assert node["additionalProperties"] is False, path
    assert seen > 40


# -- names -------------------------------------------------------------------------------
def test_fullname_override_names_every_object():
    docs = valid(render({"fullnameOverride": "gw"}, name="anything"))
    for doc in docs:
        if doc["kind"] != "ServiceAccount":
            assert doc["metadata"]["name"].startswith("gw-") or doc["metadata"]["name"] == "gw", doc["metadata"]
    assert set(by_kind(docs, "Deployment")) == {"gw-check-in", "gw-distributor"}
    assert set(by_kind(docs, "ServiceAccount")) == {"gw"}
    assert {pod_spec(d)["serviceAccountName"] for d in pods(docs)} == {"gw"}


def test_name_override_changes_the_name_label_and_the_fullname():
    docs = valid(render({"nameOverride": "scheduler"}, name="orders"))
    assert set(by_kind(docs, "Deployment")) == {"orders-scheduler-check-in", "orders-scheduler-distributor"}
    for doc in docs:
        assert doc["metadata"]["labels"]["app.kubernetes.io/name"] == "scheduler"
    [policy] = by_kind(docs, "NetworkPolicy").values()
    for doc in pods(docs):  # the selectors still find the pods
        labels = pod_metadata(doc)["labels"]
        assert all(labels[k] == v for k, v in policy["spec"]["podSelector"]["matchLabels"].items())


# -- the broker's Secret ------------------------------------------------------------------
def broker_secrets(docs: List[dict]) -> set:
    """Every Secret the gateway's pods read the broker's URL and password from."""
    names = set()
    for doc in pods(docs):
        spec = pod_spec(doc)
        env = effective_env(spec["containers"][0], by_kind(docs, "ConfigMap"))
        url = env["DELAY_GATEWAY_URL"]
        assert isinstance(url, tuple)
        names.add(url[1])
        names |= {v["secret"]["secretName"] for v in spec["volumes"] if v["name"] == "broker"}
    return names


def test_an_existing_secret_is_used_by_every_pod():
    docs = valid(render({"broker": {"existingSecret": "rabbit-creds", "urlKey": "uri"}}))
    assert broker_secrets(docs) == {"rabbit-creds"}
    assert not by_kind(docs, "Secret")
    for doc in pods(docs):
        env = effective_env(pod_spec(doc)["containers"][0], by_kind(docs, "ConfigMap"))
        assert env["DELAY_GATEWAY_URL"] == ("secret", "rabbit-creds", "uri")


def test_an_inline_secret_for_a_trial():
    docs = valid(render({"broker": {"url": "amqp://guest@rabbitmq:5672/%2F", "password": "guest"}}, name="trial"))
    [secret] = by_kind(docs, "Secret").values()
    assert secret["metadata"]["name"] == "trial-delay-gateway-broker"
    assert secret["stringData"] == {"url": "amqp://guest@rabbitmq:5672/%2F", "password": "guest"}
    assert broker_secrets(docs) == {"trial-delay-gateway-broker"}
    assert "trial only" in notes({"broker": {"url": "amqp://rabbitmq/", "password": "p"}})
    assert "trial only" not in notes({})


@pytest.mark.parametrize("broker,why", [
    ({"url": "amqp://rabbitmq/"}, "password"),  # an inline URL needs its password
    ({"existingSecret": ""}, "existingSecret"),  # neither a Secret nor a URL
])
def test_the_broker_must_be_named_one_way_or_the_other(broker, why):
    with pytest.raises(helm.HelmValuesError, match=why):
        render({"broker": broker})


# -- what every pod gets -----------------------------------------------------------------
def test_extra_env_reaches_every_gateway_container():
    extra = [{"name": "TZ", "value": "UTC"},
             {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]
    docs = valid(render({"extraEnv": extra}))
    assert len(pods(docs)) == 4
    for doc in pods(docs):
        env = pod_spec(doc)["containers"][0]["env"]
        assert env[-2:] == extra
        assert {e["name"] for e in env} >= {"DELAY_GATEWAY_URL", "DELAY_GATEWAY_PASSWORD_FILE"}


def test_pod_labels_and_annotations_on_every_pod_and_the_charts_labels_win():
    docs = valid(render({"podLabels": {"team": "payments", "app.kubernetes.io/name": "mine"},
                         "podAnnotations": {"sidecar.istio.io/inject": "false"}}))
    for doc in pods(docs):
        meta = pod_metadata(doc)
        assert meta["labels"]["team"] == "payments"
        assert meta["labels"]["app.kubernetes.io/name"] == "delay-gateway"
        assert meta["annotations"]["sidecar.istio.io/inject"] == "false"
    for d in by_kind(docs, "Deployment").values():
        assert "checksum/settings" in pod_metadata(d)["annotations"]  # still rolls on a settings change
        assert "team" not in d["spec"]["selector"]["matchLabels"]  # selectors are immutable: never user labels
    [test] = by_kind(docs, "Pod").values()
    assert test["metadata"]["annotations"]["helm.sh/hook"] == "test"


def test_topology_spread_constraints_select_the_roles_own_pods():
    zone = {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway"}
    mine = {"maxSkew": 2, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "DoNotSchedule",
            "labelSelector": {"matchLabels": {"app.kubernetes.io/instance": "delay-gateway"}}}
    docs = valid(render({"topologySpreadConstraints": [zone, mine]}))
    for name, d in by_kind(docs, "Deployment").items():
        got = pod_spec(d)["topologySpreadConstraints"]
        assert got[0] == {**zone, "labelSelector": {"matchLabels": d["spec"]["selector"]["matchLabels"]}}
        assert got[0]["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == name.rpartition("y-")[2]
        assert got[1] == mine
    for doc in pods(docs):
        if doc["kind"] != "Deployment":
            assert "topologySpreadConstraints" not in pod_spec(doc)
    assert all("topologySpreadConstraints" not in pod_spec(d) for d in pods(render({})))


def test_priority_class_on_every_pod():
    docs = valid(render({"priorityClassName": "messaging-critical"}))
    assert {pod_spec(d)["priorityClassName"] for d in pods(docs)} == {"messaging-critical"}
    assert all("priorityClassName" not in pod_spec(d) for d in pods(render({})))


def test_service_account_annotations_create_and_name():
    annotations = {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/gw"}
    docs = valid(render({"serviceAccount": {"annotations": annotations}}))
    [account] = by_kind(docs, "ServiceAccount").values()
    assert account["metadata"]["annotations"] == annotations
    docs = valid(render({"serviceAccount": {"create": False, "name": "shared"}}))
    assert not by_kind(docs, "ServiceAccount")
    assert {pod_spec(d)["serviceAccountName"] for d in pods(docs)} == {"shared"}
    docs = render({"serviceAccount": {"create": False}})
    assert {pod_spec(d)["serviceAccountName"] for d in pods(docs)} == {"default"}


def test_security_contexts_can_be_overridden_for_platforms_that_assign_uids():
    """OpenShift's restricted SCC assigns the UID and fsGroup: the fixed IDs are removed
    (null drops a default in Helm) and the rest of the lockdown stays."""
    docs = valid(render({"podSecurityContext": {"runAsUser": None, "runAsGroup": None, "fsGroup": None},
                         "securityContext": {"runAsUser": 1000680000}}))
    for doc in pods(docs):
        spec = pod_spec(doc)
        assert spec["securityContext"] == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
        [container] = spec["containers"]
        assert container["securityContext"]["runAsUser"] == 1000680000
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    defaults = pods(render({}))
    assert {pod_spec(d)["securityContext"]["runAsUser"] for d in defaults} == {10001}
