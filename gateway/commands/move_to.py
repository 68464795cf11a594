"""`delay-gateway move --to URL`: every message that waits under the prefix, moved to another
cluster's gateway with its due time, routing key, properties and body exactly (the blue-green
upgrade of docs/upgrading.md: a new cluster, and the old one switched off the same day).

The old cluster's queues are read one at a time, what falls due soonest first (the
distributor exits, what is back from meditation or not read yet, the levels from the lowest
up, meditation; parked ones with --parked), in passes until one finds nothing left: messages
that move on inside the old chain meanwhile (a TTL runs out) are taken on the next pass. Each
batch (--batch messages, or one carrier: core/moving.py makes its publishes) is published to
the new cluster with publisher confirms, its entries written to the new cluster's index and
done keys to the old one's, and only then acknowledged (removed) on the old cluster. So an
interruption at any moment loses nothing, and run again the command goes on; duplicates come
from one batch at most, each with its message id. A message is never early (it keeps its due
time); one due while it moves is delivered by whichever side holds it then, once.

Cancels are carried first: the cancels by id of the cancel window and the live rules of the
old cluster's cancellations stream, with their own times, to the new one's (they keep
cancelling what they cancelled, and nothing published later). A message they hold is not
moved. They are read again at every pass, so one recorded on the old cluster during the move
is carried too.
"""

import argparse
import json
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import pika
from pika.exceptions import AMQPError, ChannelClosedByBroker

from topology import ChainSettings, build
from topology.broker.inventory import read_registry
from topology.index_bands import bands
from topology.registry import ChainKey

from gateway.broker.plumbing import lazy_properties
from gateway.broker.plumbing.amqp import BrokerError, connect
from gateway.broker.run.cancelling import Judge
from gateway.broker.tools import cancellations
from gateway.broker.tools.confirmed import Confirmed
from gateway.broker.tools.window import PublishError
from gateway.clock import wall_ms
from gateway.core import carrier, cancels, envelope, rules, writers
from gateway.core.inputs import Delivery
from gateway.core.moving import ORDER, SOURCES, Moved, Mover, Source, done_of, index_of
from gateway.core.wire import Properties
from gateway.exits import EXIT_NO_BROKER, EXIT_REFUSED
from gateway.metrics import Metrics
from gateway.settings import Settings, UsageError, argument, integer
from gateway.urls import redact, user_of, vhost_of, with_vhost

NAME = "delay-gateway move"
IDLE_S = 0.05  # a batch not full goes once nothing more came for this long
PREFETCH = 500  # deliveries the old cluster sends ahead (each a carrier of many, or one message)
MAX_PASSES = 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--to", required=True, metavar="URL",
                   help="the new cluster (an AMQP URL; log in as the user its gateways run as, whose cancels and "
                        "index they trust)")
    p.add_argument("--to-prefix", metavar="PREFIX", help="the new cluster's prefix (default: --prefix)")
    p.add_argument("--to-vhost", metavar="VHOST", help="the new cluster's virtual host (default: the --to URL's)")
    p.add_argument("--parked", action="store_true", help="move the parked messages too (default: they stay)")
    p.add_argument("--batch", type=argument(integer(1, 100_000)), default=1000, metavar="N",
                   help="messages moved per step, and the most that can be duplicated if the command is "
                        "interrupted (a carrier of more moves whole; default 1000)")
    p.add_argument("--dry-run", action="store_true", help="count what waits where; change nothing")
    p.add_argument("--json", action="store_true", help="print the outcome as JSON")


@dataclass(frozen=True)
class Options:
    """move's own arguments (add_arguments above), typed."""

    to: str
    to_prefix: Optional[str]
    to_vhost: Optional[str]
    parked: bool
    batch: int
    dry_run: bool
    json: bool


@dataclass(frozen=True)
class Place:
    """A queue of the old cluster where messages wait."""

    queue: str
    source: Source
    rank: Tuple[int, int]  # the order it is read in (moving.ORDER, then its level)


@dataclass
class Outcome:
    moved: int = 0  # messages (not carriers)
    cancelled: int = 0  # held by a cancel or rule: not moved
    as_sent: int = 0  # of `moved`: from check-in or retry as sent, or parked
    cancels_carried: int = 0
    rules_carried: int = 0
    passes: int = 0
    seconds: float = 0.0
    left: Dict[str, int] = field(default_factory=dict)  # queue -> ready messages at the end


