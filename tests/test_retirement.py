"""The chain registry and the retirement plan (pure): tables of situations and the steps
they lead to. tests/test_live_change.py runs the same against a real broker."""

import pytest

from topology.names import Names
from topology.registry import ChainKey, Record, chain_queues, decode, encode, fold, level_queues
from topology.retirement import (Count, DeleteExchange, DeleteQueue, MarkRetired, Observed, SealQueues, Unused,
                                 plan)

P = "p"
NOW = 1_000_000
MARGIN = 1000


def key(max_level=4, resolution_ms=100, queue_type="quorum", zero_bits="queue"):
    return ChainKey(resolution_ms, queue_type, zero_bits, max_level)


def everything(*keys, messages=0, gateways=None, gone=()):
    """Observed: every object of these chains exists (with `messages` ready each), except
    the names in `gone`; `gateways`: consumers per chain's gateways queue."""
    queues, exchanges = {}, {}
    gateways = gateways or {}
    for k in keys:
        n = Names(P, k.generation)
        for q in chain_queues(k, n):
            queues[q] = Count(messages if ".gateways." not in q else 0, 0)
        queues[n.gateways(k.max_level)] = Count(0, gateways.get(k, 0))
        exchanges[n.meditation(k.max_level)] = True
        for level in range(k.max_level):
            exchanges[n.level(level)] = True
    # what a full look also finds: the levels above exist no more
    for k in keys:
        n = Names(P, k.generation)
        for level in range(40):
            exchanges.setdefault(n.level(level), False)
            for q in level_queues(k, n, level):
                queues.setdefault(q, None)
        for m in range(1, 41):
            queues.setdefault(n.meditation(m), None)
            exchanges.setdefault(n.meditation(m), False)
            queues.setdefault(n.gateways(m), None)
    for name in gone:
        if name in queues:
            queues[name] = None
        if name in exchanges:
            exchanges[name] = False
    return Observed(queues, exchanges)


def declared(*keys):
    return [Record("declared", NOW - 10_000, k) for k in keys]


def steps(sequences):
    return [s for seq in sequences for s in seq]


# -- records -------------------------------------------------------------------------------
def test_records_survive_the_stream_and_strangers_are_skipped():
    k = key()
    for record in (Record("declared", 5, k), Record("retired", 6, k), Record("sealed", 7, queues={"q": 9})):
        assert decode(encode(record)) == record
    for garbage in (b"", b"not json", b"[]", b'{"schema": 2, "event": "declared"}', b'{"schema": 1}',
                    b'{"schema": 1, "event": "exploded", "at_ms": 1}'):
        assert decode(garbage) is None
    with pytest.raises(ValueError):
        Record("sealed", 1, k)


def test_fold_keeps_each_chains_latest_state_and_a_later_declare_voids_a_seal():
    a, b = key(4), key(3)
    q = Names(P, a.generation).meditation(4)
    r = fold([Record("declared", 1, a), Record("declared", 2, b), Record("sealed", 3, queues={q: 99}),
              Record("retired", 4, b)])
    assert r.declared == (a,) and r.retired == (b,)
    assert r.seal(q, [a]) == 99
    assert r.needs_record(a, P)  # retiring its queues had begun: record it again to cancel that
    r = fold([Record("declared", 1, a), Record("sealed", 3, queues={q: 99}), Record("declared", 5, a)])
    assert r.seal(q, [a]) is None
    assert not r.needs_record(a, P)
    assert fold([]).needs_record(a, P)


def test_a_chain_is_retiring_only_after_the_grace_without_gateways():
    a, b = key(4), key(3)
    u = Unused()
    u.update({a: 0, b: 2}, NOW)
    assert u.retiring(NOW + 999, 1000) == set()
    assert u.retiring(NOW + 1000, 1000) == {a}
    u.update({a: None, b: 0}, NOW + 1500)  # a: unknown again; b: left
    assert u.retiring(NOW + 2500, 1000) == {b}
    u.update({a: 1, b: 0}, NOW + 2600)
    assert u.retiring(NOW + 10_000, 1000) == {b}


# -- the plan ------------------------------------------------------------------------------
def test_max_level_down_seals_the_top_levels_and_the_old_meditation_first():
    old, new = key(4), key(3)
    n = Names(P, old.generation)
    got = plan(P, fold(declared(old, new)), [old, new], {new}, everything(old, new), NOW, MARGIN)
    assert got == [[SealQueues({
        n.delay_queue(3): NOW + (16 - 8) * 100 + 1 + MARGIN,  # a message at the top has left level 3 by then
        n.pass_queue(3): NOW + (16 - 8) * 100 + 1 + MARGIN,
        n.meditation(4): NOW + 15 * 100 + MARGIN,  # its TTL
    })]]


