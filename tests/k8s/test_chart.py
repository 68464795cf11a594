"""The Helm chart, rendered offline by the real Helm engine (helm-python-sdk: Helm's Go
library, no helm binary): lint, values schema, every built-in object against the
Kubernetes schemas (kubernetes-validate), the operator mode against the gateway's renderer,
and the settings against the gateway's own parser. About 10 s in all."""

import json
import re

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from gateway.cli import COMMANDS, parser
from gateway.metrics import Metrics
from gateway.settings import OPTIONS, settings_from
from topology import ChainSettings, build
from topology.chart import data_text, schema
from topology.operator import ClusterReference, resources
from topology.settings import MAX_LEVELS, max_level_for

from ..test_cli import cli
from .manifests import (CHART, by_kind, check_operator_resource, effective_env, is_built_in, kustomize, notes,
                        pod_spec, render)

KUBERNETES = ("1.25", kubernetes_validate.latest_version())  # the chart's kubeVersion floor, and the newest
OPERATOR = {"mode": "operator", "clusterName": "rabbitmq", "clusterNamespace": "messaging", "vhost": "/"}
CASES = [{}] + [{"maxLevel": level, "zeroBits": zero_bits, "topology": topology}
                for level in (1, 16, 28) for zero_bits in ("queue", "exchange")
                for topology in ({"mode": "job"}, OPERATOR)] + [
    {"tls": {"caSecret": "rabbit-ca", "clientSecret": "gateway-cert"}, "networkPolicy": {
        "metricsFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]},
     "metrics": {"serviceMonitor": {"enabled": True}, "dashboard": {"enabled": True}},
     "nodeSelector": {"kubernetes.io/os": "linux"}, "imagePullSecrets": [{"name": "registry"}]}]
# Settings whose chart default differs from the gateway's, and why
CHART_DEFAULTS = {"metricsPort": 9090,  # the probes need the health endpoints
                  "retryPolicies": [],  # a list in the chart, its JSON for the gateway
                  "vhosts": [],  # a list in the chart, comma-separated for the gateway
                  "gatewayUser": "",  # empty: the URL's user (None for the gateway)
                  "managementUrl": "",  # empty: not checked (None for the gateway)
                  "logFormat": "json"}  # explicit: no terminal in a pod


def case_id(values: dict) -> str:
    if "tls" in values:
        return "tls,metricsFrom,serviceMonitor,dashboard,nodeSelector,imagePullSecrets"
    return ",".join(f"{k}={v.get('mode') if isinstance(v, dict) else v}" for k, v in values.items()) or "defaults"


def test_lint_finds_nothing_to_fix():
    report = helm.lint(str(CHART), strict=True)
    assert report["errors"] == [], report
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report


@pytest.mark.parametrize("values", CASES, ids=case_id)
def test_every_rendered_object_is_valid(values):
    docs = render(values)
    built_in = [d for d in docs if is_built_in(d)]
    assert len(built_in) >= 9
    for doc in built_in:
        for version in KUBERNETES:
            kubernetes_validate.validate(doc, version, strict=True)
    operator = values.get("topology", {}).get("mode") == "operator"
    crs = [d for d in docs if d["apiVersion"] == "rabbitmq.com/v1beta1"]
    assert bool(crs) == operator
    assert bool(by_kind(docs, "Job")) == (not operator)
    for doc in crs:
        check_operator_resource(doc)
    if operator:
        chain = ChainSettings(**{k: v for k, v in (("max_level", values.get("maxLevel")),
                                                   ("zero_bits", values.get("zeroBits"))) if v})
        assert_same_as_the_renderer(crs, chain, ClusterReference("rabbitmq", "messaging"), "/")
    for _name, deployment in by_kind(docs, "Deployment").items():
        env = effective_env(pod_spec(deployment)["containers"][0], by_kind(docs, "ConfigMap"))
        assert env["DELAY_GATEWAY_MAX_LEVEL"] == str(values.get("maxLevel", 20))


def assert_same_as_the_renderer(crs, chain: ChainSettings, cluster: ClusterReference, vhost: str) -> None:
    """The chart's operator resources are the renderer's, plus the chart's labels, the
    namespace, and keep (neither an upgrade nor an uninstall deletes waiting messages, or
    the exchanges an old chain dead-letters into)."""
    want = {(d["kind"], d["metadata"]["name"]): d for d in resources(build(chain), cluster, vhost)}
    got = {}
    for d in crs:
        meta = d["metadata"]
        assert meta["annotations"] == {"helm.sh/resource-policy": "keep"}
        assert meta["labels"]["app.kubernetes.io/instance"] == "delay-gateway"
        labels = {k: v for k, v in meta["labels"].items() if k in want.get((d["kind"], meta["name"]), d)
                  ["metadata"]["labels"]}
        got[(d["kind"], meta["name"])] = {**d, "metadata": {"name": meta["name"], "labels": labels}}
    assert got == want


@pytest.mark.parametrize("level,resolution,queue_type,zero_bits", [
    (38, 1, "classic", "queue"), (37, 2, "quorum", "exchange"), (29, 500, "classic", "exchange"),
    (3, 250, "quorum", "queue"), (1, 315_360_000_000, "quorum", "queue")])
def test_operator_mode_instantiates_the_renderers_objects(level, resolution, queue_type, zero_bits):
    """At the edges of the data: the top level, which fits at 1 ms only; resolutions other
    than those the data was generated at; a one-level chain at the largest resolution."""
    values = {"maxLevel": level, "resolutionMs": resolution, "queueType": queue_type, "zeroBits": zero_bits,
              "prefix": "orders.delay", "topology": {"mode": "operator", "connectionSecret": "rabbit-api",
                                                      "vhost": "prod"}}
    crs = [d for d in render(values) if d["apiVersion"] == "rabbitmq.com/v1beta1"]
    chain = ChainSettings("orders.delay", level, resolution, queue_type, zero_bits)
    assert_same_as_the_renderer(crs, chain, ClusterReference(connection_secret="rabbit-api"), "prod")


def test_generated_files_are_up_to_date():
    """files/topology.json and the schema's generated clauses: `python -m topology.chart
    deploy/k8s/helm/delay-gateway` rewrites them."""
    assert (CHART / "files" / "topology.json").read_text() == data_text()
    current = json.loads((CHART / "values.schema.json").read_text())
    assert schema(current) == current


def chart_defaults() -> dict:
    with helm.Chart.load(str(CHART)) as chart:
        return chart.values


def load_schema() -> dict:
    return json.loads((CHART / "values.schema.json").read_text())


def test_the_schema_allows_exactly_the_chains_rabbitmq_can_hold():
    """Every max level at the resolutions around each boundary of the 10-year TTL cap: the
    schema and ChainSettings agree."""
    validator = jsonschema.Draft7Validator(load_schema())
    defaults = chart_defaults()
    resolutions = {1, 2, 3, 999, 1000, 1001, 60_000, 315_360_000_000, 315_360_000_001}
    for level in range(1, MAX_LEVELS + 1):
        boundary = 315_360_000_000 // ((1 << level) - 1)
        resolutions |= {max(1, boundary - 1), max(1, boundary), boundary + 1}
    checked = 0
    for resolution in sorted(resolutions):
        top = max_level_for(resolution)
        for level in {0, 1, MAX_LEVELS, MAX_LEVELS + 1} | set(range(max(0, top - 2), top + 3)):
            try:
                ChainSettings(max_level=level, resolution_ms=resolution)
                fits = True
            except ValueError:
                fits = False
            valid = validator.is_valid({**defaults, "maxLevel": level, "resolutionMs": resolution})
            assert valid == fits, (level, resolution)
            checked += 1
    assert checked > 500
    assert max_level_for(1000) == 28


@pytest.mark.parametrize("values,why", [
    ({"maxLevel": 29}, "maxLevel"),  # 2^29 - 1 s is more than RabbitMQ's 10-year TTL cap
    ({"maxLevel": 37, "resolutionMs": 3}, "maxLevel"),
    ({"maxLevel": 0}, "maxLevel"),
    ({"maxLevel": 41}, "maxLevel"),
    ({"maxLevel": "20"}, "maxLevel"),
    ({"resolutionMs": 0}, "resolutionMs"),
    ({"queueType": "stream"}, "queueType"),
    ({"zeroBits": "bits"}, "zeroBits"),
    ({"checkIn": {"replicas": -1}}, "replicas"),
    ({"distributor": {"replicas": -2}}, "replicas"),
    ({"topology": {"mode": "crd"}}, "mode"),
    ({"topology": {"mode": "operator"}}, "topology"),  # no RabbitmqCluster named
    ({"topology": {"mode": "operator", "clusterName": "r"}, "prefix": "Orders_Delay"}, "prefix"),
    ({"prefix": ""}, "prefix"),
    ({"leadMs": -1}, "leadMs"),
    ({"prefetch": 70000}, "prefetch"),
    ({"holdWithinMs": 60001}, "holdWithinMs"),
    ({"logLevel": "verbose"}, "logLevel"),
])
def test_the_schema_rejects_bad_values(values, why):
    with helm.Chart.load(str(CHART)) as chart:
        with pytest.raises(helm.HelmValuesError, match=why):
            chart.validate_schema(values)
    with pytest.raises(helm.HelmValuesError):
        render(values)  # install and upgrade validate the same way


def test_settings_are_the_gateways_options_and_its_parser_reads_them(tmp_path):
    """The ConfigMap holds DELAY_GATEWAY_* for each option that has a Helm value name, from
    the value of that name; each container's environment and arguments, given to the
    gateway's own parser, give back the values."""
    values = {"prefix": "px", "maxLevel": 7, "resolutionMs": 250, "queueType": "classic", "zeroBits": "exchange",
              "leadMs": 120, "prefetch": 5, "distributorPrefetch": 600, "holdWithinMs": 3000, "holdMessages": 30,
              "catchUpRate": 250.5, "dueGaugesEvery": 30.5,
              "stampDueAt": True,
              "metricsPort": 9100, "logLevel": "debug", "logFormat": "console", "retire": False,
              "retireAfterSeconds": 30, "pendingIndex": False,
              "carrierMessages": 50, "carrierWaitMs": 7, "carrierBytes": 65536, "confirmTimeoutSeconds": 9,
              "retryBaseMs": 250, "retryFactor": 2.5, "retryCapMs": 60000, "retryAttempts": 4, "retryJitter": 0.5,
              "retryPolicies": [{"queue": "q.*", "attempts": 1}], "retryQueues": "q.*,jobs",
              "vhosts": ["orders", "billing/eu"], "gatewayUser": "delay-gw",
              "managementUrl": "http://rabbitmq:15672",
              "tls": {"caSecret": "rabbit-ca", "clientSecret": "gateway-cert"}}
    docs = render(values)
    [config_map] = by_kind(docs, "ConfigMap").values()
    helm_options = [o for o in OPTIONS if o.helm]
    assert set(config_map["data"]) == {o.env for o in helm_options}
    defaults = chart_defaults()
    for o in helm_options:
        assert defaults[o.helm] == CHART_DEFAULTS.get(o.helm, o.default), o.helm
        value = values[o.helm]
        assert config_map["data"][o.env] == (str(value).lower() if isinstance(value, bool) else ",".join(value)
                                             if o.helm == "vhosts" else json.dumps(
            value, separators=(",", ":"), sort_keys=True) if isinstance(value, list) else str(value))
    password = tmp_path / "password"
    password.write_text("s3cret\n")
    pods = [d for d in docs if d["kind"] in ("Deployment", "Job", "Pod")]
    assert len(pods) == 4
    for doc in pods:
        container = pod_spec(doc)["containers"][0]
        env = effective_env(container, by_kind(docs, "ConfigMap"))
        assert env["DELAY_GATEWAY_URL"] == ("secret", "delay-gateway-broker", "url")
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        for name in ("DELAY_GATEWAY_PASSWORD_FILE", "DELAY_GATEWAY_TLS_CA_FILE", "DELAY_GATEWAY_TLS_CERT_FILE",
                     "DELAY_GATEWAY_TLS_KEY_FILE"):
            assert env[name].rpartition("/")[0] in mounts, name
        environ = {**{k: v for k, v in env.items() if isinstance(v, str)}, "DELAY_GATEWAY_URL": "amqps://gw@rabbit/",
                   "DELAY_GATEWAY_PASSWORD_FILE": str(password)}
        args = container["args"]
        assert args[0] in COMMANDS
        parsed = parser(environ).parse_args(args)
        chain = ChainSettings("px", 7, 250, "classic", "exchange")
        if args[0] == "run":
            s = settings_from(parsed)
            assert s.chain == chain and s.role == doc["metadata"]["name"].replace("delay-gateway-", "")
            assert (s.lead_ms, s.prefetch, s.distributor_prefetch, s.stamp_due_at, s.metrics_port) == \
                (120, 5, 600, True, 9100)
            assert s.urls == ("amqps://gw:s3cret@rabbit/",) and s.vhosts == ("orders", "billing/eu")
            assert s.gateway_user == s.trusted_user == "delay-gw"
            assert s.tls.ca_file.endswith("ca.crt") and s.tls.key_file.endswith("tls.key")
            assert container["ports"] == [{"name": "metrics", "containerPort": 9100, "protocol": "TCP"}]


def test_pods_are_locked_down_and_probed():
    docs = render({})
    for doc in docs:
        if doc["kind"] not in ("Deployment", "Job", "Pod"):
            continue
        spec = pod_spec(doc)
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] > 0
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert spec["automountServiceAccountToken"] is False
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"] == {"drop": ["ALL"]}
            assert c["resources"]["requests"] and c["resources"]["limits"]
    deployments = by_kind(docs, "Deployment")
    assert set(deployments) == {"delay-gateway-check-in", "delay-gateway-distributor"}
    pdbs = by_kind(docs, "PodDisruptionBudget")
    for name, d in deployments.items():
        c = pod_spec(d)["containers"][0]
        assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
        assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
        assert d["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
        pod_labels = d["spec"]["template"]["metadata"]["labels"]
        assert selects(pdbs[name]["spec"]["selector"]["matchLabels"], pod_labels)
        assert not selects(pdbs[name]["spec"]["selector"]["matchLabels"],
                           next(o for n, o in deployments.items()
                                if n != name)["spec"]["template"]["metadata"]["labels"])
        [service] = by_kind(docs, "Service").values()
        assert selects(service["spec"]["selector"], pod_labels)
        [policy] = by_kind(docs, "NetworkPolicy").values()
        assert selects(policy["spec"]["podSelector"]["matchLabels"], pod_labels)
    # the Job and the test pod are under the NetworkPolicy too
    for doc in list(by_kind(docs, "Job").values()) + list(by_kind(docs, "Pod").values()):
        labels = doc["metadata"]["labels"] if doc["kind"] == "Pod" else doc["spec"]["template"]["metadata"]["labels"]
        assert selects(policy["spec"]["podSelector"]["matchLabels"], labels)


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_scaled_separately_and_zero_is_allowed():
    deployments = by_kind(render({"checkIn": {"replicas": 5}, "distributor": {"replicas": 0}}), "Deployment")
    assert deployments["delay-gateway-check-in"]["spec"]["replicas"] == 5
    assert deployments["delay-gateway-distributor"]["spec"]["replicas"] == 0


def test_upgrades_declare_first_and_helm_test_waits_for_a_delivery():
    docs = render({"test": {"delayMs": 1500, "timeoutSeconds": 30}})
    [job] = by_kind(docs, "Job").values()
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "post-install,pre-upgrade"
    assert pod_spec(job)["containers"][0]["args"] == ["declare"]
    [test] = by_kind(docs, "Pod").values()
    assert test["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert pod_spec(test)["containers"][0]["args"] == ["selftest", "--delay-ms", "1500", "--timeout", "30"]


def test_optional_service_monitor_and_dashboard():
    assert not by_kind(render({}), "ServiceMonitor")
    docs = render({"metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
                               "dashboard": {"enabled": True}}})
    [monitor] = by_kind(docs, "ServiceMonitor").values()
    [service] = by_kind(docs, "Service").values()
    assert selects(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    assert monitor["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"]
    dashboard = by_kind(docs, "ConfigMap")["delay-gateway-dashboard"]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    board = json.loads(dashboard["data"]["delay-gateway.json"])
    assert board == json.loads((CHART / "files" / "dashboard.json").read_text())


def test_the_dashboard_shows_only_metrics_the_gateway_has():
    board = json.loads((CHART / "files" / "dashboard.json").read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\b(delay_gateway_\w+)", e)}
    registry = Metrics().registry
    exposed = set()
    for family in registry.collect():
        exposed |= {s.name for s in family.samples} | {family.name}
    # counters are exposed as _total, histograms as _bucket/_sum/_count
    assert used <= exposed | {n + "_total" for n in exposed}, used - exposed
    assert {"delay_gateway_messages_total", "delay_gateway_lateness_seconds_bucket",
            "delay_gateway_held_messages", "delay_gateway_parked_total", "delay_gateway_ready"} <= used
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])


def test_notes_say_how_to_check_it():
    text = notes({})
    assert "helm test delay-gateway -n messaging" in text and "delay.check-in" in text
    assert "declared by the gateway itself" in notes({"topology": OPERATOR})


def test_kubernetes_tooling_reads_every_rendered_document(tmp_path):
    """kustomize (kyaml) parses strictly, as kubectl does: a duplicate key, which PyYAML
    would let pass, is an error there. Every template's output, in both topology modes, and
    the CLI's operator rendering."""
    texts = []
    for values, namespace in (({"metrics": {"prometheusRule": {"enabled": True}}}, "job"),
                              ({"topology": OPERATOR, "maxLevel": 5}, "operator")):
        with helm.Chart.load(str(CHART)) as chart:  # two namespaces: no object appears twice
            texts += [t for p, t in chart.render(values, name="delay-gateway", namespace=namespace).items()
                      if not p.endswith("NOTES.txt") and t.strip()]
    r = cli("render", "--format", "operator", "--cluster-name", "rabbitmq", "--max-level", "5", "--prefix", "cli")
    assert r.returncode == 0, r.stderr
    texts.append(r.stdout)
    names = []
    for i, text in enumerate(texts):
        (tmp_path / f"{i}.yaml").write_text(text)
        names.append(f"{i}.yaml")
    (tmp_path / "kustomization.yaml").write_text(json.dumps({"resources": names}))
    expected = sum(1 for t in texts for d in yaml.safe_load_all(t) if d)
    assert len(kustomize(tmp_path)) == expected