def main(settings: Settings, **own: Any) -> int:
    """`delay-gateway move`: `own` is its options."""
    args = Options(**own)
    source = settings.chain
    target = replace(source, prefix=args.to_prefix or source.prefix)
    to_url = with_vhost(args.to, args.to_vhost) if args.to_vhost is not None else args.to
    urls = settings.one_vhost_urls
    same = vhost_of(to_url) == vhost_of(urls[0]) and target.prefix == source.prefix
    if same and same_host(to_url, urls[0]):
        raise UsageError(ONTO_ITSELF)
    try:
        old, _ = connect(urls, NAME, settings.tls)
        new, _ = connect([to_url], NAME, settings.tls)
    except BrokerError as exc:
        print(f"{NAME}: {exc}", file=sys.stderr)
        return exc.exit_code
    try:
        if same and cluster_of(old) == cluster_of(new):  # (another name for the same broker)
            raise UsageError(ONTO_ITSELF)
        places = where_messages_wait(old, source, args.parked)
        if args.dry_run:
            return show_count(old, places, args.json)
        missing = missing_topology(new, target)
        if missing:
            print(f"{NAME}: the new cluster has no {missing} (prefix {target.prefix!r}, vhost {vhost_of(to_url)!r}): "
                  f"run `delay-gateway declare --prefix {target.prefix}` there, with the settings its gateways run "
                  "with, first", file=sys.stderr)
            return EXIT_REFUSED
        outcome = Move(old, new, source, target, settings, args, user_of(urls[0]), user_of(to_url)).run(places)
    except (AMQPError, PublishError) as exc:
        why = str(exc) if isinstance(exc, PublishError) else f"lost a connection ({exc!r})"
        print(f"{NAME}: {why}; what the new cluster did not confirm stays in the old one: run again (a batch it "
              "took just before is then moved twice: duplicates)", file=sys.stderr)
        return EXIT_NO_BROKER
    except KeyboardInterrupt:
        print(f"{NAME}: interrupted; what was not moved stays in the old cluster: run again", file=sys.stderr)
        return 130
    finally:
        for c in (old, new):
            if c.is_open:
                c.close()
    show(outcome, to_url, target, args.json)
    return 0


ONTO_ITSELF = ("--to names the cluster, virtual host and prefix the messages are moved from: give the new "
               "cluster's URL (or another --to-prefix or --to-vhost)")


def cluster_of(connection: Any) -> Optional[str]:
    """The broker's cluster name, as it introduced itself."""
    found = getattr(connection._impl, "server_properties", None) or {}
    name = found.get("cluster_name")
    return name.decode("utf-8", "replace") if isinstance(name, bytes) else name


def same_host(a: str, b: str) -> bool:
    pa, pb = pika.URLParameters(a), pika.URLParameters(b)
    return (pa.host, pa.port) == (pb.host, pb.port)


def where_messages_wait(connection: Any, chain: ChainSettings, parked: bool) -> List[Place]:
    """Every queue of every chain under the prefix (the registry's and this one) that holds
    messages for a gateway, in the order they are read."""
    records = read_registry(connection, chain.names) or []
    keys = {r.chain for r in records if r.chain is not None} | {ChainKey.of(chain)}
    found: Dict[str, Place] = {}
    for key in sorted(keys):
        for q in build(key.settings(chain.prefix)).queues:
            source = SOURCES.get(q.role)
            if source is None or (source is Source.PARKED and not parked) or q.name in found:
                continue
            found[q.name] = Place(q.name, source, (ORDER[q.role], q.level if q.level is not None else 0))
    present = [p for p in found.values() if ready(connection, p.queue) is not None]
    return sorted(present, key=lambda p: (p.rank, p.queue))


def ready(connection: Any, queue: str) -> Optional[int]:
    """A queue's ready messages (a passive declare); None: it does not exist."""
    channel = connection.channel()
    try:
        return int(channel.queue_declare(queue, passive=True).method.message_count)
    except ChannelClosedByBroker as exc:
        if exc.reply_code == 404:
            return None
        raise
    finally:
        if channel.is_open:
            channel.close()


