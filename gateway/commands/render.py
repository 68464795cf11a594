"""`delay-gateway render`: the topology printed as code (definitions, Terraform, operator resources)."""

import argparse
import sys
from types import SimpleNamespace
from typing import Optional

from topology import build
from topology.render import DESCRIPTIONS, FORMATS, render

from gateway.settings import Settings, UsageError


def add_arguments(p: argparse.ArgumentParser) -> None:
    described = "; ".join(f"{name}: {DESCRIPTIONS.get(name, name)}" for name in sorted(FORMATS))
    p.add_argument("--format", choices=sorted(FORMATS), default="definitions",
                   help=f"{described} (default: definitions)")
    p.add_argument("--vhost", default="/", help="the virtual host the objects belong to (default /)")
    operator = p.add_argument_group("operator format: the RabbitmqCluster the resources belong to")
    operator.add_argument("--cluster-name", help="name of the RabbitmqCluster object")
    operator.add_argument("--cluster-namespace", help="its namespace (default: the resources' own)")
    operator.add_argument("--connection-secret", metavar="SECRET",
                          help="instead of --cluster-name: a Secret with the HTTP API's uri, username, password")


def main(settings: Settings, format: str, vhost: str, cluster_name: Optional[str],
         cluster_namespace: Optional[str], connection_secret: Optional[str]) -> int:
    chain = settings.chain
    topology = build(chain, settings.cancel_window_ms)
    options = SimpleNamespace(vhost=vhost, cluster_name=cluster_name, cluster_namespace=cluster_namespace,
                              connection_secret=connection_secret)
    try:
        text = render(format, topology, options)
    except ValueError as exc:  # options the format cannot work with
        raise UsageError(str(exc)) from None
    sys.stdout.write(text)
    return 0
