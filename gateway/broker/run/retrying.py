"""Retries on the broker: the retry consumer's metrics and logs (the decisions are
gateway/core/retries.py's and handlers.Retry's)."""

from typing import List

import structlog

from gateway.core import envelope, retries
from gateway.core.actions import Action, Enqueue, Forward
from gateway.core.inputs import Delivery
from gateway.core.effects import Handler
from gateway.metrics import Metrics


def counting_retries(retry: Handler, metrics: Metrics) -> Handler:
    """The retry handler, counting what becomes of each failed message per source queue, and
    logging each one given up."""
    log = structlog.get_logger("gateway")

    def handle(d: Delivery, now: int) -> List[Action]:
        actions = retry(d, now)
        for action in actions:
            if isinstance(action, Enqueue):
                queue = envelope.readable_key(action.entry.routing_key)
                metrics.retries.labels(queue, "scheduled").inc()
                attempt = action.entry.user.headers.get(retries.ATTEMPT)
                log.debug("retry_scheduled", queue=queue, attempt=attempt, due_ms=action.entry.due_ms,
                         message_id=action.entry.user.text("message_id"))
            elif isinstance(action, Forward) and action.reason and action.reason.startswith(retries.GAVE_UP):
                queue = envelope.readable_key(action.routing_key)
                metrics.retries.labels(queue, "gave_up").inc()
        return actions
    return handle
