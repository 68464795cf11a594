"""deploy/prometheus/rabbitmq-rules.yaml: the alert on RabbitMQ's own metrics that warns
before a 3.x node's file-handle reservations fill its open-files limit. promtool checks it and
runs it over series that make it fire and stay quiet (one node, a cluster of three, 4.x);
then over what a real node's rabbitmq_prometheus plugin shows, on each suite broker: quiet
with one prefix of the default chain, firing with two, while the node (3.x) has reserved
less than its limit, so the alert comes before the wedge. About 30 s."""

import functools
import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import helm_python as helm
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from topology import ChainSettings

from .conftest import broker_label, checked_runtime
from .faults.nodes import Cluster, unique_names
from .k8s.manifests import CHART, by_kind, render
from .k8s.test_alerts import promtool
from .launcher import chain_args
from .support import ROOT, wait_until

RULES = Path(ROOT) / "deploy" / "prometheus" / "rabbitmq-rules.yaml"
ALERT = "RabbitMQFileHandlesNearlyReserved"
FAMILIES = ("rabbitmq_queues", "rabbitmq_process_max_fds", "rabbitmq_identity_info", "rabbitmq_build_info")


def node_series(instance: str, cluster: str, version: str, queues: str, max_fds: int) -> List[dict]:
    """The four series the rule reads, of one node, as Prometheus scrapes them (job rabbitmq)."""
    at = f'instance="{instance}",job="rabbitmq"'
    return [
        {"series": f"rabbitmq_queues{{{at}}}", "values": queues},
        {"series": f"rabbitmq_process_max_fds{{{at}}}", "values": f"{max_fds}x30"},
        {"series": f'rabbitmq_identity_info{{{at},rabbitmq_node="rabbit@{instance}",rabbitmq_cluster="{cluster}"}}',
         "values": "1x30"},
        {"series": f'rabbitmq_build_info{{{at},rabbitmq_version="{version}"}}', "values": "1x30"},
    ]


def fired(instance: str, cluster: str, value: int) -> dict:
    return {"exp_labels": {"instance": instance, "job": "rabbitmq", "rabbitmq_cluster": cluster,
                           "severity": "critical"},
            "exp_annotations": {**annotations(), "description": description(instance, cluster, value)}}


def annotations() -> Dict[str, str]:
    [rule] = yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
    return {k: v for k, v in rule["annotations"].items() if k != "description"}


def description(instance: str, cluster: str, value: int) -> str:
    return (f"{instance} ({cluster}) may have reserved up to {value} file handles, more than 80 % of its open-files "
            "limit less 97: when its reservations fill it, the node stops answering everyone. Raise its open-files "
            "limit and restart it, or delete queues or prefixes you do not use; `rabbitmqctl status`, File "
            "Descriptors, shows what it has reserved.")


def run(tmp_path: Path, tests: List[dict]) -> subprocess.CompletedProcess:
    path = tmp_path / "tests.yaml"
    path.write_text(yaml.safe_dump({"rule_files": [str(RULES)], "evaluation_interval": "1m", "tests": tests},
                                   sort_keys=False))
    return promtool("test", "rules", str(path))


def test_promtool_checks_the_rule():
    out = promtool("check", "rules", str(RULES))
    assert out.returncode == 0 and "SUCCESS: 1 rules found" in out.stdout, out.stdout + out.stderr


# One node leads every queue: 3 x its queues (it is its own cluster); budget 0.8 x (1024 - 97).
SCENARIOS = [
    {"name": "one 3.x node: 200 queues are 600 handles, quiet; 260 are 780 of 741.6, for 5m",
     "interval": "1m", "input_series": node_series("a:15692", "c1", "3.10.8", "200x10 260x20", 1024),
     "alert_rule_test": [{"eval_time": "9m", "alertname": ALERT, "exp_alerts": []},
                         {"eval_time": "14m", "alertname": ALERT, "exp_alerts": []},
                         {"eval_time": "16m", "alertname": ALERT, "exp_alerts": [fired("a:15692", "c1", 780)]}]},
    {"name": "three 3.x nodes: each queue 2 handles on every node, and the cluster size more on its leader",
     "interval": "1m", "input_series": [
         *node_series("a:15692", "c3", "3.12.1", "500x10 700x20", 4096),  # 3 x 500 + 2 x 600; 3 x 700 + 2 x 800
         *node_series("b:15692", "c3", "3.12.1", "100x30", 4096),  # 3 x 100 + 2 x 800 = 1900
         *node_series("c:15692", "c3", "3.12.1", "0x30", 4096),
         *node_series("solo:15692", "c1", "3.12.1", "100x30", 4096)],  # another cluster's node
     "alert_rule_test": [{"eval_time": "9m", "alertname": ALERT, "exp_alerts": []},
                         {"eval_time": "20m", "alertname": ALERT, "exp_alerts": [fired("a:15692", "c3", 3700)]}]},
    {"name": "a 4.x node keeps no such account: quiet whatever its queues",
     "interval": "1m", "input_series": node_series("d:15692", "c4", "4.3.6", "5000x30", 1024),
     "alert_rule_test": [{"eval_time": "20m", "alertname": ALERT, "exp_alerts": []}]},
]


