"""Several virtual hosts served by one `run` (--vhosts a,b,c): each vhost is what a process
of one vhost is (worker.one: its topology declared under the prefix, its own connections for
the consumers, the upkeep and the cancellations, its own guarantees), in threads of its own,
and shares only the process's metrics port (every sample labelled with its vhost) and its
SIGTERM.

A vhost the broker refuses (a login or a permission withdrawn there, its topology missing
under --no-declare) does not stop the others: after the attempts a process of one vhost
makes before it gives up, it is reported once (`vhost_refused`, and the gauge
`delay_gateway_vhost_refused`), and tried again with backoff until it is let in
(`vhost_resumed`). Only when every vhost is refused does the process give up, as a process
of one would (exit 3). A broker that cannot be reached for --connect-timeout is every
vhost's trouble alike: the process exits 1.
"""

import dataclasses
import threading
from typing import Dict, List, Optional

import structlog

from gateway.broker.plumbing.amqp import Trouble
from gateway.broker.run import launch
from gateway.broker.run.worker import Refusals, one
from gateway.health import Parts
from gateway.metrics import Metrics
from gateway.settings import Settings
from gateway.urls import with_vhost

JOIN_POLL_S = 0.2


class VhostRefusals(Refusals):
    """One vhost's refusals, among the others' (`Parts` knows which are refused)."""

    def __init__(self, vhost: str, parts: Parts, metrics: Metrics, lock: threading.Lock) -> None:
        self.vhost, self.parts, self.metrics, self.lock = vhost, parts, metrics, lock
        self.said = ""  # the refusal last reported: the same again at each retry is no news
        self.log = structlog.get_logger("gateway")
        metrics.vhost_refused.set(0)

    def tolerate(self, trouble: Trouble, retry_in_s: float) -> bool:
        with self.lock:
            self.parts.refused[self.vhost] = True
            others = [v for v, refused in self.parts.refused.items() if not refused]
        self.metrics.vhost_refused.set(1)
        if trouble.message != self.said:
            self.said = trouble.message
            self.log.error("vhost_refused", error=trouble.message, retry_in_s=round(retry_in_s, 2),
                           serving=others)
        else:
            self.log.debug("vhost_still_refused", retry_in_s=round(retry_in_s, 2))
        return bool(others)

    def back(self) -> None:
        with self.lock:
            was = self.parts.refused[self.vhost]
            self.parts.refused[self.vhost] = False
        if was:
            self.said = ""
            self.metrics.vhost_refused.set(0)
            self.log.info("vhost_resumed")


def serve(settings: Settings) -> int:
    """`delay-gateway run --vhosts ...`: every vhost's consumers until SIGTERM or SIGINT."""
    parts = Parts(settings.vhosts)
    metrics = Metrics(vhost=settings.vhosts[0])
    stop = launch.process(settings, metrics, parts, vhosts=list(settings.vhosts))
    lock = threading.Lock()
    codes: Dict[str, Optional[int]] = {}
    threads: List[threading.Thread] = []

    def serve_one(vhost: str) -> None:
        structlog.contextvars.bind_contextvars(vhost=vhost)  # every line of this vhost's threads says it
        own = dataclasses.replace(settings, urls=tuple(with_vhost(u, vhost) for u in settings.urls), vhosts=(vhost,))
        vhost_metrics = metrics.of(vhost)
        try:
            code = one(own, stop, vhost_metrics, parts.parts[vhost], VhostRefusals(vhost, parts, vhost_metrics, lock))
        except Exception as exc:  # one vhost's bug must not end the others silently: the process stops
            structlog.get_logger("gateway").exception("vhost_failed", error=repr(exc))
            code = 1
        codes[vhost] = code
        if code:
            stop.set()

    for vhost in settings.vhosts:
        threads.append(launch.daemon(f"vhost {vhost}", serve_one, vhost))
    while any(t.is_alive() for t in threads):
        for t in threads:
            t.join(JOIN_POLL_S)
    failed = [code for code in codes.values() if code]
    if failed:
        # (the vhost that gave up said why, in one line, as a process of one vhost does)
        return failed[0]
    return 0
