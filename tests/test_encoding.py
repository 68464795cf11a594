"""The delay encoding and the chain it runs through, simulated from the topology's own
bindings and TTLs (no broker): routes, waits and exactly-one-queue at every step."""

import pytest
from hypothesis import given, settings as hsettings, strategies as st

from topology import ChainSettings, Enter, Meditate, ToDistributor, bit_key, build, key_units, plan
from topology.encoding import level_pattern
from topology.routing import route, topic_matches, trace
from topology.settings import MAX_TTL_MS, max_level_for

from .support import examples

YEAR_MS = 31_557_600_000


@pytest.mark.parametrize("units,key", [(1, "1"), (2, "0.1"), (11, "1.1.0.1"), (16, "0.0.0.0.1")])
def test_bit_keys_are_least_significant_bit_first(units, key):
    assert bit_key(units) == key
    assert key_units(key) == units


@pytest.mark.parametrize("remaining,expected", [
    (-5, ToDistributor()),
    (0, ToDistributor()),
    (999, ToDistributor()),            # below one unit: the distributor holds it
    (1000, Enter(0, "1")),             # exactly one unit
    (1999, Enter(0, "1")),             # rounds down, never up
    (11_000, Enter(3, "1.1.0.1")),
    (15_999, Enter(3, "1.1.1.1")),     # the chain's maximum
    (16_000, Meditate()),
])
def test_plan_table(remaining, expected):
    assert plan(remaining, ChainSettings(max_level=4)) == expected


def test_lead_leaves_room_for_hop_latency():
    chain = ChainSettings(max_level=4)
    assert plan(1000, chain, lead_ms=50) == ToDistributor()
    assert plan(1050, chain, lead_ms=50) == Enter(0, "1")


@pytest.mark.parametrize("pattern,key,matches", [
    ("*.*.1.#", "0.0.1", True), ("*.*.1.#", "0.0.1.1.0", True), ("*.*.1.#", "0.1", False),
    ("1.#", "1", True), ("#", "", True), ("#.a", "a", True), ("a.*", "a", False),
    ("a.#.b", "a.b", True), ("a.#.b", "a.x.y.b", True), ("*", "", True),
])
def test_topic_matching_follows_amqp(pattern, key, matches):
    assert topic_matches(pattern, key) is matches


@given(max_level=st.integers(1, 40), resolution_ms=st.integers(1, 3_600_000))
def test_settings_refuse_ttls_rabbitmq_cannot_hold(max_level, resolution_ms):
    too_long = ((1 << max_level) - 1) * resolution_ms > MAX_TTL_MS
    if too_long:
        with pytest.raises(ValueError, match="10 years"):
            ChainSettings(max_level=max_level, resolution_ms=resolution_ms)
        assert max_level > max_level_for(resolution_ms)
    else:
        assert ChainSettings(max_level=max_level, resolution_ms=resolution_ms).max_level == max_level


@st.composite
def chains(draw):
    resolution_ms = draw(st.sampled_from([1, 7, 10, 100, 250, 1000, 60_000]) | st.integers(1, 100_000))
    max_level = draw(st.integers(1, min(40, max_level_for(resolution_ms))))
    return ChainSettings(prefix="p", max_level=max_level, resolution_ms=resolution_ms,
                         queue_type=draw(st.sampled_from(["quorum", "classic"])),
                         zero_bits=draw(st.sampled_from(["queue", "exchange"])))


def simulate(chain: ChainSettings, delay_ms: int, lead_ms: int):
    """Follow a message from check-in to the distributor; return (chain waits, hops, cycles)."""
    topology, names = build(chain), chain.names
    waited, cycles = 0, 0
    while isinstance(plan(delay_ms - waited, chain, lead_ms), Meditate):
        # check-in publishes to the meditation exchange; its queue returns it to check-in
        [queue] = route(topology, chain.meditation, "")
        meditation = topology.queue(queue)
        returning = names.exit_returning(chain.queue_type)
        assert meditation.dead_letter_exchange == returning
        assert route(topology, returning, "") == [returning]
        assert meditation.ttl_ms == chain.meditation_ms
        # Every further cycle is the same walk: skip ahead to the last one that meditates.
        more = (delay_ms - waited - lead_ms - (chain.max_units + 1) * chain.resolution_ms) // chain.meditation_ms
        assert isinstance(plan(delay_ms - waited - more * chain.meditation_ms, chain, lead_ms), Meditate)
        waited += (more + 1) * chain.meditation_ms
        cycles += more + 1
    step = plan(delay_ms - waited, chain, lead_ms)
    if isinstance(step, ToDistributor):
        assert route(topology, names.distributor, "") == [names.distributor]
        return waited, (), cycles
    hops = trace(topology, names.level(step.level), step.key, stop_at=names.exit_distributor(chain.queue_type))
    return waited + sum(h.wait_ms for h in hops), hops, cycles


@hsettings(max_examples=examples(400))
@given(chain=chains(), delay_ms=st.integers(0, 100 * YEAR_MS), lead_ms=st.integers(0, 200))
def test_every_delay_reaches_the_distributor_in_time(chain, delay_ms, lead_ms):
    # The 1 ms pass-through hops are the chain's own latency; the lead must cover them.
    lead_ms = max(lead_ms, chain.max_level if chain.zero_bits == "queue" else 0)
    waited, hops, cycles = simulate(chain, delay_ms, lead_ms)
    # The chain never overshoots the due time ...
    assert waited <= max(delay_ms, 0)
    # ... and leaves the distributor less than one unit plus the lead to hold.
    assert delay_ms - waited < chain.resolution_ms + lead_ms
    # The distributor releases at the due time: delivery is exact, never early.
    assert max(waited, delay_ms) == max(delay_ms, 0)
    # Delay queues taken are exactly the 1 bits of the remainder after meditation.
    remainder_units = sum(h.wait_ms for h in hops if h.queue.endswith(".delay")) // chain.resolution_ms
    expected_units = max(0, delay_ms - cycles * chain.meditation_ms - lead_ms) // chain.resolution_ms
    assert remainder_units == expected_units
    assert len(hops) <= chain.max_level


@hsettings(max_examples=examples(300))
@given(chain=chains(), data=st.data())
def test_each_level_routes_every_possible_key_to_exactly_one_queue(chain, data):
    k = data.draw(st.integers(0, chain.max_level - 1))
    # A key reaching level k has its own bit at word k and any bits above it.
    words = data.draw(st.lists(st.sampled_from("01"), min_size=k + 1, max_size=chain.max_level))
    key = ".".join(words)
    queues = route(build(chain), chain.names.level(k), key)
    assert len(queues) == 1
    names = chain.names
    expected_kind = "delay" if words[k] == "1" else "pass"
    if chain.zero_bits == "queue" or expected_kind == "delay":
        assert queues == [names.delay_queue(k) if expected_kind == "delay" else names.pass_queue(k)]


@pytest.mark.parametrize("k", range(5))
def test_level_patterns_select_one_word(k):
    assert level_pattern(k, "1") == "*." * k + "1.#"
