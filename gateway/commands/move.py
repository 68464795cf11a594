"""`delay-gateway move-from-plugin`: the delayed-message plugin's waiting messages, moved into
the gateway with their due times, so a broker can be upgraded without waiting for the
plugin to drain (docs/migrating-from-the-plugin.md, "Move instead of drain").

Batch by batch, in due order: read entries from the plugin's tables (`rabbitmqctl eval`,
plugin_table.py), publish each to `<prefix>.distributor` in the gateway's own format (its due
time, routing key, properties and body exactly as the plugin holds them), with publisher
confirms, and only once every publish of the batch is confirmed remove those entries from
the plugin's table. So an interruption at any moment loses nothing; run again, it moves
what is still there. Duplicates come from one window only: a batch confirmed but not yet
removed when the command stopped (at most --batch messages, each with its message id).

Entries due within --leave-due-within-ms are left for the plugin to deliver itself: moving
them would race its timer (a message delivered by both).

Each moved message carries a read time as check-in gives one (what the index of what waits,
a handle and every cancel judge it by): when it was published to the plugin, its due time
less its `x-delay` (the plugin's own sum), so a cancel or rule recorded before that publish
does not cancel it and one recorded after does (cancels.after). Where that cannot be known
(no integer `x-delay`), a negative one, the move's own, strictly increasing, negated: before
every cancel.

Like a gateway that sends a message on to wait, the move writes each one's entry into the
index of what waits, once the batch is confirmed and before it is removed from the plugin:
`pending` lists the moved messages from then on. (An interruption between the two leaves the
batch in the plugin's table: moved again, with its entries, on the next run.)
"""

import argparse
import json
import shlex
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import pika
from pika.exceptions import ChannelClosedByBroker

from topology import ChainSettings

from gateway.exits import EXIT_NO_BROKER, EXIT_REFUSED
from gateway.broker.plumbing.amqp import blocking_channel
from gateway.broker.tools.plugin_table import REFS_PER_REMOVE, PluginMessage, PluginError, PluginTables, Probe, Waiting
from gateway.broker.tools.window import Outgoing, PublishError, WindowPublisher
from gateway.clock import wall_ms
from gateway.core import cancels, envelope, index_records, writers
from gateway.core.carrier import Entry
from gateway.core.wire import Properties
from topology.index_bands import bands
from gateway.settings import Settings, Tls, argument, integer
from gateway.urls import user_of
from gateway.times import exact_duration

MINUTE, HOUR, DAY = 60_000, 3_600_000, 86_400_000
# Upper ends of the due-time ranges --dry-run counts, after the one left to the plugin.
RANGES = ((MINUTE, "1 min"), (HOUR, "1 h"), (DAY, "1 day"), (7 * DAY, "7 days"), (30 * DAY, "30 days"),
          (None, "later"))


@dataclass
class Count:
    """What the plugin holds, as this command sees it."""

    ranges: Dict[str, int] = field(default_factory=dict)  # movable, by due time
    left: int = 0  # due within the margin: the plugin's to deliver
    elsewhere: int = 0  # other vhosts or exchanges than those asked for

    @property
    def movable(self) -> int:
        return sum(self.ranges.values())


def ranges(leave_ms: int) -> List[Tuple[str, Optional[int]]]:
    """(label, upper end in ms from now) of each due-time range after the one left to the plugin."""
    out: List[Tuple[str, Optional[int]]] = []
    lower = leave_ms
    for upper, name in RANGES:
        if upper is None:
            out.append((f"{exact_duration(lower)} or later", None))
        elif upper > leave_ms:
            out.append((f"from {exact_duration(lower)} to {name}", upper))
            lower = upper
    return out


def count(waiting: Sequence[Waiting], now_ms: int, leave_ms: int, vhost: str, exchanges: Sequence[str]) -> Count:
    """The plugin's keys sorted into ranges of time left (pure: what --dry-run prints)."""
    c = Count()
    bounds = ranges(leave_ms)
    c.ranges = {name: 0 for name, _ in bounds}
    for w in waiting:
        if w.vhost != vhost or (exchanges and w.exchange not in exchanges):
            c.elsewhere += w.count
        elif w.due_ms - now_ms < leave_ms:
            c.left += w.count
        else:
            name = next(name for name, upper in bounds if upper is None or w.due_ms - now_ms < upper)
            c.ranges[name] += w.count
    return c


def held_as_gateway(entries: Sequence[PluginMessage], read: cancels.Sequencer, now_ms: int) -> List[Entry]:
    """Each of the plugin's messages as the gateway holds one: its due time, routing key and
    the publisher's properties as the plugin holds them (but `user_id`, which the broker
    checks against the gateway's own login, and any dead-letter history), and its read time:
    when it was published to the plugin, or negative (the module doc)."""
    out = []
    for n, e in enumerate(entries):
        user = envelope.for_pick_up(Properties.parse(e.properties))
        published = published_ms(e.due_ms, user, now_ms)
        read_us = -read(now_ms) if published is None else published * 1000 + n % 1000
        out.append(Entry(e.routing_key, user, e.body, e.due_ms, read_us))
    return out


