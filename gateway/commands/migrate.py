"""`delay-gateway migrate`: chains of other settings retired once unused and empty, as JSON events."""

import argparse
import json
from typing import Callable

from topology.broker.inventory import read_registry
from topology.registry import ChainKey, fold
from topology.retirement import DeleteExchange, DeleteQueue, MarkRetired, SealQueues, Unused

from gateway.broker.run import upkeep
from gateway.broker.plumbing.amqp import blocking_channel
from gateway.clock import wall_ms
from gateway.commands.status.reads import read_report
from gateway.commands.status.report import Report
from gateway.settings import Settings, UsageError
from gateway.times import plain_utc


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--wait", action="store_true",
                   help="keep going until every other chain is retired (queues are deleted as their time comes)")
    p.add_argument("--dry-run", action="store_true", help="say what would be done, change nothing")


def main(settings: Settings, wait: bool, dry_run: bool) -> int:
    chain = settings.chain
    own = ChainKey.of(chain)
    margin_ms = int(settings.retire_after * 1000)
    unused = Unused()

    def report(event: str, **fields) -> None:
        print(json.dumps({"event": event, **fields}, default=str), flush=True)

    with blocking_channel(settings.one_vhost_urls, "delay-gateway migrate",
                          settings.tls) as channel:
        connection = channel.connection
        while True:
            records = read_registry(connection, chain.names)
            if records is None:
                raise UsageError(f"no chain registry {chain.names.registry!r} under prefix {chain.prefix!r}: "
                                 "run `delay-gateway declare` with this version first")
            if dry_run:
                sequences = upkeep.plan_once(connection, chain.prefix, own, unused, 0, margin_ms, wall_ms,
                                             fold(records), report)
                steps = [step for steps in sequences for step in steps]
                for step in steps:
                    report("would_" + _step_event(step), **_step_fields(step))
                others = _remaining(report, read_report(connection, settings, own, wall_ms()))
                report("dry_run", chain=own.describe(), steps=len(steps), other_chains=len(others),
                       summary=_dry_run_summary(own, len(steps), others))
                return 0
            upkeep.retire_once(connection, chain.prefix, own, unused, 0, margin_ms, report,
                               registry=fold(records))
            others = _remaining(report, read_report(connection, settings, own, wall_ms()))
            if not wait or not others:
                if not others:
                    report("migrated", chain=own.describe())
                return 0
            connection.sleep(upkeep.tick_s(settings.retire_after))


def _remaining(report: Callable[..., None], r: Report) -> list:
    """Report the chains other than the one of these settings; returns them."""
    others = [c for c in r.chains if not c.yours]
    for c in others:
        report("chain_remaining", chain=c.key.describe(), gateways=c.gateways,
               empty_by=None if c.empty_by_ms is None else plain_utc(c.empty_by_ms))
    return others


def _dry_run_summary(own: ChainKey, steps: int, others: list) -> str:
    if not others:
        return f"nothing to do: the chain of these settings ({own.describe()}) is the only one; nothing changed"
    used = sum(1 for c in others if c.gateways)
    return (f"{steps} step(s) would be taken now; {len(others)} other chain(s), {used} in use by gateways (kept "
            "until unused for --retire-after); nothing changed (--dry-run)")


def _step_event(step) -> str:
    return {SealQueues: "seal", DeleteExchange: "delete_exchange", DeleteQueue: "delete_queue",
            MarkRetired: "mark_retired"}[type(step)]


def _step_fields(step) -> dict:
    if isinstance(step, SealQueues):
        return {"queues": dict(step.empty_by)}
    if isinstance(step, MarkRetired):
        return {"chain": step.chain.describe()}
    return {"name": step.name}