def test_once_sealed_and_due_they_go_top_down_each_guarded_by_the_old_chains_gateways_queue():
    old, new = key(4), key(3)
    n = Names(P, old.generation)
    seal = Record("sealed", NOW, queues={n.delay_queue(3): NOW + 5, n.pass_queue(3): NOW + 5,
                                         n.meditation(4): NOW + 5})
    registry = fold(declared(old, new) + [seal])
    guard = (n.gateways(4),)
    assert plan(P, registry, [old, new], {new}, everything(old, new), NOW, MARGIN) == []  # not yet
    got = plan(P, registry, [old, new], {new}, everything(old, new), NOW + 5, MARGIN)
    assert got == [
        [DeleteExchange(n.level(3), guard), DeleteQueue(n.delay_queue(3), guard, False, 800 + MARGIN),
         DeleteQueue(n.pass_queue(3), guard, False, 1 + MARGIN)],
        [DeleteExchange(n.meditation(4), guard), DeleteQueue(n.meditation(4), guard, False, 1500 + MARGIN)],
    ]
    # with both gone, the old chain's gateways queue goes and it is recorded as retired
    done = everything(old, new, gone=[n.level(3), n.delay_queue(3), n.pass_queue(3), n.meditation(4)])
    assert plan(P, registry, [old, new], {new}, done, NOW + 5, MARGIN) == [
        [DeleteQueue(n.gateways(4), guard, False, 0), MarkRetired(old)]]


def test_max_level_up_retires_only_the_old_meditation_queue():
    old, new = key(3), key(5)
    n = Names(P, old.generation)
    got = plan(P, fold(declared(old, new)), [old, new], {new}, everything(old, new), NOW, MARGIN)
    assert got == [[SealQueues({n.meditation(3): NOW + 700 + MARGIN})]]


def test_a_new_generation_retires_the_whole_old_chain_from_the_top_down_to_level_0():
    old, new = key(3, queue_type="classic"), key(3)
    n = Names(P, old.generation)
    queues = [q for k in range(3) for q in level_queues(old, n, k)]
    seal = Record("sealed", NOW, queues={q: NOW for q in queues + [n.meditation(3)]})
    got = steps(plan(P, fold(declared(old, new) + [seal]), [old, new], {new}, everything(old, new), NOW, MARGIN))
    deletes = [s for s in got if isinstance(s, (DeleteExchange, DeleteQueue))]
    assert [s.name for s in deletes] == [
        n.level(2), n.delay_queue(2), n.pass_queue(2), n.level(1), n.delay_queue(1), n.pass_queue(1),
        n.level(0), n.delay_queue(0), n.pass_queue(0), n.meditation(3), n.meditation(3)]
    assert all(s.classic for s in deletes if isinstance(s, DeleteQueue))  # classic: deleted "if empty"


def test_a_level_whose_time_has_not_come_stops_everything_below_it():
    old, new = key(3, resolution_ms=50), key(3)
    n = Names(P, old.generation)
    seal = Record("sealed", NOW, queues={n.delay_queue(2): NOW, n.pass_queue(2): NOW,
                                         n.delay_queue(1): NOW + 1, n.pass_queue(1): NOW,
                                         n.delay_queue(0): NOW, n.pass_queue(0): NOW, n.meditation(3): NOW})
    got = steps(plan(P, fold(declared(old, new) + [seal]), [old, new], {new}, everything(old, new), NOW, MARGIN))
    assert [getattr(s, "name", None) for s in got] == [
        n.level(2), n.delay_queue(2), n.pass_queue(2), n.meditation(3), n.meditation(3)]


def test_zero_bits_exchange_chains_have_no_pass_queues_to_seal():
    old, new = key(2, zero_bits="exchange"), key(2)
    n = Names(P, old.generation)
    (seal,), = plan(P, fold(declared(old, new)), [old, new], {new}, everything(old, new), NOW, MARGIN)
    assert set(seal.empty_by) == {n.delay_queue(0), n.delay_queue(1), n.meditation(2)}


def test_what_was_not_looked_at_blocks_its_deletion():
    old, new = key(3), key(2)
    n = Names(P, old.generation)
    seal = Record("sealed", NOW, queues={n.delay_queue(2): NOW, n.pass_queue(2): NOW, n.meditation(3): NOW})
    seen = everything(old, new)
    blind = Observed({q: c for q, c in seen.queues.items() if q != n.pass_queue(2)},
                     {x: e for x, e in seen.exchanges.items() if x != n.meditation(3)})
    got = plan(P, fold(declared(old, new) + [seal]), [old, new], {new}, blind, NOW, MARGIN)
    assert got == []


def test_a_chain_declared_again_after_its_seal_is_sealed_anew():
    old, new = key(3), key(2)
    n = Names(P, old.generation)
    records = declared(old, new) + [Record("sealed", NOW, queues={n.delay_queue(2): NOW, n.pass_queue(2): NOW,
                                                                  n.meditation(3): NOW}),
                                    Record("declared", NOW + 1, old)]  # a gateway with it came back
    got = plan(P, fold(records), [old, new], {new}, everything(old, new), NOW + 10, MARGIN)
    assert len(got) == 1 and isinstance(got[0][0], SealQueues)
    assert got[0][0].empty_by[n.meditation(3)] == NOW + 10 + 700 + MARGIN


def test_chains_kept_are_never_touched():
    old, new = key(3), key(2)
    assert plan(P, fold(declared(old, new)), [old, new], {old, new}, everything(old, new), NOW, MARGIN) == []