def missing_topology(connection: Any, chain: ChainSettings) -> Optional[str]:
    """The first exchange the move publishes to that the new cluster lacks (None: all there)."""
    n = chain.names
    for name in [n.check_in, n.cancel, n.rules, n.retry, n.parked, n.distributor, chain.meditation,
                 n.cancellations, n.waiting] + [n.level(k) for k in range(chain.max_level)]:
        channel = connection.channel()
        try:
            channel.exchange_declare(name, passive=True)
        except ChannelClosedByBroker as exc:
            if exc.reply_code == 404:
                return f"exchange {name!r}"
            raise
        finally:
            if channel.is_open:
                channel.close()
    return None


class Move:
    """One run of the command: carries the cancels, then drains the old cluster pass by pass."""

    def __init__(self, old: Any, new: Any, source: ChainSettings, target: ChainSettings, settings: Settings,
                 args: Options, old_user: str, new_user: str) -> None:
        self.old, self.new, self.source, self.target, self.args = old, new, source, target, args
        self.old_user, self.new_user = old_user, new_user  # (what each connection signs with)
        self.trusted = settings.trusted_user  # whose records on the old cluster count
        self.window_ms = settings.cancel_window_ms
        self.judge = Judge(cancels.Store(self.window_ms), rules.Rules(self.window_ms), Metrics(), {})
        self.mover = Mover(source.names, target, settings.lead_ms, settings.carrier_messages, settings.carrier_bytes,
                           lambda e: self.judge(e, "move"))
        self.carried: Set[Tuple[str, bytes, int]] = set()  # (kind, id or name, read time) already carried
        self.out, self.done = Confirmed(new), Confirmed(old)
        self.outcome = Outcome()
        self.start = time.monotonic()

    def run(self, places: Sequence[Place]) -> Outcome:
        while self.outcome.passes < MAX_PASSES:
            self.outcome.passes += 1
            self.carry_cancels()
            before = self.outcome.moved + self.outcome.cancelled
            for place in places:
                self.drain(place)
            if self.outcome.moved + self.outcome.cancelled == before:
                break
        self.outcome.seconds = time.monotonic() - self.start
        self.outcome.left = {p.queue: n for p in places if (n := ready(self.old, p.queue))}
        return self.outcome

    def carry_cancels(self) -> None:
        """The old cluster's cancels by id (of the window) and live rules, with their own
        times, appended to the new cluster's cancellations stream (those not carried yet), and
        held to judge what moves."""
        recorded = cancellations.read(self.old, self.source.names, self.window_ms, self.trusted)
        now = wall_ms()
        self.judge.store, self.judge.rules = recorded.store(self.window_ms, now), recorded.rules
        publishes: List[Tuple[Properties, bytes]] = []
        for message_id, at in recorded.ids:
            if ("id", message_id, at.read_us) not in self.carried:
                self.carried.add(("id", message_id, at.read_us))
                publishes.append((cancels.record(message_id, at), b""))
                self.outcome.cancels_carried += 1
        for rule in recorded.rules.live:
            if ("rule", rule.name, rule.at.read_us) not in self.carried:
                self.carried.add(("rule", rule.name, rule.at.read_us))
                publishes.append(rules.record(rule))
                self.outcome.rules_carried += 1
        self.out.publish([(self.target.names.cancellations, b"", writers.signed(props, self.new_user), body)
                          for props, body in publishes])
        self.out.wait()

    def drain(self, place: Place) -> None:
        """Batch by batch until the queue reports nothing ready and nothing is left to take."""
        if not ready(self.old, place.queue):
            return
        channel = self.old.channel()
        channel.basic_qos(prefetch_count=PREFETCH)
        taken: List[Tuple[int, Delivery, int]] = []  # (delivery tag, delivery, messages in it)

        def on_message(_channel: Any, method: Any, properties: Any, body: bytes) -> None:
            d = Delivery(method.exchange, envelope.as_bytes(method.routing_key), lazy_properties.to_wire(properties),
                         body)
            taken.append((method.delivery_tag, d, messages_in(d)))

        tag = channel.basic_consume(place.queue, on_message)
        try:
            while True:
                quiet_since = time.monotonic()
                while (count := messages_up_to(taken, self.args.batch)) == len(taken) < PREFETCH:
                    seen = len(taken)
                    self.old.process_data_events(time_limit=0.01)
                    if len(taken) > seen:
                        quiet_since = time.monotonic()
                    elif time.monotonic() - quiet_since > (IDLE_S if taken else 0):
                        break
                if not taken:
                    # Done for this pass when it reports none ready (what the broker sent and
                    # nobody read yet goes back as the channel closes: the next pass's)
                    if not ready(self.old, place.queue):
                        return
                    continue
                # (pika hands over every delivery it has read at once: the batch is the first of them)
                self.step(channel, place, taken[:count])
                del taken[:count]
        finally:
            if channel.is_open:
                channel.basic_cancel(tag)
                channel.close()

    def step(self, channel: Any, place: Place, taken: List[Tuple[int, Delivery, int]]) -> None:
        """One batch: published to the new cluster and confirmed, written down on both, removed
        from the old."""
        moved: Moved = self.mover.take([(place.source, d) for _, d, _ in taken], wall_ms())
        index = index_of(moved.entries, bands(self.target), wall_ms())
        self.out.publish(moved.publishes + [(self.target.names.waiting, key.encode(), self.signed(self.new_user),
                                             record) for key, record in index.items()])
        self.out.wait()
        gone = done_of(moved.entries + moved.cancelled)
        if gone is not None:
            self.done.publish([(self.source.names.waiting, b"done", self.signed(self.old_user), gone)])
            self.done.wait()
        channel.basic_ack(taken[-1][0], multiple=True)
        self.outcome.moved += moved.messages
        self.outcome.as_sent += moved.as_sent
        self.outcome.cancelled += len(moved.cancelled)
        elapsed = time.monotonic() - self.start
        print(f"move: pass {self.outcome.passes}, {place.queue}: moved {self.outcome.moved:,} "
              f"({self.outcome.moved / elapsed:,.0f}/s), "
              f"{self.outcome.cancelled:,} cancelled left out", file=sys.stderr, flush=True)

    @staticmethod
    def signed(user: str) -> Properties:
        return writers.signed(Properties.build(delivery_mode=2), user)


