"""The alerts (the chart's files/prometheus-rules.yaml): the chart renders them as a
PrometheusRule only when metrics.prometheusRule.enabled, with thresholds from its values;
deploy/prometheus/delay-gateway-rules.yaml is exactly what it renders with its defaults;
Prometheus's own promtool (scripts/ensure-promtool) checks them, and runs each alert
against series that make it fire, stay quiet, and resolve; each alert's runbook_url is a
section of docs/operating.md. About 10 s."""

import re
import shutil
import subprocess
from pathlib import Path
from typing import Dict, List, Optional

import helm_python as helm
import jsonschema
import pytest
import yaml

from gateway.metrics import Metrics

from ..support import ROOT
from ..test_docs import anchors
from .manifests import CHART, by_kind, notes, render
from .rules import PLAIN, plain_text, rule_groups

ENABLED = {"metrics": {"prometheusRule": {"enabled": True}}}
NS, JOB = "messaging", "delay-gateway-metrics"
ALERTS = ["DelayGatewayCheckInNotReady", "DelayGatewayDistributorNotReady", "DelayGatewayCheckInBacklog",
          "DelayGatewayCatchUpBehind", "DelayGatewayOverdueWaiting", "DelayGatewayLateDeliveries",
          "DelayGatewayMessagesParked", "DelayGatewayRetriesGaveUp", "DelayGatewayCancellationsNotFollowed",
          "DelayGatewayConnectionsFlapping"]


def promtool(*args: str) -> subprocess.CompletedProcess:
    path = shutil.which("promtool")
    assert path, "promtool is missing: scripts/ensure-promtool installs Debian's prometheus package, which has it"
    return subprocess.run([path, *args], capture_output=True, text=True, timeout=60)


def write_rules(tmp_path: Path, spec: dict) -> Path:
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": spec["groups"]}, sort_keys=False))
    return path


def rules_of(spec: dict) -> Dict[str, dict]:
    return {r.get("alert") or r["record"]: r for g in spec["groups"] for r in g["rules"]}


# -- the chart renders them, when asked ------------------------------------------------------
def test_the_rule_is_rendered_only_when_enabled():
    assert not by_kind(render({}), "PrometheusRule")
    assert not by_kind(render({"metrics": {"prometheusRule": {"enabled": False}}}), "PrometheusRule")
    assert set(by_kind(render(ENABLED), "PrometheusRule")) == {"delay-gateway"}


# The fields of the Prometheus Operator's monitoring.coreos.com/v1 PrometheusRule (its
# pkg/apis/monitoring/v1/prometheusrule_types.go: written out, not copied); kubernetes-validate
# knows no custom resources, and the API server would drop a misspelt field without a word.
DURATION = {"type": "string", "pattern": "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?"
                                         "(([0-9]+)s)?(([0-9]+)ms)?)$"}
STRINGS = {"type": "object", "additionalProperties": {"type": "string"}}
PROMETHEUS_RULE_SPEC = {
    "type": "object", "additionalProperties": False, "required": ["groups"],
    "properties": {"groups": {"type": "array", "items": {
        "type": "object", "additionalProperties": False, "required": ["name"],
        "properties": {
            "name": {"type": "string", "minLength": 1}, "interval": DURATION, "query_offset": DURATION,
            "limit": {"type": "integer"}, "partial_response_strategy": {"type": "string"}, "labels": STRINGS,
            "rules": {"type": "array", "items": {
                "type": "object", "additionalProperties": False, "required": ["expr"],
                "properties": {"record": {"type": "string"}, "alert": {"type": "string"},
                               "expr": {"type": ["string", "integer"]}, "for": DURATION,
                               "keep_firing_for": DURATION, "labels": STRINGS, "annotations": STRINGS}}}}}}}}
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def test_the_notes_name_the_rule_when_enabled():
    assert "PrometheusRule delay-gateway in namespace messaging" in notes(ENABLED)
    assert "PrometheusRule" not in notes({})


