"""`delay-gateway parked list` and `parked replay`, against the real gateway and broker."""

import json
import subprocess
import sys

import pika

from ..support import (ROOT, Receiver, broker_url, chain_args, connect, next_message, now_ms, parked_report,
                       sent_headers)


def cli(chain, *args) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "gateway", "parked", *args, *chain_args(chain),
                             "--url", broker_url()], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result


def listed(chain) -> dict:
    return json.loads(cli(chain, "list", "--json").stdout)


# Long enough that a replayed message with its delay applied again could not pass for one
# delivered at once, even after a slow start of the replaying command.
DELAY_MS = 5000


def test_list_then_replay_after_the_cause_is_fixed(make_chain, run_gateway):
    chain = make_chain(max_level=3, resolution_ms=100)
    run_gateway(chain)
    with connect() as connection:
        channel = connection.channel()
        channel.confirm_delivery()
        for i in range(3):  # due in DELAY_MS, but nobody is bound to "late.#" yet
            channel.basic_publish(chain.names.check_in, f"late.{i}", b"late", pika.BasicProperties(
                message_id=f"late-{i}", headers={"x-delay": DELAY_MS, "keep": i}), mandatory=True)
        channel.basic_publish(chain.names.check_in, "bad.header", b"bad", pika.BasicProperties(
            message_id="bad", headers={"x-delay": "tomorrow"}), mandatory=True)
    report = parked_report(chain, 4)
    assert report["count"] == 4
    assert sum(n for r, n in report["reasons"].items() if r.startswith("unroutable")) == 3
    assert report["reasons"]["x-delay is 'tomorrow', not a number"] == 1
    assert set(report["routing_keys"]) == {"late.0", "late.1", "late.2", "bad.header"}
    assert {m["message_id"] for m in report["messages"]} == {"late-0", "late-1", "late-2", "bad"}
    assert "4 parked message(s)" in cli(chain, "list").stdout
    assert listed(chain)["count"] == 4  # listing moves nothing

    dry = json.loads(cli(chain, "replay", "--reason", "unroutable", "--dry-run").stdout)
    assert dry["would_replay"] == 3 and listed(chain)["count"] == 4

    receiver = Receiver(chain, "late.#")  # the cause is fixed: someone is bound now
    one = json.loads(cli(chain, "replay", "--routing-key", "late.*", "--limit", "1").stdout)
    assert one["replayed"] == 1 and one["left_parked"] == 3
    replayed_at = now_ms()
    rest = json.loads(cli(chain, "replay", "--reason", "unroutable").stdout)
    assert rest["replayed"] == 2
    # Already due when parked: delivered at once, its x-delay not applied again (which would
    # make it arrive DELAY_MS after the replay at the earliest; the margin is the CLI's start
    # on a loaded machine).
    got = receiver.collect(3, timeout=DELAY_MS / 1000)
    receiver.close()
    assert sorted(m.properties.message_id for m in got) == ["late-0", "late-1", "late-2"]
    assert all(m.at_ms - replayed_at < DELAY_MS - 1000 for m in got), [m.at_ms - replayed_at for m in got]
    assert all(sent_headers(m.properties) == {"x-delay": DELAY_MS, "keep": int(m.routing_key[-1])} for m in got)
    # The unreadable header was not fixed: replaying it parks it again, with its reason.
    assert json.loads(cli(chain, "replay").stdout)["replayed"] == 1
    again = parked_report(chain, 1)
    assert again["count"] == 1 and again["messages"][0]["message_id"] == "bad"
    assert again["messages"][0]["reason"] == "x-delay is 'tomorrow', not a number"


def test_listing_parked_messages_never_removes_them(make_chain, run_gateway):
    """RabbitMQ 4 drops a quorum queue's message after 20 returns unless told otherwise;
    every list returns what it looked at. The looks here give it back as `parked list` does,
    by closing the channel, which counts as a return on every version (basic.nack with
    requeue would not count on 4.3)."""
    chain = make_chain(max_level=2, resolution_ms=100)
    run_gateway(chain)
    with connect() as connection:
        channel = connection.channel()
        channel.confirm_delivery()
        channel.basic_publish(chain.names.check_in, "bad", b"x", pika.BasicProperties(
            message_id="kept", headers={"x-delay": "never"}), mandatory=True)
    assert parked_report(chain, 1)["count"] == 1
    with connect() as connection:  # 25 looks, as `parked list` takes them
        for _ in range(25):
            channel = connection.channel()
            # (the last look's return may still be on its way back)
            next_message(channel, chain.names.parked, 5, "the parked message back after a look", auto_ack=False)
            channel.close()
    report = listed(chain)
    assert report["count"] == 1 and report["messages"][0]["message_id"] == "kept"
