"""`delay-gateway declare`: the topology declared on the broker (in each of --vhosts), idempotently."""

from topology import build
from topology.footprint import Fit, over_budget, reserved_handles
from topology.broker.declare import short_retention
from topology.broker.inventory import read_registry
from topology.model import Topology
from topology.registry import ChainKey, fold

from gateway.broker.run import index_streams, stamp, upkeep
from gateway.broker.plumbing.amqp import BrokerError, Trouble, blocking_channel
from gateway.broker.plumbing.management import Management, handles_fit
from gateway.settings import Settings
from gateway.urls import per_vhost, vhost_of


def main(settings: Settings) -> int:
    chain = settings.chain
    topology = build(chain, settings.cancel_window_ms)
    # --vhosts: the same topology in each, one line each (unset: the URL's own, said as before)
    for vhost, where in per_vhost(settings.urls, settings.vhosts):
        management = Management(settings.management_url, where[0], settings.tls) if settings.management_url else None
        with blocking_channel(where, tls=settings.tls) as channel:
            version = stamp.version_of(getattr(channel.connection._impl, "server_properties", None))
            checked = management if management is not None and version is not None and version[0] == 3 else None
            if checked is not None:
                refuse_what_would_not_fit(checked, vhost_of(where[0]), topology)
            index_streams.declare_noting(channel, topology)
            short = short_retention(channel, topology)
            reserved = reserved_handles(topology, version) if checked is None else None
            records = read_registry(channel.connection, chain.names)
            upkeep.record_chain(channel.connection, chain.prefix, ChainKey.of(chain),
                                None if records is None else fold(records))
        print(f"declared {len(topology.exchanges)} exchanges, {len(topology.queues)} queues, "
              f"{len(topology.bindings)} bindings with prefix {topology.settings.prefix!r} "
              f"(chain {chain.generation}, {chain.max_level} levels)"
              + ("" if vhost is None else f" in virtual host {vhost!r}"), flush=True)
        if checked is not None:  # what each node reserves now, as it counts it
            reserved = "file handles, by the management API: " + Fit(0, checked.nodes()).said()
        for note in (short, reserved):
            if note is not None:
                print(f"note: {note}", flush=True)
    return 0


def refuse_what_would_not_fit(management: Management, vhost: str, topology: Topology) -> None:
    """On RabbitMQ 3.x, before declaring anything: refuse a topology whose new quorum queues
    would take a node past what its file handles hold."""
    fit = handles_fit(management, vhost, topology)
    if fit.refused:
        raise BrokerError(Trouble(False, f"refused: {over_budget(fit)}; without --management-url, declare does "
                                         "not check"))
