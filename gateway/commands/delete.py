"""`delay-gateway delete --yes`: every chain of the topology under the prefix deleted, with what it holds."""

import argparse

from topology import build
from topology.broker.declare import delete
from topology.broker.inventory import read_registry
from topology.registry import ChainKey

from gateway.broker.plumbing.amqp import blocking_channel
from gateway.settings import Settings, UsageError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--yes", action="store_true", help="really delete")


def main(settings: Settings, yes: bool) -> int:
    if not yes:
        raise UsageError("delete removes every queue of the topology and the messages in them; add --yes")
    chain = settings.chain
    with blocking_channel(settings.one_vhost_urls, tls=settings.tls) as channel:
        # Every chain the registry knows of under the prefix, then the fixed objects and
        # the registry itself (with the chain of the given settings).
        records = read_registry(channel.connection, chain.names) or []
        others = {r.chain for r in records if r.chain is not None} - {ChainKey.of(chain)}
        for key in sorted(others):
            delete(channel, build(key.settings(chain.prefix)))
        delete(channel, build(chain))
    print(f"deleted the topology with prefix {chain.prefix!r} ({len(others) + 1} chain(s))")
    return 0