def test_the_rule_fires_where_reservations_near_the_limit_and_stays_quiet_elsewhere(tmp_path):
    out = run(tmp_path, SCENARIOS)
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_scenario_that_expects_the_wrong_thing_fails(tmp_path):
    wrong = {**SCENARIOS[0], "alert_rule_test": [{"eval_time": "9m", "alertname": ALERT,
                                                  "exp_alerts": [fired("a:15692", "c1", 600)]}]}
    out = run(tmp_path, [wrong])
    assert out.returncode != 0 and "FAILED" in out.stdout + out.stderr, out.stdout


def test_the_chart_takes_the_rule_as_additional_rules():
    """docs/kubernetes.md: the file's rules go in metrics.prometheusRule.additionalRules."""
    rules = yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
    values = {"metrics": {"prometheusRule": {"enabled": True, "additionalRules": rules}}}
    with helm.Chart.load(str(CHART)) as chart:
        chart.validate_schema(values)
    [rendered] = by_kind(render(values), "PrometheusRule").values()
    assert rendered["spec"]["groups"][0]["rules"][-1] == rules[0]


def test_the_guides_lines_give_the_chart_the_rule(tmp_path):
    """The two lines of docs/kubernetes.md (its python3 line run here, helm's -f file rendered)."""
    guide = (Path(ROOT) / "docs" / "kubernetes.md").read_text()
    block = guide.split("python3 -c '", 1)[1].split("' > broker-rules.json", 1)[0]
    out = subprocess.run([sys.executable, "-c", block], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    values = json.loads(out.stdout)
    values["metrics"]["prometheusRule"]["enabled"] = True  # --reuse-values: enabled as the guide did above
    [rendered] = by_kind(render(values), "PrometheusRule").values()
    assert ALERT in [r.get("alert") for r in rendered["spec"]["groups"][0]["rules"]]


# -- over what a real node shows -----------------------------------------------------------
OPEN_FILES = 500  # 3.x: a budget of 403; one default prefix reserves 144, two 288


def scraped(port: int, instance: str) -> Dict[str, List[Tuple[Dict[str, str], float]]]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    return {f.name: [(dict(s.labels, instance=instance, job="rabbitmq"), s.value) for s in f.samples
                     if s.name == f.name or s.name == f.name + "_total"]
            for f in text_string_to_metric_families(text) if f.name in FAMILIES}


def showing(port: int, instance: str, queues: int) -> Optional[Dict[str, List[Tuple[Dict[str, str], float]]]]:
    """What the node shows, once it shows `queues` queues."""
    families = scraped(port, instance)
    return families if families["rabbitmq_queues"][0][1] == queues else None


def as_series(families: Dict[str, List[Tuple[Dict[str, str], float]]]) -> List[dict]:
    out = []
    for name, samples in families.items():
        for labels, value in samples:
            inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
            out.append({"series": f"{name}{{{inner}}}", "values": f"{value:g}x10"})
    return out


@pytest.fixture
def scraped_node(broker, request):
    label = broker_label(request.node)
    cluster = Cluster(unique_names(1, "prom"), ports=["prometheus.tcp.port"], runtime=checked_runtime(label),
                      plugins=["rabbitmq_prometheus"], open_files=OPEN_FILES)
    cluster.start_or_fail(f"a RabbitMQ node with the Prometheus plugin ({label})")
    try:
        yield label, cluster.nodes[0], cluster.nodes[0].ports["prometheus.tcp.port"]
    finally:
        cluster.close()


def test_the_rule_warns_before_a_real_node_wedges(scraped_node, tmp_path):
    label, node, port = scraped_node
    instance = f"127.0.0.1:{port}"
    for count, prefix in enumerate(("first", "second"), start=1):
        r = subprocess.run([sys.executable, "-m", "gateway", "declare", *chain_args(ChainSettings(prefix=prefix)),
                            "--url", node.url], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        # the plugin counts the queues the node leads: all 62 of each prefix (48 quorum, 14 streams)
        families = wait_until(functools.partial(showing, port, instance, 62 * count), 60, 1.0,
                              what=f"the plugin showing {62 * count} queues")
        [(identity, _)] = families["rabbitmq_identity_info"]
        # quiet with one prefix; with two it fires on 3.x: 3 x 124 = 372 > 0.8 x 403, early, as 288 are reserved
        fires = label == "rmq3.10" and count == 2
        test = {"name": f"{count} prefixes", "interval": "1m", "input_series": as_series(families),
                "alert_rule_test": [{"eval_time": "6m", "alertname": ALERT, "exp_alerts": [
                    fired(instance, identity["rabbitmq_cluster"], 3 * 62 * count)] if fires else []}]}
        out = run(tmp_path, [test])
        assert out.returncode == 0, (count, out.stdout + out.stderr)
        if fires:
            total, limit = map(int, re.search(r"Total: (\d+), limit: (\d+)", node.ctl("status").stdout).groups())
            assert limit == OPEN_FILES - 97 and 0.7 * limit < total < limit, (total, limit)  # near, not wedged