def test_the_prometheus_rule_is_a_valid_object_with_the_values_labels_and_namespace():
    values = {"metrics": {"prometheusRule": {"enabled": True, "namespace": "monitoring",
                                             "labels": {"release": "kube-prometheus-stack"}}}}
    [rule] = by_kind(render(values, name="orders"), "PrometheusRule").values()
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(rule) == {"apiVersion", "kind", "metadata", "spec"}
    jsonschema.validate(rule["spec"], PROMETHEUS_RULE_SPEC)
    meta = rule["metadata"]
    assert DNS_SUBDOMAIN.match(meta["name"]) and meta["name"] == "orders-delay-gateway"
    assert meta["namespace"] == "monitoring"
    assert meta["labels"]["release"] == "kube-prometheus-stack"
    assert meta["labels"]["app.kubernetes.io/instance"] == "orders"
    [default] = by_kind(render(ENABLED, name="orders"), "PrometheusRule").values()
    assert default["metadata"]["namespace"] == NS


def test_every_alert_has_a_severity_a_summary_a_description_and_its_runbook():
    """Each runbook_url is the alert's own section of docs/operating.md, under "Alerts"."""
    rules = rules_of(rule_groups())
    assert list(rules) == ALERTS
    text = (Path(ROOT) / "docs" / "operating.md").read_text()
    alerts_section = text.split("\n## Alerts\n", 1)[1].split("\n## ", 1)[0]
    sections = re.findall(r"^### (\S+)$", alerts_section, re.MULTILINE)
    assert sections == ALERTS
    for name, rule in rules.items():
        assert rule["labels"]["severity"] in ("critical", "warning")
        assert set(rule["annotations"]) == {"summary", "description", "runbook_url"}
        assert rule["annotations"]["runbook_url"] == f"docs/operating.md#{name.lower()}"
        assert name.lower() in anchors("docs/operating.md")
        assert "@" not in yaml.safe_dump(rule), f"{name}: a placeholder was left"


def test_a_runbook_base_url_makes_each_runbook_url_a_link():
    for base in ("https://git.example.com/delay-gateway/blob/main/", "https://git.example.com/delay-gateway/blob/main"):
        rules = rules_of(rule_groups({"metrics": {"prometheusRule": {"runbookBaseUrl": base}}}))
        for name, rule in rules.items():
            assert rule["annotations"]["runbook_url"] == \
                f"https://git.example.com/delay-gateway/blob/main/docs/operating.md#{name.lower()}"


def test_numbers_from_the_values_are_written_out_whole():
    """Helm reads numbers as floats: a million stays 1000000 (not 1e+06), a fraction stays one."""
    rules = rules_of(rule_groups({"metrics": {"prometheusRule": {"alerts": {
        "checkInBacklog": {"messages": 1_000_000}, "lateness": {"seconds": 0.25}}}}}))
    assert "> 1000000\n" in rules["DelayGatewayCheckInBacklog"]["expr"]
    assert rules["DelayGatewayLateDeliveries"]["expr"].endswith(") > 0.25\n")


def test_additional_rules_join_the_group():
    mine = [{"alert": "OrdersDelayedTooLong", "expr": "vector(1)", "for": "1m", "labels": {"severity": "info"},
             "annotations": {"summary": "ours"}},
            {"record": "delay_gateway:delivered:rate5m", "expr": "sum(rate(delay_gateway_messages_total[5m]))"}]
    rules = rules_of(rule_groups({"metrics": {"prometheusRule": {"additionalRules": mine}}}))
    assert list(rules) == ALERTS + ["OrdersDelayedTooLong", "delay_gateway:delivered:rate5m"]
    assert rules["OrdersDelayedTooLong"] == mine[0] and rules["delay_gateway:delivered:rate5m"] == mine[1]


def test_the_rules_read_only_metrics_the_gateway_has():
    spec = rule_groups()
    used = {m for r in rules_of(spec).values() for m in re.findall(r"\b(delay_gateway_\w+)", r["expr"])}
    exposed = set()
    for family in Metrics().registry.collect():
        exposed |= {family.name, family.name + "_total", family.name + "_bucket"}
    assert used <= exposed, used - exposed
    assert {"delay_gateway_ready", "delay_gateway_queue_messages", "delay_gateway_cancellations_following",
            "delay_gateway_retries_total", "delay_gateway_parked_total", "delay_gateway_connections_total",
            "delay_gateway_lateness_seconds_bucket"} <= used