def published_ms(due_ms: int, user: Properties, now_ms: int) -> Optional[int]:
    """When the plugin took a message in: its due time less its x-delay (an integer, as the
    plugin reads it), on the plugin's node's clock, and not after now; None where it does not
    say."""
    delay = user.headers.get("x-delay")
    if isinstance(delay, int) and not isinstance(delay, bool) and 0 <= delay <= due_ms:
        return min(due_ms - delay, now_ms)
    return None


def outgoing(entries: Sequence[Entry], distributor: str) -> Iterator[Outgoing]:
    """Each one in the gateway's format, for the distributor."""
    for e in entries:
        yield distributor, "", envelope.inside(e.user, e.routing_key, e.due_ms, accepted_us=e.accepted_us), e.body


def index_entries(entries: Sequence[Entry], exchange: str, bands: int, now_ms: int,
                  user: Optional[str] = None) -> Iterator[Outgoing]:
    """Their entries in the index of what waits (index_records.by_band), signed by the user
    the move logs in as (readers trust the gateway user's: writers.py)."""
    for key, record in index_records.by_band(entries, bands, now_ms).items():
        props = Properties.build(delivery_mode=2)
        yield exchange, key, props if user is None else writers.signed(props, user), record


# -- command line ---------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rabbitmqctl", default="rabbitmqctl", metavar="COMMAND",
                   help="the command line that runs rabbitmqctl for a node of the plugin's broker (default "
                        "rabbitmqctl; e.g. 'rabbitmqctl -n rabbit@host' or 'kubectl exec rabbitmq-0 -- "
                        "rabbitmqctl')")
    p.add_argument("--exchange", action="append", default=[], metavar="NAME",
                   help="move only what waits in this plugin exchange (repeatable; default: every one in "
                        "the URL's vhost)")
    p.add_argument("--dry-run", action="store_true", help="count what would move, by due time; change nothing")
    p.add_argument("--batch", type=argument(integer(1, REFS_PER_REMOVE)), default=1000, metavar="N",
                   help="messages moved per step, and the most that can be duplicated if the command is "
                        f"interrupted (1-{REFS_PER_REMOVE}, default 1000)")
    p.add_argument("--leave-due-within-ms", type=argument(integer(1000, 3_600_000)), default=10_000, metavar="MS",
                   help="leave messages due sooner than this to the plugin (default 10000)")
    p.add_argument("--json", action="store_true", help="print the outcome as JSON")


@dataclass(frozen=True)
class Options:
    """move-from-plugin's own arguments (add_arguments above), typed."""

    rabbitmqctl: str
    exchange: List[str]
    dry_run: bool
    batch: int
    leave_due_within_ms: int
    json: bool


def main(settings: Settings, **own: Any) -> int:
    """`delay-gateway move-from-plugin`: `own` is its options."""
    return command(Options(**own), settings.one_vhost_urls, settings.tls, settings.chain)


def command(args: Options, urls: Sequence[str], tls: Tls, chain: ChainSettings) -> int:
    try:
        ctl = shlex.split(args.rabbitmqctl)
    except ValueError as exc:
        print(f"delay-gateway move-from-plugin: error: --rabbitmqctl: {exc}", file=sys.stderr)
        return 2
    vhost = pika.URLParameters(urls[0]).virtual_host
    tables = PluginTables(ctl)
    try:
        probe = tables.probe()
        refusal = refused(probe)
        if refusal:
            print(f"delay-gateway move-from-plugin: {refusal}", file=sys.stderr)
            return EXIT_REFUSED
        before = count(every_key(tables, probe), wall_ms(), args.leave_due_within_ms, vhost, args.exchange)
        if args.dry_run:
            show_count(probe, before, vhost, args.exchange, args.json)
            return 0
        check_topology(urls, tls, chain)
        moved, seconds = move(tables, probe, urls, tls, chain, vhost, args, before.movable)
        after = count(every_key(tables, tables.probe()), wall_ms(), args.leave_due_within_ms, vhost, args.exchange)
    except PluginError as exc:
        print(f"delay-gateway move-from-plugin: {exc}", file=sys.stderr)
        return EXIT_REFUSED if exc.refused else EXIT_NO_BROKER
    except PublishError as exc:
        print(f"delay-gateway move-from-plugin: {exc}; what was not confirmed stays in the plugin's table: run "
              f"again (what the broker took before this is then moved twice: duplicates)", file=sys.stderr)
        return EXIT_NO_BROKER
    outcome = {"moved": moved, "seconds": round(seconds, 3),
               "per_second": round(moved / seconds) if seconds else None,
               "left_to_plugin": after.left, "still_movable": after.movable, "elsewhere": after.elsewhere}
    if args.json:
        print(json.dumps(outcome))
    else:
        rate = f" ({outcome['per_second']:,}/s)" if outcome["per_second"] else ""
        print(f"moved {moved:,} message(s) from the plugin into {chain.names.distributor} in {seconds:.1f} s{rate}; "
              f"the plugin still holds {after.left:,} due within {exact_duration(args.leave_due_within_ms)} "
              f"(it delivers them itself), {after.movable:,} more to move, {after.elsewhere:,} of other vhosts or "
              "exchanges")
    return 0


