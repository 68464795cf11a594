"""Retiring chains no gateway uses any more, without losing or delaying a message (pure).

A chain is retired once no gateway running with it has been connected for a grace period
(the consumer count of its `gateways.NN` queue, observed by whoever retires). Only then can
nothing new enter its queues: every gateway publishes into its own chain only, and
messages already in an old chain keep dead-lettering down its levels into the shared
distributor, or from its meditation queue into the shared returning queue, where check-in
plans them again into a chain that is in use.

Queues are deleted only when they are empty *by construction*, never on a count alone: a
quorum queue cannot be deleted "if empty" (RabbitMQ answers 540 NOT_IMPLEMENTED and closes
the connection), and its count of ready messages leaves out an expired message the broker
is still dead-lettering. So retiring starts with a seal, a record of when each queue will
be empty: for a level k, when a message that is now at the top of the retired levels has
passed level k (2^top - 2^k units); for a meditation queue, its TTL; plus a margin for the
broker's own dead-letter latency and for clocks. After that time, and if the queue still
reports no ready message, it is deleted. A gateway with the chain's settings that appears
meanwhile records the chain as declared again, which voids the seal (registry.py).

Order matters, because each level dead-letters into the exchange of the level below:
levels go top-down, and a level's exchange is deleted only after the level above it is
gone; each deletion is guarded by a fresh look at the gateways queues (`guard`), and the
executor stops a sequence at its first step that cannot be done. Levels that a chain still
in use needs (a lower max_level of the same generation) are never touched.
"""

from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Mapping, Optional, Set, Tuple, Union

from topology.model import PASS_THROUGH_TTL_MS
from topology.names import Names
from topology.registry import ChainKey, Registry, level_queues
from topology.settings import MAX_LEVELS


@dataclass(frozen=True)
class Count:
    messages: int  # ready messages (what queue.declare-ok says)
    consumers: int


@dataclass(frozen=True)
class Observed:
    """What passive declares found. A name not in the map was not looked at, or the look
    failed: it counts as present and blocks anything that depends on it."""

    queues: Mapping[str, Optional[Count]] = field(default_factory=dict)  # None: does not exist
    exchanges: Mapping[str, bool] = field(default_factory=dict)

    def queue_gone(self, name: str) -> bool:
        return name in self.queues and self.queues[name] is None

    def exchange_gone(self, name: str) -> bool:
        return self.exchanges.get(name) is False

    def level_exists(self, names: Names, key: ChainKey, k: int) -> bool:
        return not (self.exchange_gone(names.level(k))
                    and all(self.queue_gone(q) for q in level_queues(key, names, k)))

    def level_seen(self, names: Names, key: ChainKey, k: int) -> bool:
        """Whether a look found an object of level k."""
        return bool(self.exchanges.get(names.level(k))) or any(
            self.queues.get(q) is not None for q in level_queues(key, names, k))

    def gateways(self, names: Names, max_level: int) -> Optional[int]:
        """How many gateways run this chain: 0 if its gateways queue is gone, None if unknown."""
        name = names.gateways(max_level)
        if name not in self.queues:
            return None
        count = self.queues[name]
        return 0 if count is None else count.consumers


# -- steps ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class SealQueues:
    """Append a `sealed` record: each queue is empty by this time (epoch ms)."""

    empty_by: Mapping[str, int]


@dataclass(frozen=True)
class DeleteExchange:
    name: str
    guard: Tuple[str, ...]  # gateways queues that must have no consumer right before


@dataclass(frozen=True)
class DeleteQueue:
    name: str
    guard: Tuple[str, ...]
    classic: bool  # classic queues can be deleted "if empty"; quorum and stream queues cannot
    reseal_ms: int  # found not empty: it is sealed again for this long (its TTL and the margin)


@dataclass(frozen=True)
class MarkRetired:
    chain: ChainKey


Step = Union[SealQueues, DeleteExchange, DeleteQueue, MarkRetired]


# -- who still uses a chain ------------------------------------------------------------------
class Unused:
    """Since when each chain has had no gateway connected, as seen by this process. A
    gateway that is reconnecting is not connected either: the grace covers that."""

    def __init__(self) -> None:
        self.since: Dict[ChainKey, int] = {}

    def update(self, gateways: Mapping[ChainKey, Optional[int]], now_ms: int) -> None:
        for key, count in gateways.items():
            if count == 0:
                self.since.setdefault(key, now_ms)
            else:  # in use, or unknown: the grace starts over
                self.since.pop(key, None)
        for key in set(self.since) - set(gateways):
            del self.since[key]

    def retiring(self, now_ms: int, grace_ms: int) -> Set[ChainKey]:
        return {k for k, t in self.since.items() if now_ms - t >= grace_ms}


# -- the plan --------------------------------------------------------------------------------
def top_level(observed: Observed, names: Names, key: ChainKey) -> int:
    """One above the highest level of the generation that (may) exist."""
    top = 0
    for k in range(MAX_LEVELS):
        if observed.level_exists(names, key, k):
            top = k + 1
    return top