# -- one source: the plain file is the chart's rendering with its defaults -----------------
def test_the_plain_rules_file_is_the_charts_rendering_with_its_defaults():
    """`python -m tests.k8s.rules` rewrites deploy/prometheus/delay-gateway-rules.yaml."""
    spec = rule_groups()
    assert PLAIN.read_text() == plain_text(spec), "stale: run `python -m tests.k8s.rules`"
    assert yaml.safe_load(PLAIN.read_text()) == {"groups": spec["groups"]}


def test_the_plain_files_own_sed_line_makes_each_runbook_url_a_link(tmp_path):
    """The two lines its header shows, run as they are on a copy."""
    copy = tmp_path / "delay-gateway-rules.yaml"
    copy.write_text(PLAIN.read_text())
    lines = [line[4:] for line in PLAIN.read_text().splitlines() if line.startswith("#   ")]
    assert len(lines) == 2 and lines[1].startswith("sed -i ")
    out = subprocess.run(["bash", "-euc", "\n".join(lines)], cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    rules = rules_of(yaml.safe_load(copy.read_text()))
    assert {r["annotations"]["runbook_url"] for r in rules.values()} == {
        f"https://git.example.com/delay-gateway/blob/main/docs/operating.md#{name.lower()}" for name in ALERTS}
    assert copy.read_text().splitlines()[:8] == PLAIN.read_text().splitlines()[:8]  # the header as it was


# -- promtool ---------------------------------------------------------------------------------
OTHER_VALUES = {"metrics": {"prometheusRule": {"alerts": {
    "notReady": {"for": "1m", "forgetAfter": "2h", "severity": "page"}, "checkInBacklog": {"messages": 50, "for": "2m"},
    "catchUpBehind": {"messages": 100000, "for": "5m"}, "overdueWaiting": {"seconds": 3600, "for": "5m"},
    "lateness": {"seconds": 5, "for": "30s"}, "parked": {"messages": 10, "window": "1h"},
    "retriesGaveUp": {"messages": 3, "window": "5m"}, "cancellationsNotFollowed": {"for": "90s"},
    "connectionsFlapping": {"connections": 30, "window": "1h"}}}}}


@pytest.mark.parametrize("which", ["plain file", "chart defaults", "chart other values"])
def test_promtool_checks_the_rules(tmp_path, which):
    if which == "plain file":
        path = PLAIN
    else:
        path = write_rules(tmp_path, rule_groups(OTHER_VALUES if which == "chart other values" else None))
    out = promtool("check", "rules", str(path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in out.stdout


def test_promtool_fails_a_broken_rule(tmp_path):
    """The check is not a formality: an expression Prometheus cannot parse is refused."""
    spec = rule_groups({"metrics": {"prometheusRule": {"additionalRules": [
        {"alert": "Broken", "expr": "sum by (namespace (delay_gateway_ready)"}]}}})
    out = promtool("check", "rules", str(write_rules(tmp_path, spec)))
    assert out.returncode != 0, out.stdout
    assert '"Broken": could not parse expression' in out.stdout + out.stderr, out.stdout + out.stderr


def series(name: str, values: str, **labels: str) -> dict:
    """One input series of the namespace NS and job JOB."""
    labels = {"namespace": NS, "job": JOB, **labels}
    return {"series": name + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}", "values": values}


def fired(labels: Dict[str, str], description: str, severity: str = "warning") -> dict:
    return {"exp_labels": {**labels, "severity": severity}, "exp_annotations": {"description": description}}


def where(vhost: Optional[str], parenthesis: bool) -> str:
    """How a description names the virtual host: absent while the label is."""
    if not vhost:
        return ""
    return f" (virtual host {vhost})" if parenthesis else f", virtual host {vhost}"


def not_ready(role: str, vhost: Optional[str] = None, for_: str = "5m", severity: str = "critical") -> dict:
    then = {"check-in": "published messages and cancels wait in the check-in queue",
            "distributor": "messages that fall due are not delivered and wait in the distributor queue"}[role]
    labels = {"namespace": NS, "job": JOB, **({"vhost": vhost} if vhost else {})}
    return fired(labels, f"In {NS} ({JOB}{where(vhost, False)}) no gateway process of role {role} (or all) has "
                         f"been connected and consuming for {for_}: {then}.", severity)


def backlog(value: str, queue: str = "delay.check-in", threshold: int = 1000, for_: str = "10m") -> dict:
    return fired({"namespace": NS, "job": JOB, "queue": queue},
                 f"{queue} in {NS} holds {value} ready messages, more than {threshold}, and has grown for {for_}: "
                 "the check-in gateways read more slowly than publishers publish.")


def behind(value: str, threshold: int = 10000, for_: str = "10m", vhost: Optional[str] = None) -> dict:
    return fired({"namespace": NS, "job": JOB, **({"vhost": vhost} if vhost else {})},
                 f"In {NS} ({JOB}{where(vhost, False)}) {value} overdue messages wait for the distributors' "
                 f"--catch-up-rate, more than {threshold}, and their number has grown for {for_}: overdue messages "
                 "reach the distributors faster than the catch-up releases them.")


def overdue_waiting(value: str, threshold: str = "300", for_: str = "10m", vhost: Optional[str] = None) -> dict:
    return fired({"namespace": NS, "job": JOB, **({"vhost": vhost} if vhost else {})},
                 f"In {NS} ({JOB}{where(vhost, False)}) the most overdue message the index of what waits lists has "
                 f"been due for {value}, more than {threshold} s, for {for_}: no distributor releases it (none runs, "
                 "or they cannot publish), or it waits in check-in unread.")


def late(value: str) -> dict:
    return fired({"namespace": NS, "job": JOB},
                 f"In {NS} ({JOB}) 1 message in 100 left for pick-up more than {value} after its due time over the "
                 "last 5 minutes (the alert's limit: 1 s, for 10m).")


def parked(queue: str, count: int, vhost: Optional[str] = None) -> dict:
    return fired({"namespace": NS, "job": JOB, "queue": queue, **({"vhost": vhost} if vhost else {})},
                 f"The consumer of {queue} in {NS}{where(vhost, True)} parked {count} messages in the last 15m: "
                 "they wait in the parked queue, with the reason, until someone replays them.")


def gave_up(queue: str, count: int) -> dict:
    return fired({"namespace": NS, "job": JOB, "queue": queue},
                 f"{count} messages rejected by the consumers of queue {queue} ({NS}) failed their last retry in the "
                 "last 15m and were parked with the reason.")


def not_following(pod: str) -> dict:
    return fired({"namespace": NS, "job": JOB, "pod": pod},
                 f"{pod} in {NS} has not followed the cancellations stream for 5m: cancels other gateways record "
                 "meanwhile do not reach it, so it may deliver a cancelled message.", "critical")


def flapping(pod: str, count: int) -> dict:
    return fired({"namespace": NS, "job": JOB, "pod": pod},
                 f"{pod} in {NS} opened {count} connections to the broker in the last 15m (more than 5).")


READY, QUEUE = "delay_gateway_ready", "delay_gateway_queue_messages"
OVERDUE = "delay_gateway_overdue_messages"
OLDEST = "delay_gateway_oldest_overdue_seconds"
PARKED, RETRIES = "delay_gateway_parked_total", "delay_gateway_retries_total"
FOLLOWING, CONNECTIONS = "delay_gateway_cancellations_following", "delay_gateway_connections_total"
LATENESS = "delay_gateway_lateness_seconds_bucket"


def buckets(by_le: Dict[str, str]) -> List[dict]:
    return [series(LATENESS, values, le=le) for le, values in by_le.items()]


# Each alert's scenarios: input series (one a minute) and, at times, the alerts firing then
# (an empty list: none; `for` and the windows are the chart's defaults).
SCENARIOS: Dict[str, List[dict]] = {
    "DelayGatewayCheckInNotReady": [
        {"about": "check-in's only pod not ready for 14 min, then ready again; the distributor fine",
         "series": [series(READY, "1x10 0x14 1x10", role="check-in", pod="ci-1"),
                    series(READY, "1x35", role="distributor", pod="d-1")],
         "at": {"14m": [], "20m": [not_ready("check-in")], "30m": []}},
        {"about": "check-in's pods gone (not scraped): the distributor's series stand for the namespace",
         "series": [series(READY, "1x10 stale", role="check-in", pod="ci-1"),
                    series(READY, "1x40", role="distributor", pod="d-1")],
         "at": {"14m": [], "20m": [not_ready("check-in")]}},
        {"about": "every pod gone: alerts for a day (forgetAfter) after the last sample, then forgets",
         "series": [series(READY, "1x10 stale", role="check-in", pod="ci-1"),
                    series(READY, "1x10 stale", role="distributor", pod="d-1")],
         "at": {"20m": [not_ready("check-in")], "24h5m": [not_ready("check-in")], "24h15m": []}},
        {"about": "a process that never gets ready (0 from its start)",
         "series": [series(READY, "0x20", role="all", pod="gw-1")],
         "at": {"4m": [], "6m": [not_ready("check-in")]}},
        {"about": "role all serves check-in", "series": [series(READY, "1x30", role="all", pod="gw-1")],
         "at": {"10m": [], "30m": []}},
        {"about": "per virtual host: ready for one, not for the other",
         "series": [series(READY, "1x30", role="check-in", pod="ci-1", vhost="a"),
                    series(READY, "1x10 0x20", role="check-in", pod="ci-1", vhost="b"),
                    series(READY, "1x30", role="distributor", pod="d-1", vhost="a"),
                    series(READY, "1x30", role="distributor", pod="d-1", vhost="b")],
         "at": {"20m": [not_ready("check-in", vhost="b")]}},
    ],
    "DelayGatewayDistributorNotReady": [
        {"about": "both distributor pods down for 14 min; check-in fine",
         "series": [series(READY, "1x10 0x14 1x10", role="distributor", pod="d-1"),
                    series(READY, "1x10 0x14 1x10", role="distributor", pod="d-2"),
                    series(READY, "1x35", role="check-in", pod="ci-1")],
         "at": {"14m": [], "20m": [not_ready("distributor")], "30m": []}},
        {"about": "one of two distributor pods down: still one ready",
         "series": [series(READY, "1x10 0x20", role="distributor", pod="d-1"),
                    series(READY, "1x30", role="distributor", pod="d-2"),
                    series(READY, "1x30", role="check-in", pod="ci-1")],
         "at": {"20m": [], "30m": []}},
        {"about": "role all serves the distributor", "series": [series(READY, "1x30", role="all", pod="gw-1")],
         "at": {"10m": [], "30m": []}},
    ],
    "DelayGatewayCheckInBacklog": [
        {"about": "growing by 100 a minute past 1000 (from t=11m), reported by two pods; then drained",
         "series": [series(QUEUE, "0+100x25 0x20", queue="delay.check-in", pod="ci-1"),
                    series(QUEUE, "0+100x25 0x20", queue="delay.check-in", pod="d-1")],
         "at": {"15m": [], "22m": [backlog("2.2k")], "25m": [backlog("2.5k")], "35m": []}},
        {"about": "a large backlog that no longer grows, one that shrinks, and a growing one below 1000",
         "series": [series(QUEUE, "5000x40", queue="a.check-in", pod="ci-1"),
                    series(QUEUE, "5000-100x40", queue="b.check-in", pod="ci-1"),
                    series(QUEUE, "0+20x40", queue="c.check-in", pod="ci-1")],
         "at": {"20m": [], "40m": []}},
        {"about": "other queues are not check-in",
         "series": [series(QUEUE, "0+500x40", queue="delay.distributor", pod="ci-1"),
                    series(QUEUE, "0+500x40", queue="delay.parked", pod="ci-1")],
         "at": {"30m": []}},
    ],
    "DelayGatewayCatchUpBehind": [
        {"about": "two distributors' backlogs growing by 500 a minute each, past 10,000 together at t=10m; "
                  "then released",
         "series": [series(OVERDUE, "0+500x30 0x15", queue="delay.distributor", pod="d-1"),
                    series(OVERDUE, "0+500x30 0x15", queue="delay.distributor", pod="d-2")],
         "at": {"15m": [], "21m": [behind("21k")], "30m": [behind("30k")], "40m": []}},
        {"about": "a large backlog the catch-up works down, and a growing one still small",
         "series": [series(OVERDUE, "50000-1000x40", queue="delay.distributor", pod="d-1", vhost="a"),
                    series(OVERDUE, "0+100x40", queue="delay.distributor", pod="d-1", vhost="b")],
         "at": {"20m": [], "40m": []}},
        {"about": "per virtual host: one growing past the limit",
         "series": [series(OVERDUE, "0+1000x30", queue="delay.distributor", pod="d-1", vhost="a"),
                    series(OVERDUE, "0x30", queue="delay.distributor", pod="d-1", vhost="b")],
         "at": {"21m": [behind("21k", vhost="a")]}},
    ],
    "DelayGatewayOverdueWaiting": [
        {"about": "two gateways read the same index: the oldest overdue ages a minute a minute from t=0, then "
                  "is released at t=30m",
         "series": [series(OLDEST, "0+60x30 0x15", pod="g-1"), series(OLDEST, "0+60x30 0x15", pod="g-2")],
         "at": {"14m": [], "16m": [overdue_waiting("16m 0s")], "29m": [overdue_waiting("29m 0s")], "40m": []}},
        {"about": "overdue for a few minutes only, again and again (a distributor restarted now and then)",
         "series": [series(OLDEST, "0+60x4 0 0+60x4 0 0+60x4 0 0+60x4", pod="g-1")],
         "at": {"10m": [], "20m": []}},
        {"about": "per virtual host",
         "series": [series(OLDEST, "0+60x30", pod="g-1", vhost="a"), series(OLDEST, "0x30", pod="g-1", vhost="b")],
         "at": {"20m": [overdue_waiting("20m 0s", vhost="a")]}},
    ],
    "DelayGatewayLateDeliveries": [
        {"about": "every message 1 to 2.5 s late for 20 min, then on time again",
         "series": buckets({"0.01": "0x20 60+60x19", "0.5": "0x20 60+60x19", "1": "0x20 60+60x19",
                            "2.5": "0+60x40", "+Inf": "0+60x40"}),
         "at": {"10m": [], "15m": [late("2.485s")], "32m": []}},
        {"about": "every message within 10 ms",
         "series": buckets({"0.01": "0+60x30", "0.5": "0+60x30", "1": "0+60x30", "2.5": "0+60x30",
                            "+Inf": "0+60x30"}),
         "at": {"20m": [], "30m": []}},
        {"about": "no traffic at all",
         "series": buckets({"0.01": "0x30", "1": "0x30", "+Inf": "0x30"}), "at": {"20m": []}},
    ],
    "DelayGatewayMessagesParked": [
        {"about": "a park in check-in (its counter at 0 since start), and a first park in a series new then",
         "series": [series(PARKED, "0x30 1x30", queue="delay.check-in", pod="ci-1"),
                    series(PARKED, "_x30 1x30", queue="delay.distributor", pod="d-2")],
         "at": {"29m": [], "35m": [parked("delay.check-in", 1), parked("delay.distributor", 1)], "50m": []}},
        {"about": "old parks, and a restart that resets a counter without new parks",
         "series": [series(PARKED, "4x40", queue="delay.check-in", pod="ci-1"),
                    series(PARKED, "3x20 0x20", queue="delay.distributor", instance="gw:9090")],
         "at": {"20m": [], "30m": [], "40m": []}},
        {"about": "three parks for one virtual host",
         "series": [series(PARKED, "0x20 3x20", queue="delay.parking", pod="d-1", vhost="orders"),
                    series(PARKED, "0x40", queue="delay.parking", pod="d-1", vhost="billing")],
         "at": {"25m": [parked("delay.parking", 3, vhost="orders")]}},
    ],
    "DelayGatewayRetriesGaveUp": [
        {"about": "a first give-up (the series appears at 1), a second, then none",
         "series": [series(RETRIES, "_x20 1x10 2x30", queue="orders", outcome="gave_up", pod="ci-1")],
         "at": {"19m": [], "25m": [gave_up("orders", 1)], "33m": [gave_up("orders", 2)],
                "40m": [gave_up("orders", 1)], "60m": []}},
        {"about": "retries scheduled and delivered, and give-ups long ago",
         "series": [series(RETRIES, "0+5x60", queue="orders", outcome="scheduled", pod="ci-1"),
                    series(RETRIES, "0+5x60", queue="orders", outcome="delivered", pod="d-1"),
                    series(RETRIES, "3x60", queue="billing", outcome="gave_up", pod="ci-1")],
         "at": {"20m": [], "50m": []}},
    ],
    "DelayGatewayCancellationsNotFollowed": [
        {"about": "a pod cut off from the stream for 10 min",
         "series": [series(FOLLOWING, "1x10 0x10 1x10", pod="ci-1"), series(FOLLOWING, "1x30", pod="ci-2")],
         "at": {"14m": [], "18m": [not_following("ci-1")], "25m": []}},
        {"about": "a reconnect of 3 minutes", "series": [series(FOLLOWING, "1x10 0x3 1x20", pod="ci-1")],
         "at": {"13m": [], "20m": []}},
    ],
    "DelayGatewayConnectionsFlapping": [
        {"about": "a new connection every minute for 20 min, then steady",
         "series": [series(CONNECTIONS, "1+1x20 21x30", pod="ci-1")],
         "at": {"4m": [], "20m": [flapping("ci-1", 15)], "40m": []}},
        {"about": "one connection; three reconnects (a broker's rolling restart)",
         "series": [series(CONNECTIONS, "1x40", pod="ci-1"), series(CONNECTIONS, "1+1x3 4x40", pod="d-1")],
         "at": {"10m": [], "30m": []}},
    ],
}


def unit_tests(rules: Path, alert: str, scenarios: List[dict], full_annotations: Dict[str, dict]) -> dict:
    """A promtool test file: each scenario a test with its series; each expected alert has
    the alert's summary and runbook_url besides the description given."""
    tests = []
    for s in scenarios:
        checks = []
        for at, alerts in s["at"].items():
            expected = [{**a, "exp_annotations": {**full_annotations[alert], **a["exp_annotations"]}}
                        for a in alerts]
            checks.append({"eval_time": at, "alertname": alert, "exp_alerts": expected})
        tests.append({"name": s["about"], "interval": "1m", "input_series": s["series"], "alert_rule_test": checks})
    return {"rule_files": [str(rules)], "evaluation_interval": "1m", "tests": tests}


def run_unit_tests(tmp_path: Path, rules: Path, alert: str, scenarios: List[dict]) -> subprocess.CompletedProcess:
    spec = yaml.safe_load(rules.read_text())
    annotations = {name: {k: v for k, v in r["annotations"].items() if k != "description"}
                   for name, r in rules_of(spec).items()}
    path = tmp_path / "tests.yaml"
    path.write_text(yaml.safe_dump(unit_tests(rules, alert, scenarios, annotations), sort_keys=False))
    return promtool("test", "rules", str(path))


@pytest.mark.parametrize("alert", ALERTS)
def test_each_alert_fires_stays_quiet_and_resolves(tmp_path, alert):
    """promtool evaluates the plain file's rule over each scenario's series."""
    scenarios = SCENARIOS[alert]
    assert any(a for s in scenarios for a in s["at"].values()), "no scenario makes it fire"
    assert any(not a for s in scenarios for a in s["at"].values()), "no scenario where it stays quiet"
    out = run_unit_tests(tmp_path, PLAIN, alert, scenarios)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_a_scenario_that_expects_the_wrong_thing_fails(tmp_path):
    """The unit tests can fail: the same series, expecting the backlog alert a minute before
    its `for` has passed."""
    [first, *_] = SCENARIOS["DelayGatewayCheckInBacklog"]
    wrong = {**first, "at": {"20m": [backlog("2.0k")]}}
    out = run_unit_tests(tmp_path, PLAIN, "DelayGatewayCheckInBacklog", [wrong])
    assert out.returncode != 0 and "FAILED" in out.stdout + out.stderr, out.stdout


def test_the_thresholds_and_durations_come_from_the_values(tmp_path):
    """With other values the same series fire later, sooner, or not at all."""
    rules = write_rules(tmp_path, rule_groups(OTHER_VALUES))
    scenarios = {
        # for: 1m (not 5m), severity page; all gone: forgotten 2 h after the last sample
        "DelayGatewayCheckInNotReady": [
            {**SCENARIOS["DelayGatewayCheckInNotReady"][0], "at": {
                "11m": [], "12m": [not_ready("check-in", for_="1m", severity="page")]}},
            {**SCENARIOS["DelayGatewayCheckInNotReady"][2], "at": {
                "2h5m": [not_ready("check-in", for_="1m", severity="page")], "2h15m": []}}],
        # 50 messages and 2m: 0, 100, 200, ... passes 50 at t=1m, fires at t=3m
        "DelayGatewayCheckInBacklog": [{**SCENARIOS["DelayGatewayCheckInBacklog"][0], "at": {
            "2m": [], "3m": [backlog("300", threshold=50, for_="2m")]}}],
        # 100,000 messages: 30,000 is not enough
        "DelayGatewayCatchUpBehind": [{**SCENARIOS["DelayGatewayCatchUpBehind"][0], "at": {"30m": []}}],
        # an hour: 29 minutes overdue is not enough
        "DelayGatewayOverdueWaiting": [{**SCENARIOS["DelayGatewayOverdueWaiting"][0], "at": {"29m": []}}],
        # 5 s: messages 2.5 s late are not late enough
        "DelayGatewayLateDeliveries": [{**SCENARIOS["DelayGatewayLateDeliveries"][0], "at": {"15m": []}}],
        # more than 10 parks, more than 30 connections, within 1h
        "DelayGatewayMessagesParked": [{**SCENARIOS["DelayGatewayMessagesParked"][0], "at": {"35m": []}}],
        "DelayGatewayConnectionsFlapping": [{**SCENARIOS["DelayGatewayConnectionsFlapping"][0], "at": {"20m": []}}],
    }
    for alert, cases in scenarios.items():
        out = run_unit_tests(tmp_path, rules, alert, cases)
        assert out.returncode == 0, alert + "\n" + out.stdout + out.stderr


# -- the values' schema ----------------------------------------------------------------------
def test_the_schema_accepts_the_rule_values():
    values = {"metrics": {"prometheusRule": {
        "enabled": True, "namespace": "monitoring", "labels": {"release": "prom"},
        "runbookBaseUrl": "https://git.example.com/delay-gateway/blob/main/",
        "additionalRules": [{"alert": "Mine", "expr": "vector(1)", "for": "1h30m", "labels": {"team": "orders"}},
                            {"record": "a:b", "expr": "vector(1)"}],
        **OTHER_VALUES["metrics"]["prometheusRule"]}}}
    with helm.Chart.load(str(CHART)) as chart:
        chart.validate_schema(values)
    assert by_kind(render(values), "PrometheusRule")


@pytest.mark.parametrize("values,why", [
    ({"enabled": "yes"}, "enabled"),
    ({"labels": {"release": 1}}, "release"),
    ({"namespace": 7}, "namespace"),
    ({"runbookBaseUrl": "https://x/ y"}, "runbookBaseUrl"),
    ({"alerts": {"notReady": {"for": "5 minutes"}}}, "for"),
    ({"alerts": {"notReady": {"for": 300}}}, "for"),
    ({"alerts": {"notReady": {"severity": "very bad"}}}, "severity"),
    ({"alerts": {"notReady": {"severity": None}}}, "severity"),  # a null would leave its placeholder
    ({"alerts": {"notReady": {"forgetAfter": "a day"}}}, "forgetAfter"),
    ({"alerts": {"checkInBacklog": {"messages": -1}}}, "messages"),
    ({"alerts": {"checkInBacklog": {"messages": "1000"}}}, "messages"),
    ({"alerts": {"catchUpBehind": {"messages": -5}}}, "messages"),
    ({"alerts": {"lateness": {"seconds": 0}}}, "seconds"),
    ({"alerts": {"lateness": {"seconds": "1s"}}}, "seconds"),
    ({"alerts": {"parked": {"window": "15"}}}, "window"),
    ({"alerts": {"parked": {"window": "15m1h"}}}, "window"),  # Prometheus wants the largest unit first
    ({"alerts": {"parked": {"window": ""}}}, "window"),
    ({"alerts": {"connectionsFlapping": {"connections": 2.5}}}, "connections"),
    ({"alerts": {"lateness": {"p99": 1}}}, "p99"),
    ({"alerts": {"lateNess": {"seconds": 1}}}, "lateNess"),
    ({"additionalRules": [{"alert": "A"}]}, "expr"),
    ({"additionalRules": [{"alert": "A", "expr": "vector(1)", "for": "soon"}]}, "for"),
    ({"additionalRules": [{"alert": "A", "expr": "vector(1)", "annotation": {}}]}, "annotation"),
    ({"additionalRules": [{"expr": "vector(1)"}]}, "additionalRules"),  # neither alert nor record
    ({"additionalRules": {"alert": "A", "expr": "vector(1)"}}, "additionalRules"),
])
def test_the_schema_rejects_wrong_rule_values(values, why):
    wrong = {"metrics": {"prometheusRule": {"enabled": True, **values}}}
    with helm.Chart.load(str(CHART)) as chart:
        with pytest.raises(helm.HelmValuesError, match=why):
            chart.validate_schema(wrong)
    with pytest.raises(helm.HelmValuesError):
        render(wrong)