def messages_in(d: Delivery) -> int:
    """A carrier counts its own."""
    count = d.props.headers.get(carrier.COUNT)
    return count if isinstance(count, int) and count > 0 else 1


def messages_up_to(taken: Sequence[Tuple[int, Delivery, int]], batch: int) -> int:
    """How many of the deliveries taken (from the first) make a batch: until they hold `batch`
    messages; all of them if they hold fewer."""
    messages = 0
    for n, (_, _, count) in enumerate(taken):
        messages += count
        if messages >= batch:
            return n + 1
    return len(taken)


def show_count(connection: Any, places: Sequence[Place], as_json: bool) -> int:
    counts = {p.queue: ready(connection, p.queue) or 0 for p in places}
    if as_json:
        print(json.dumps({"deliveries_by_queue": counts, "deliveries": sum(counts.values())}))
        return 0
    for queue, n in counts.items():
        if n:
            print(f"  {queue:<60} {n:>10,}")
    print(f"{sum(counts.values()):,} deliveries wait in {len(places)} queue(s) (a carrier holds many messages: "
          "`delay-gateway pending count` counts messages); nothing changed (--dry-run)")
    return 0


def show(o: Outcome, to_url: str, target: ChainSettings, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"moved": o.moved, "as_sent": o.as_sent, "cancelled_left_out": o.cancelled,
                          "cancels_carried": o.cancels_carried, "rules_carried": o.rules_carried,
                          "passes": o.passes, "seconds": round(o.seconds, 3),
                          "per_second": round(o.moved / o.seconds) if o.seconds else None, "left": o.left}))
        return
    rate = f" ({o.moved / o.seconds:,.0f}/s)" if o.seconds else ""
    print(f"moved {o.moved:,} message(s) to {redact(to_url)} (prefix {target.prefix!r}) in {o.seconds:.1f} s{rate}, "
          f"{o.passes} pass(es); {o.cancelled:,} cancelled left out; carried {o.cancels_carried:,} cancel(s) by id "
          f"and {o.rules_carried:,} rule(s)")
    if o.left:
        print("still waiting in the old cluster (published or moved on there during the move: run again): "
              + ", ".join(f"{q} {n:,}" for q, n in o.left.items()))
    else:
        print("the old cluster's queues under the prefix are empty")
