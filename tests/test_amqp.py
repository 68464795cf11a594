"""Sorting broker errors into those that heal and those that do not, and the backoff (pure)."""

import random

import pytest
from pika.exceptions import (AMQPConnectionError, ChannelClosedByBroker, ConnectionClosedByBroker,
                             ProbableAuthenticationError, StreamLostError)

from topology.broker.permissions import Refused, needing

from gateway.broker.plumbing.amqp import classify
from gateway.broker.run.reconnects import Backoff

URL = "amqp://gw:s3cret@rabbit:5672/%2F"


@pytest.mark.parametrize("error,heals,says", [
    (AMQPConnectionError("refused"), True, "cannot connect"),
    (StreamLostError("reset"), True, "cannot connect"),
    (ConnectionClosedByBroker(320, "CONNECTION_FORCED - broker forced connection closure"), True, "FORCED"),
    (ChannelClosedByBroker(541, "INTERNAL_ERROR"), True, "INTERNAL_ERROR"),
    (ProbableAuthenticationError("ACCESS_REFUSED"), False, "login refused for user 'gw'"),
    (ConnectionClosedByBroker(530, "NOT_ALLOWED - vhost x not found"), False, "virtual host"),
    (ChannelClosedByBroker(404, "NOT_FOUND - no queue 'nosuchprefix.check-in' in vhost '/'"), False,
     "nosuchprefix.check-in' in vhost '/': the topology is not declared"),
    (ChannelClosedByBroker(403, "ACCESS_REFUSED - access to queue 'delay.check-in' refused"), False,
     "the user lacks a permission on this object (docs/security.md: Least privilege)"),
    (ChannelClosedByBroker(406, "PRECONDITION_FAILED - inequivalent arg 'x-message-ttl'"), False,
     "exists with other arguments"),
])
def test_errors_are_sorted_and_explained_in_one_line(error, heals, says):
    trouble = classify(error, URL)
    assert trouble.heals is heals
    assert says in trouble.message and "\n" not in trouble.message
    assert "s3cret" not in trouble.message and "amqp://gw:***@rabbit:5672/%2F" in trouble.message


@pytest.mark.parametrize("error,says", [
    # RabbitMQ 4 names the permission
    (ChannelClosedByBroker(403, "ACCESS_REFUSED - read access to queue 'delay.waiting.03' in vhost '/' refused for "
                                "user 'looker'"),
     "user 'looker' may not read queue 'delay.waiting.03' in vhost '/': grant it read permission on that name"),
    (ChannelClosedByBroker(403, "ACCESS_REFUSED - configure access to exchange 'delay.rules' in vhost 'v' refused "
                                "for user 'x'"),
     "user 'x' may not configure exchange 'delay.rules' in vhost 'v': grant it configure permission on that name"),
    # RabbitMQ 3.10 does not: the operation says (permissions.needing)
    (Refused(403, "ACCESS_REFUSED - access to exchange 'delay.rules' in vhost '/' refused for user 'c'", "write"),
     "user 'c' may not write to exchange 'delay.rules' in vhost '/': grant it write permission on that name"),
    (ChannelClosedByBroker(403, "ACCESS_REFUSED - access to queue 'delay.chains' in vhost '/' refused for user 'c'"),
     "user 'c' may not use queue 'delay.chains' in vhost '/': grant it the permission the operation needs"),
])
def test_a_refusal_names_the_one_permission_missing(error, says):
    trouble = classify(error, URL, "the looker's line")
    assert not trouble.heals and "\n" not in trouble.message
    assert trouble.message.startswith(says) and trouble.message.endswith("(docs/security.md: the looker's line)")
    assert "s3cret" not in trouble.message


def test_an_operation_says_which_permission_it_needs():
    with pytest.raises(Refused) as found:
        with needing("read"):
            raise ChannelClosedByBroker(403, "ACCESS_REFUSED - access to queue 'q' in vhost '/' refused for user 'u'")
    assert found.value.permission == "read" and found.value.reply_code == 403
    with pytest.raises(ChannelClosedByBroker) as other:
        with needing("read"):
            raise ChannelClosedByBroker(404, "NOT_FOUND - no queue 'q' in vhost '/'")
    assert not isinstance(other.value, Refused)


def test_backoff_grows_to_its_ceiling_and_starts_over_only_after_a_stable_connection():
    b = Backoff(first=0.2, longest=10, rng=random.Random(1))
    waits = [b.next(stable=False) for _ in range(10)]
    assert all(0.1 <= w <= 0.2 for w in waits[:1]) and all(5 <= w <= 10 for w in waits[7:])
    assert b.next(stable=False) >= 5  # a connection that died young: no fresh start
    assert b.next(stable=True) <= 0.2


def test_reconnects_give_up_on_three_refusals_in_a_row_or_on_no_broker_for_connect_timeout():
    from gateway.broker.plumbing.amqp import Trouble
    from gateway.broker.run.reconnects import Reconnects
    from gateway.exits import EXIT_NO_BROKER, EXIT_REFUSED

    now = [0.0]
    r = Reconnects(30.0, clock=lambda: now[0], backoff=Backoff(rng=random.Random(1)))
    refused, lost = Trouble(False, "ACCESS_REFUSED"), Trouble(True, "connection lost")
    assert [r.after(refused, stable=False).exit_code for _ in range(3)] == [None, None, EXIT_REFUSED]
    r = Reconnects(30.0, clock=lambda: now[0])
    r.after(refused, stable=False)
    r.after(refused, stable=False)
    assert r.after(refused, stable=True).refused == 0  # a stable session between: counting starts over
    now[0] = 29.0
    assert r.after(lost, stable=False).exit_code is None and r.after(None, stable=False).wait_s > 0
    now[0] = 31.0
    assert r.after(lost, stable=False).exit_code == EXIT_NO_BROKER
    r.up()  # a session got as far as consuming: another connect_timeout from now
    assert r.after(lost, stable=False).exit_code is None
