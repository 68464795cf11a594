"""`delay-gateway declare`: the topology declared on the broker (in each of --vhosts), idempotently."""

from typing import Optional, Tuple

from topology import build
from topology.model import Topology
from topology.broker.declare import short_retention
from topology.broker.inventory import read_registry
from topology.registry import ChainKey, fold

from gateway.broker.run import index_streams, stamp, upkeep
from gateway.broker.plumbing.amqp import blocking_channel
from gateway.settings import Settings
from gateway.urls import per_vhost


def reservations(topology: Topology, version: Optional[Tuple[int, int]]) -> Optional[str]:
    """RabbitMQ 3.x reserves file handles for each quorum queue, and a node whose reservations
    fill its open-files limit answers no one: what this prefix reserves, said where that
    bookkeeping exists (4.x has none; None). AMQP shows neither the limit nor what is
    reserved, so the line says what to compare with."""
    if version is None or version[0] != 3:
        return None
    quorum = sum(1 for q in topology.queues if q.arguments.get("x-queue-type") == "quorum")
    return (f"RabbitMQ {version[0]}.{version[1]} reserves file handles for quorum queues: this prefix's {quorum} "
            f"reserve {3 * quorum} on one node, up to {5 * quorum} on a node of three that leads them all, "
            "against its open-files limit less 97; a node whose reservations fill it stops answering. Compare "
            "with `rabbitmqctl status`, File Descriptors (docs/operating.md: What a prefix costs the broker)")


def main(settings: Settings) -> int:
    chain = settings.chain
    topology = build(chain, settings.cancel_window_ms)
    # --vhosts: the same topology in each, one line each (unset: the URL's own, said as before)
    for vhost, where in per_vhost(settings.urls, settings.vhosts):
        with blocking_channel(where, tls=settings.tls) as channel:
            index_streams.declare_noting(channel, topology)
            short = short_retention(channel, topology)
            reserved = reservations(topology, stamp.version_of(
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
