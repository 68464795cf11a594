"""`delay-gateway declare`: the topology declared on the broker (in each of --vhosts), idempotently."""

from topology import build
from topology.footprint import reserved_handles
from topology.broker.declare import short_retention
from topology.broker.inventory import read_registry
from topology.registry import ChainKey, fold

from gateway.broker.run import index_streams, stamp, upkeep
from gateway.broker.plumbing.amqp import blocking_channel
from gateway.settings import Settings
from gateway.urls import per_vhost


def main(settings: Settings) -> int:
    chain = settings.chain
    topology = build(chain, settings.cancel_window_ms)
    # --vhosts: the same topology in each, one line each (unset: the URL's own, said as before)
    for vhost, where in per_vhost(settings.urls, settings.vhosts):
        with blocking_channel(where, tls=settings.tls) as channel:
            index_streams.declare_noting(channel, topology)
            short = short_retention(channel, topology)
            reserved = reserved_handles(topology, stamp.version_of(
                getattr(channel.connection._impl, "server_properties", None)))
            records = read_registry(channel.connection, chain.names)
            upkeep.record_chain(channel.connection, chain.prefix, ChainKey.of(chain),
                                None if records is None else fold(records))
        print(f"declared {len(topology.exchanges)} exchanges, {len(topology.queues)} queues, "
              f"{len(topology.bindings)} bindings with prefix {topology.settings.prefix!r} "
              f"(chain {chain.generation}, {chain.max_level} levels)"
              + ("" if vhost is None else f" in virtual host {vhost!r}"), flush=True)
        for note in (short, reserved):
            if note is not None:
                print(f"note: {note}", flush=True)
    return 0
