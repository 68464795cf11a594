"""move-from-plugin's pure parts: the dry run's ranges, the gateway format it publishes, the
plugin table checks and the Erlang programs' safety through Debian's rabbitmqctl wrapper
(the command itself: tests/faults/test_move_from_plugin.py, against a private node)."""

from string import Template

import pytest

from gateway.broker.tools import plugin_table
from gateway.broker.tools.plugin_table import ENTRY_SHAPE, INDEX_SHAPE, SHELL_SAFE, MnesiaTable, PluginMessage, Probe
from gateway.broker.tools.plugin_table import Waiting
from gateway.commands.move import count, held_as_gateway, index_entries, outgoing, ranges, refused
from gateway.core import cancels, index_records, wire
from gateway.core.envelope import Inside

NOW = 1_800_000_000_000


def test_ranges_start_at_what_is_left_to_the_plugin():
    assert [name for name, _ in ranges(10_000)] == [
        "from 10 s to 1 min", "from 1 min to 1 h", "from 1 h to 1 day", "from 1 day to 7 days",
        "from 7 days to 30 days", "30 days or later"]
    assert [name for name, _ in ranges(3_600_000)][0] == "from 1 h to 1 day"


def test_count_sorts_every_key_once():
    waiting = [Waiting(NOW + 5_000, "/", "a", 2), Waiting(NOW + 10_000, "/", "a", 3),
               Waiting(NOW + 59_999, "/", "b", 1), Waiting(NOW + 40 * 86_400_000, "/", "a", 4),
               Waiting(NOW + 20_000, "/other", "a", 5), Waiting(NOW - 1, "/", "a", 6)]
    c = count(waiting, NOW, 10_000, "/", [])
    assert c.left == 8 and c.elsewhere == 5 and c.movable == 8
    assert c.ranges["from 10 s to 1 min"] == 4 and c.ranges["30 days or later"] == 4
    only_b = count(waiting, NOW, 10_000, "/", ["b"])
    assert only_b.movable == 1 and only_b.elsewhere == 2 + 3 + 4 + 5 + 6
    assert sum(only_b.ranges.values()) + only_b.left + only_b.elsewhere == sum(w.count for w in waiting)


def test_what_is_published_is_the_entry_in_the_gateways_format():
    props = wire.Properties.build(message_id=b"m-1", user_id=b"alice",
                                  headers=wire.Table([wire.long("x-delay", 50_000)]))
    entry = PluginMessage(NOW + 60_000, b"order.1", props.raw, b"body", "ref")
    read = cancels.Sequencer()
    [(exchange, key, sent, body), (_, _, again, _)] = list(outgoing(held_as_gateway([entry, entry], read, NOW),
                                                                    "delay.distributor"))
    inside = Inside(sent)
    assert (exchange, key, body) == ("delay.distributor", "", b"body")
    assert inside.due_ms == NOW + 60_000 and inside.routing_key == b"order.1"
    assert inside.user == props.replace(user_id=None)  # every other byte as the plugin held it
    # Taken in when the plugin took it in (its due time less its x-delay): a cancel recorded
    # before that does not cancel it, one after does; each message its own read time.
    published_us = (NOW + 60_000 - 50_000) * 1000  # (the test's "now" is the move's: it was published before)
    entry_now = PluginMessage(NOW + 60_000, b"order.1", props.raw, b"body", "ref")
    [held] = held_as_gateway([entry_now], read, NOW + 10_000)
    assert held.accepted_us == published_us
    [(_, _, sent, _), (_, _, again, _)] = list(outgoing(held_as_gateway([entry, entry], read, NOW + 10_000),
                                                        "delay.distributor"))
    inside = Inside(sent)
    assert inside.accepted_us == published_us and Inside(again).accepted_us == published_us + 1
    assert cancels.after(cancels.Time(published_us + 2), cancels.Time(inside.accepted_us))
    assert not cancels.after(cancels.Time(published_us - 1), cancels.Time(inside.accepted_us))
    # an x-delay that would put its publish after now (not the plugin's sum): not after now
    [later] = held_as_gateway([PluginMessage(NOW + 60_000, b"order.3", wire.Properties.build(
        headers=wire.Table([wire.long("x-delay", 5)])).raw, b"", "ref")], read, NOW)
    assert later.accepted_us == NOW * 1000
    # without an integer x-delay, when it was published cannot be known: before every cancel
    for headers in (None, wire.Table([wire.longstr("x-delay", "5")]), wire.Table([wire.long("x-delay", -5)])):
        blind = PluginMessage(NOW + 60_000, b"order.2", wire.Properties.build(headers=headers).raw, b"", "ref")
        [held] = held_as_gateway([blind], read, NOW)
        assert held.accepted_us is not None and held.accepted_us < 0
        assert cancels.after(cancels.Time(1), cancels.Time(held.accepted_us))