def refused(probe: Probe) -> Optional[str]:
    if not probe.mnesia_running or probe.metadata_store == "khepri":
        return (f"RabbitMQ on {probe.node} keeps its metadata in Khepri, where the plugin cannot run: there is "
                "nothing of the plugin's to move (its waiting messages were lost when Khepri was enabled)")
    if not probe.tables:
        return (f"no table of the delayed-message plugin in the cluster of {probe.node}: the plugin is not "
                "enabled there (disabling it deletes its waiting messages), or --rabbitmqctl reaches another broker")
    return next(filter(None, (t.problem() for t in probe.tables)), None)


def every_key(tables: PluginTables, probe: Probe) -> list:
    return [w for t in probe.tables for w in tables.keys(t.name)]


def check_topology(urls: Sequence[str], tls: Tls, chain: ChainSettings) -> None:
    """The distributor's exchange must exist: refused (exit 3) before anything moves."""
    with blocking_channel(urls, "delay-gateway move-from-plugin", tls) as channel:
        try:
            channel.exchange_declare(chain.names.distributor, passive=True)
        except ChannelClosedByBroker as exc:
            raise PluginError(f"the gateway's topology is not declared on this broker ({exc.reply_text}): run "
                              "`delay-gateway declare` with the same --prefix first") from None


def move(tables: PluginTables, probe: Probe, urls: Sequence[str], tls: Tls, chain: ChainSettings, vhost: str,
         args: Options, expected: int) -> Tuple[int, float]:
    """Every movable entry, batch by batch; (moved, seconds). Progress on stderr."""
    start, moved = time.monotonic(), 0
    read = cancels.Sequencer()
    for table in probe.tables:
        cursor: Optional[str] = ""
        while cursor is not None:
            batch, cursor = tables.batch(table.name, vhost, args.exchange, wall_ms() + args.leave_due_within_ms,
                                         args.batch, cursor)
            if not batch:
                continue
            gateway_format = held_as_gateway(batch, read, wall_ms())
            WindowPublisher(urls, outgoing(gateway_format, chain.names.distributor),
                            "delay-gateway move-from-plugin", tls,
                            unroutable=f"{chain.names.distributor} routed a message to no queue",
                            unroutable_hint="run `delay-gateway declare` with the same --prefix",
                            queue=chain.names.distributor).run()
            WindowPublisher(urls, index_entries(gateway_format, chain.names.waiting, bands(chain), wall_ms(),
                                                user_of(urls[0])),
                            "delay-gateway move-from-plugin", tls,
                            unroutable=f"{chain.names.waiting} routed an entry of the index to no stream",
                            unroutable_hint="run `delay-gateway declare` with this version and the same --prefix",
                            queue=chain.names.waiting).run()
            tables.remove(table.name, batch)
            moved += len(batch)
            elapsed = time.monotonic() - start
            print(f"move-from-plugin: moved {moved:,} of {max(expected, moved):,} ({moved / elapsed:,.0f}/s)",
                  file=sys.stderr, flush=True)
    return moved, time.monotonic() - start


def show_count(probe: Probe, c: Count, vhost: str, exchanges: Sequence[str], as_json: bool) -> None:
    if as_json:
        print(json.dumps({"would_move": c.movable, "by_due": c.ranges, "left_to_plugin": c.left,
                          "elsewhere": c.elsewhere, "plugin_version": probe.plugin_version,
                          "tables": {t.name: t.size for t in probe.tables}}))
        return
    version = f" {probe.plugin_version}" if probe.plugin_version else ""
    print(f"delayed-message plugin{version}, seen from {probe.node}: "
          + ", ".join(f"{t.name} holds {t.size:,}" for t in probe.tables))
    where = f"vhost {vhost!r}, " + (f"exchange(s) {', '.join(exchanges)}" if exchanges else "every exchange")
    print(f"in {where}, due:")
    for name, n in c.ranges.items():
        print(f"  {name:<24} {n:>10,}")
    print(f"would move {c.movable:,}; {c.left:,} due sooner are left for the plugin to deliver; {c.elsewhere:,} "
          "of other vhosts or exchanges stay; nothing changed (--dry-run)")

