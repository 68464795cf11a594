"""The alert rules as a plain Prometheus rules file: what the chart's PrometheusRule holds
with the chart's default values (one source, files/prometheus-rules.yaml), written the way
deploy/prometheus/delay-gateway-rules.yaml is. `python -m tests.k8s.rules` rewrites that
file; tests/k8s/test_alerts.py fails when it is stale."""

import sys
from typing import Optional

import yaml

from .manifests import DEPLOY, by_kind, render

PLAIN = DEPLOY.parent / "prometheus" / "delay-gateway-rules.yaml"
ORDER = ("alert", "record", "expr", "for", "keep_firing_for", "labels", "annotations")
ANNOTATIONS = ("summary", "description", "runbook_url")
HEADER = """\
# The delay gateway's alerts, for a Prometheus without the Prometheus Operator: list this file
# under rule_files in prometheus.yml (docs/kubernetes.md, "Alerts"). Each runbook_url is the
# alert's section of docs/operating.md; to make it a link, put where you read this
# repository in front of it, for example:
#   base=https://git.example.com/delay-gateway/blob/main/
#   sed -i "/^ /s|runbook_url: docs/|runbook_url: ${base}docs/|" delay-gateway-rules.yaml
# Generated, do not edit: the Helm chart's PrometheusRule with its default values (the rules
# are its files/prometheus-rules.yaml); `python -m tests.k8s.rules` writes it again.
"""


def rule_groups(values: Optional[dict] = None) -> dict:
    """The `spec` of the PrometheusRule the chart renders, with the rules enabled."""
    rule = dict((values or {}).get("metrics", {}).get("prometheusRule", {}), enabled=True)
    values = {**(values or {}), "metrics": {**(values or {}).get("metrics", {}), "prometheusRule": rule}}
    [rendered] = by_kind(render(values), "PrometheusRule").values()
    return rendered["spec"]


class _Dumper(yaml.SafeDumper):
    pass


def _text(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    # expressions over several lines stay readable as a literal block; long descriptions folded
    style = "|" if "\n" in value else ">" if len(value) > 80 else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _text)


def _ordered(rule: dict) -> dict:
    out = {k: rule[k] for k in ORDER if k in rule}
    if "annotations" in out:
        given = out["annotations"]
        out["annotations"] = {**{k: given[k] for k in ANNOTATIONS if k in given}, **given}
    return out


def plain_text(spec: dict) -> str:
    groups = [{"name": g["name"], "rules": [_ordered(r) for r in g["rules"]]} for g in spec["groups"]]
    return HEADER + yaml.dump({"groups": groups}, Dumper=_Dumper, sort_keys=False, width=100, allow_unicode=True)


if __name__ == "__main__":
    PLAIN.parent.mkdir(exist_ok=True)
    PLAIN.write_text(plain_text(rule_groups()))
    print(f"wrote {PLAIN}", file=sys.stderr)