def table(**changes) -> MnesiaTable:
    fields = dict(name="rabbit_delayed_messagerabbit@a", where="rabbit@a", record=ENTRY_SHAPE[0],
                  attributes=ENTRY_SHAPE[1], type=ENTRY_SHAPE[2], size=1, index=INDEX_SHAPE)
    fields.update(changes)
    return MnesiaTable(**fields)


def test_a_table_of_the_plugins_shape_passes_and_others_say_what_they_are():
    assert table().problem() is None
    assert "[delay_key,message]" in table(attributes="[delay_key,message]").problem()
    assert "index {'EXIT'" in table(index="{'EXIT',no_exists}").problem()
    assert "node holding it is down" in table(where="nowhere").problem()


@pytest.mark.parametrize("probe, says", [
    (Probe("rabbit@a", None, "khepri", True, ()), "Khepri"),
    (Probe("rabbit@a", None, "mnesia", False, ()), "Khepri"),
    (Probe("rabbit@a", "3.10.2", "mnesia", True, ()), "no table of the delayed-message plugin"),
    (Probe("rabbit@a", "3.10.2", "mnesia", True, (table(), table(type="set"))), "not of the shape"),
])
def test_refusals_name_the_cause(probe, says):
    assert says in refused(probe)


def test_nothing_refused_for_the_plugins_tables():
    assert refused(Probe("rabbit@a", "3.10.2", "mnesia", True, (table(),))) is None


@pytest.mark.parametrize("name", ["_PROBE", "_KEYS", "_BATCH", "_REMOVE"])
def test_every_program_passes_debians_su_wrapper_unchanged(name):
    """No $, ` or backslash escapes other than \\t and \\n: Debian's rabbitmqctl hands its
    arguments to `su -c "..."`, where those would be expanded."""
    program = Template(getattr(plugin_table, name)).substitute(
        prefix="p", table="dA==", vhost="Lw==", names='<<"eA==">>', min_due=1, limit=2, cursor="",
        refs='<<"cg==">>', first=1, last=2)
    assert SHELL_SAFE.fullmatch(program), program
    assert not SHELL_SAFE.fullmatch("'$end_of_table'")


def test_the_moved_messages_entries_name_them_in_the_index_until_due():
    """The move writes each message's entry in the index of what waits (as a gateway that sends
    one on to wait does), in the band of its wait, so `pending` lists it from then on."""
    props = wire.Properties.build(message_id=b"m-1")
    plugin = [PluginMessage(NOW + 60_000, b"order.1", props.raw, b"body", "a"),
              PluginMessage(NOW + 400 * 86_400_000, b"order.2", props.raw, b"body", "b")]
    held = held_as_gateway(plugin, cancels.Sequencer(), NOW)
    records = list(index_entries(held, "delay.waiting", 11, NOW, "delay-gateway"))
    assert {props.get("user_id") for _, _, props, _ in records} == {b"delay-gateway"}  # (signed: writers.py)
    assert [key for _, key, _, _ in records] == ["03", "10"]  # (1 minute; 400 days: the top band of 11)
    listed = [m for _, _, _, body in records for m in index_records.entries(body)]
    assert [(m.routing_key, m.due_ms, m.until_ms, m.read_us) for m in listed] == \
        [(e.routing_key, e.due_ms, e.due_ms, e.accepted_us) for e in held]
    assert all(m.read_us < 0 for m in listed)  # (no x-delay: before any cancel)