def plan(prefix: str, registry: Registry, chains: Iterable[ChainKey], keep: Set[ChainKey],
         observed: Observed, now_ms: int, margin_ms: int) -> List[List[Step]]:
    """What to do now to retire every chain in `chains` that is not in `keep`: sequences of
    steps, each to be executed in order until one cannot be done."""
    by_generation: Dict[str, List[ChainKey]] = {}
    for key in chains:
        by_generation.setdefault(key.generation, []).append(key)
    out: List[List[Step]] = []
    for gen, keys in sorted(by_generation.items()):
        retiring = sorted(k for k in keys if k not in keep)
        if retiring:
            out += _plan_generation(Names(prefix, gen), registry, keys, retiring, observed, now_ms, margin_ms)
    return [s for s in out if s]


def _plan_generation(names: Names, registry: Registry, keys: List[ChainKey], retiring: List[ChainKey],
                     observed: Observed, now_ms: int, margin_ms: int) -> List[List[Step]]:
    any_key = keys[0]
    unit = any_key.resolution_ms
    kept_levels = max((k.max_level for k in keys if k not in retiring), default=0)
    top = max(top_level(observed, names, any_key), kept_levels)

    def users(level: int) -> List[ChainKey]:
        return [k for k in keys if k.max_level > level]

    def guard(chains: Iterable[ChainKey]) -> Tuple[str, ...]:
        return tuple(names.gateways(k.max_level) for k in chains)

    def drain_ms(level: int) -> int:
        # A message at the top of the retired levels has passed level `level` after this.
        return ((1 << top) - (1 << level)) * unit + (top - level) * PASS_THROUGH_TTL_MS

    sequences: List[List[Step]] = []
    to_seal: Dict[str, int] = {}
    for k in range(kept_levels, top):
        for q in level_queues(any_key, names, k):
            if not observed.queue_gone(q) and registry.seal(q, users(k)) is None:
                to_seal[q] = now_ms + drain_ms(k) + margin_ms
    for key in retiring:
        q = names.meditation(key.max_level)
        if not observed.queue_gone(q) and registry.seal(q, [key]) is None:
            to_seal[q] = now_ms + key.settings(names.prefix).meditation_ms + margin_ms
    if to_seal:
        sequences.append([SealQueues(to_seal)])

    def deletable(queues: List[str], chains: List[ChainKey]) -> bool:
        for q in queues:
            if q not in observed.queues:
                return False  # unknown
            empty_by = registry.seal(q, chains)
            if empty_by is None or now_ms < empty_by:
                return False
        return True

    levels: List[Step] = []
    for k in range(top - 1, kept_levels - 1, -1):
        queues = [q for q in level_queues(any_key, names, k) if not observed.queue_gone(q)]
        exchange = names.level(k)
        if exchange not in observed.exchanges or not deletable(queues, users(k)):
            break
        g = guard(users(k))
        if not observed.exchange_gone(exchange):
            levels.append(DeleteExchange(exchange, g))
        ttl = (1 << k) * unit
        for q in queues:
            levels.append(DeleteQueue(q, g, any_key.queue_type == "classic",
                                      (ttl if q == names.delay_queue(k) else PASS_THROUGH_TTL_MS) + margin_ms))
    sequences.append(levels)

    for key in retiring:
        q = x = names.meditation(key.max_level)  # the exchange and its queue share the name
        gone_q, gone_x = observed.queue_gone(q), observed.exchange_gone(x)
        if gone_q and gone_x:
            continue
        if x not in observed.exchanges or not (gone_q or deletable([q], [key])):
            continue
        g = guard([key])
        steps: List[Step] = [] if gone_x else [DeleteExchange(x, g)]
        if not gone_q:
            steps.append(DeleteQueue(q, g, key.queue_type == "classic",
                                     key.settings(names.prefix).meditation_ms + margin_ms))
        sequences.append(steps)

    return sequences + _mark_retired(names, registry, retiring, observed, kept_levels)


def _mark_retired(names: Names, registry: Registry, retiring: List[ChainKey], observed: Observed,
                  kept_levels: int) -> List[List[Step]]:
    """A chain whose own queues and exchanges are all gone: its presence queue, then retired."""
    sequences: List[List[Step]] = []
    for key in retiring:
        exclusive_levels = range(kept_levels, key.max_level)
        done = (observed.queue_gone(names.meditation(key.max_level))
                and observed.exchange_gone(names.meditation(key.max_level))
                and all(not observed.level_exists(names, key, k) for k in exclusive_levels))
        if not done:
            continue
        steps: List[Step] = []
        presence = names.gateways(key.max_level)
        if not observed.queue_gone(presence):
            steps.append(DeleteQueue(presence, (presence,), False, 0))
        if registry.state.get(key) != "retired":
            steps.append(MarkRetired(key))
        sequences.append(steps)
    return sequences
