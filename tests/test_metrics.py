"""gateway/metrics.py: one registry, a view per virtual host."""

from prometheus_client import generate_latest

from gateway.metrics import Metrics


def samples(metrics: Metrics) -> dict:
    out = {}
    for line in generate_latest(metrics.registry).decode().splitlines():
        if not line.startswith("#"):
            sample, _, value = line.rpartition(" ")
            out[sample] = float(value)
    return out


def test_families_labelled_by_vhost_alone_show_zero_from_the_start_for_each_view():
    """An alert's increase() sees the first connection too: the sample exists at 0 before it.
    Families with more labels show nothing until a value of those labels is used."""
    metrics = Metrics()
    other = metrics.of("orders")
    got = samples(metrics)
    for vhost in ("/", "orders"):
        assert got[f'delay_gateway_connections_total{{vhost="{vhost}"}}'] == 0
        assert got[f'delay_gateway_cancellations_held{{vhost="{vhost}"}}'] == 0
        assert f'delay_gateway_lateness_seconds_count{{vhost="{vhost}"}}' in got
    assert not [s for s in got if s.startswith(("delay_gateway_messages_total", "delay_gateway_held_messages"))]
    other.connections.inc()
    metrics.held.labels("q").set(3)
    got = samples(metrics)
    assert got['delay_gateway_connections_total{vhost="orders"}'] == 1
    assert got['delay_gateway_connections_total{vhost="/"}'] == 0
    assert got['delay_gateway_held_messages{queue="q",vhost="/"}'] == 3


def test_clear_removes_one_vhosts_samples_only():
    metrics = Metrics()
    other = metrics.of("orders")
    metrics.held.labels("q").set(1)
    other.held.labels("q").set(2)
    other.held.clear()
    held = {s: v for s, v in samples(metrics).items() if s.startswith("delay_gateway_held_messages")}
    assert held == {'delay_gateway_held_messages{queue="q",vhost="/"}': 1}
