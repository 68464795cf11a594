"""RabbitMQ's management API over HTTP, for what AMQP cannot see: each node's open-files limit
and where its quorum queues live (topology/footprint.py judges whether a prefix fits)."""

import base64
import json
import ssl
import time
import urllib.error
import urllib.request
from typing import Any, Set, Tuple
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from gateway.broker.plumbing.amqp import BrokerError, Trouble
from gateway.settings import Tls
from topology.footprint import Fit, NodeHandles, quorum_names, reserved_by_node
from topology.model import Topology

TIMEOUT_S = 30.0
STATS_WAIT_S = 15.0
SEES_ALL = {"monitoring", "administrator"}  # tags whose holders see every virtual host's queues


class Management:
    """A client of one management API; user and password from its URL, else from `amqp_url`."""

    def __init__(self, url: str, amqp_url: str, tls: Tls) -> None:
        parts = urlsplit(url)  # checked by gateway/settings.http_url
        source = parts if parts.username else urlsplit(amqp_url)
        self.user = unquote(source.username or "guest")
        password = unquote(source.password or "guest")
        self.auth = "Basic " + base64.b64encode(f"{self.user}:{password}".encode()).decode()
        netloc = (parts.hostname or "") + (f":{parts.port}" if parts.port else "")
        self.base = urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))
        self.context = ssl.create_default_context(cafile=tls.ca_file) if parts.scheme == "https" else None

    def get(self, path: str) -> Any:
        request = urllib.request.Request(self.base + path, headers={"Authorization": self.auth})
        where = f"the management API at {self.base}"
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S, context=self.context) as response:
                return json.load(response)
        except urllib.error.HTTPError as exc:
            if exc.code in (401, 403):
                raise BrokerError(Trouble(False, f"{where} refused user {self.user!r} ({exc.code}): check the user "
                                                 "and password (in --management-url, else the AMQP URL's)")) from None
            raise BrokerError(Trouble(False, f"{where} answered {exc.code} to {path}: is --management-url the "
                                             "management API (http://HOST:15672)?")) from None
        except (OSError, urllib.error.URLError) as exc:
            reason = getattr(exc, "reason", exc)
            raise BrokerError(Trouble(True, f"{where} did not answer ({reason}): check --management-url, and that "
                                            "the node runs the management plugin")) from None
        except ValueError:
            raise BrokerError(Trouble(False, f"{where} did not answer {path} with JSON: is --management-url the "
                                             "management API (http://HOST:15672)?")) from None

    def nodes(self) -> Tuple[NodeHandles, ...]:
        """Each running node: its open-files limit, and what its quorum queues and sockets
        reserve. Refused unless the user sees every virtual host's queues."""
        tags = self.get("/api/whoami").get("tags", [])
        tags = set(tags if isinstance(tags, list) else str(tags).split(","))
        if not tags & SEES_ALL:
            raise BrokerError(Trouble(False, f"the management user {self.user!r} sees only its own virtual hosts' "
                                             "queues, so the file handles of the others would go uncounted: give "
                                             "it the monitoring tag (rabbitmqctl set_user_tags), or name a user "
                                             "that has it in --management-url"))
        quorum = [(q.get("leader") or q.get("node"), q.get("members") or [])
                  for q in self.get("/api/queues?columns=name,type,node,leader,members")
                  if q.get("type") == "quorum"]
        reserved = reserved_by_node(quorum)
        # a node's statistics come within collect_statistics_interval (5 s) of its start
        deadline = time.monotonic() + STATS_WAIT_S
        while True:
            nodes = [n for n in self.get("/api/nodes") if n.get("running", True)]
            if nodes and all(isinstance(n.get("fd_total"), int) for n in nodes):
                break
            if time.monotonic() > deadline:
                raise BrokerError(Trouble(False, f"the management API at {self.base} showed no open-files limit of "
                                                 f"its nodes (fd_total) within {STATS_WAIT_S:.0f} s: is "
                                                 "--management-url the management API?"))
            time.sleep(1.0)
        return tuple(NodeHandles(n["name"], n["fd_total"], reserved.get(n["name"], 0) + int(n.get("sockets_used") or 0))
                     for n in nodes)

    def queue_names(self, vhost: str) -> Set[str]:
        return {q["name"] for q in self.get(f"/api/queues/{quote(vhost, safe='')}?columns=name")}


def handles_fit(management: Management, vhost: str, topology: Topology) -> Fit:
    """Whether the quorum queues `topology` would add in `vhost` (those not there yet) fit
    every node's file-handle budget."""
    there = management.queue_names(vhost)
    new = sum(1 for name in quorum_names(topology) if name not in there)
    return Fit(new, management.nodes())
