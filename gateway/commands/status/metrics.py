"""What the gateways' /metrics pages add to the status report: held, carried and retried messages."""

from typing import Dict, Iterable, List, Optional


def held_from_metrics(texts: Iterable[str], distributor: str) -> int:
    """The distributors' held messages (every exit queue of the prefix), summed over the
    gateways' /metrics pages."""
    total = 0.0
    for name, labels, value in _samples(texts):
        queue = labels.get("queue", "")
        if name == "delay_gateway_held_messages" and (queue == distributor or queue.startswith(distributor + ".")):
            total += value
    return int(total)


def carried_from_metrics(texts: Iterable[str]) -> Optional[Dict[str, float]]:
    """Messages per publish into the chain, by what was sent (chain, meditation,
    distributor), summed over the gateways' /metrics pages; None if none were sent yet."""
    sums: Dict[str, List[float]] = {}
    for name, labels, value in _samples(texts):
        if name in ("delay_gateway_batched_messages_total", "delay_gateway_batch_publishes_total"):
            pair = sums.setdefault(labels.get("outcome", ""), [0.0, 0.0])
            pair[0 if name == "delay_gateway_batched_messages_total" else 1] += value
    ratios = {outcome: m / p for outcome, (m, p) in sums.items() if p}
    return ratios or None


def retries_from_metrics(texts: Iterable[str]) -> Dict[str, Dict[str, int]]:
    """Failed messages per source queue and what became of them (scheduled, delivered,
    gave_up, parked), summed over the gateways' /metrics pages (since each gateway started)."""
    out: Dict[str, Dict[str, int]] = {}
    for name, labels, value in _samples(texts):
        if name == "delay_gateway_retries_total":
            counts = out.setdefault(labels.get("queue", ""), {"scheduled": 0, "delivered": 0, "gave_up": 0,
                                                              "parked": 0})
            counts[labels.get("outcome", "")] = counts.get(labels.get("outcome", ""), 0) + int(value)
    return out


def _samples(texts: Iterable[str]):
    from prometheus_client.parser import text_string_to_metric_families

    for page in texts:
        for family in text_string_to_metric_families(page):
            for sample in family.samples:
                yield sample.name, sample.labels, sample.value
