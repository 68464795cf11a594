"""Three virtual hosts served by one `run --vhosts` (every broker version the suite runs):
delays, cancels and retries in each, none crossing to another; one vhost's permissions
withdrawn mid-run (reported, retried, resumed when they return) while the others keep
delivering; a SIGKILL of the process loses nothing in any vhost. One gateway process serves
the first two checks, a second the third: about 30 s per broker."""

import uuid
from typing import Dict, List

import pika
import pytest

from topology import ChainSettings

from gateway.urls import with_vhost

from .support import GatewayProcess, Receiver, broker_url, connect, now_ms, publish_sentinel, unique_prefix, wait_until

RETRY_BASE_MS = 200


@pytest.fixture
def vhosts(broker, broker_ctl):
    """Three fresh virtual hosts on the test's broker, guest allowed in each; deleted after."""
    names = [f"gw-{uuid.uuid4().hex[:8]}-{i}" for i in range(3)]
    for name in names:
        broker_ctl("add_vhost", name)
        broker_ctl("set_permissions", "-p", name, "guest", ".*", ".*", ".*")
    yield names
    for name in names:
        broker_ctl("delete_vhost", name)


def url(vhost: str) -> str:
    return with_vhost(broker_url(), vhost)


def gateway(chain: ChainSettings, names: List[str]) -> GatewayProcess:
    return GatewayProcess(chain, "--vhosts", ",".join(names), "--retry-base-ms", str(RETRY_BASE_MS),
                          "--retry-jitter", "0").wait_ready(60)


def publish(chain: ChainSettings, vhost: str, messages: List[tuple]) -> None:
    """(message id, delay ms) each, confirmed, the body naming the vhost."""
    with connect(url(vhost)) as connection:
        channel = connection.channel()
        channel.confirm_delivery()
        for message_id, delay_ms in messages:
            channel.basic_publish(chain.names.check_in, "k", f"{vhost}:{message_id}".encode(), pika.BasicProperties(
                headers={"x-delay": delay_ms}, message_id=message_id, delivery_mode=2), mandatory=True)


def cancel(chain: ChainSettings, vhost: str, message_id: str) -> None:
    with connect(url(vhost)) as connection:
        channel = connection.channel()
        channel.confirm_delivery()
        channel.basic_publish(chain.names.cancel, "", b"", pika.BasicProperties(message_id=message_id), mandatory=True)


def arrived(receiver: Receiver, count: int, timeout: float) -> Dict[str, bytes]:
    """What arrived, by message id, once `count` different ids have (duplicates, which a
    crash may make, counted once), or `timeout` passed."""
    def ids() -> Dict[str, bytes]:
        return {m.properties.message_id: m.body for m in receiver.messages}
    wait_until(lambda: receiver.take() and len(ids()) >= count, timeout, interval=0.002, fail=False,
               sleep=receiver.connection.sleep)
    return ids()


def test_three_vhosts_each_its_own_delays_cancels_and_retries_and_one_refused_does_not_stop_the_others(
        vhosts, broker_ctl):
    chain = ChainSettings(unique_prefix(), max_level=8, resolution_ms=100, queue_type="classic")
    gw = gateway(chain, vhosts)
    receivers = {v: Receiver(chain, url=url(v)) for v in vhosts}
    try:
        # -- delays and cancels: the same id in every vhost, cancelled in the first only
        sent_at = now_ms()
        for v in vhosts:
            publish(chain, v, [(f"{v}-soon", 300), (f"{v}-later", 1500), ("same-id", 1500)])
        cancel(chain, vhosts[0], "same-id")
        publish_sentinel(chain, 1500, url=url(vhosts[0]))  # after it, the cancelled one cannot come
        # -- retries: a consumer in each vhost rejects a message; it comes back there
        for v in vhosts:
            with connect(url(v)) as connection:
                channel = connection.channel()
                channel.queue_declare("work", durable=True, arguments={"x-dead-letter-exchange": chain.names.retry})
                channel.confirm_delivery()
                channel.basic_publish("", "work", f"{v}:job".encode(), pika.BasicProperties(message_id=f"{v}-job"))
        for v in vhosts:
            with connect(url(v)) as connection:
                channel = connection.channel()
                method, _, _ = channel.basic_get("work")
                assert method is not None, "the job is not in its own vhost's queue"
                channel.basic_reject(method.delivery_tag, requeue=False)
        expected = {v: {f"{v}-soon", f"{v}-later"} | ({"same-id"} if v != vhosts[0] else set()) for v in vhosts}
        for v in vhosts:
            got = arrived(receivers[v], len(expected[v]), 15)
            assert set(got) == expected[v], f"{v}: {sorted(got)}"
            assert all(body.startswith(f"{v}:".encode()) for body in got.values()), f"a message crossed into {v}"
            assert min(m.at_ms for m in receivers[v].messages) >= sent_at + 300, "early"
        for v in vhosts:
            with connect(url(v)) as connection:
                channel = connection.channel()

                def back(channel=channel):
                    method, properties, body = channel.basic_get("work", auto_ack=True)
                    return (properties, body) if method is not None else None
                properties, body = wait_until(back, 10, what=f"the retry in {v}")
                assert body == f"{v}:job".encode() and properties.headers["x-retry-attempt"] == 1
        receivers[vhosts[0]].until_sentinel(10)
        assert "same-id" not in {m.properties.message_id for m in receivers[vhosts[0]].messages}, "the cancel lost"
        assert gw.metric("delay_gateway_cancelled_total", vhost=vhosts[0]) == 1
        assert gw.metric("delay_gateway_cancelled_total", vhost=vhosts[1]) == 0
        assert gw.metric("delay_gateway_ready", vhost=vhosts[2], role="all") == 1

        # -- one vhost refused mid-run: reported and retried; the others keep delivering
        refused = vhosts[1]
        receivers[refused].close()
        broker_ctl("clear_permissions", "-p", refused, "guest")
        broker_ctl("close_all_connections", "-p", refused, "permissions withdrawn by the test")
        wait_until(lambda: [e for e in gw.events("vhost_refused") if e.get("vhost") == refused], 30,
                   what="vhost_refused in the log")
        assert gw.metric("delay_gateway_vhost_refused", vhost=refused) == 1
        assert gw.ready, "one refused vhost made the process not ready"
        others = [v for v in vhosts if v != refused]
        for v in others:
            publish(chain, v, [(f"{v}-meanwhile", 200)])
        for v in others:
            assert f"{v}-meanwhile" in arrived(receivers[v], len(expected[v]) + 1, 10), f"{v} stopped delivering"
        assert gw.proc.poll() is None
        broker_ctl("set_permissions", "-p", refused, "guest", ".*", ".*", ".*")
        wait_until(lambda: [e for e in gw.events("vhost_resumed") if e.get("vhost") == refused], 30,
                   what="vhost_resumed in the log")
        assert gw.metric("delay_gateway_vhost_refused", vhost=refused) == 0
        receivers[refused] = Receiver(chain, url=url(refused))
        publish(chain, refused, [("after", 200)])
        assert "after" in arrived(receivers[refused], 1, 10), "the vhost did not resume"
        assert [e["vhost"] for e in gw.events("vhost_refused")] == [refused]
    finally:
        for r in receivers.values():
            r.close()
        assert gw.terminate() == 0


def test_sigkill_loses_nothing_in_any_vhost(vhosts):
    chain = ChainSettings(unique_prefix(), max_level=8, resolution_ms=100, queue_type="classic")
    gw = gateway(chain, vhosts)
    receivers = {v: Receiver(chain, url=url(v)) for v in vhosts}
    try:
        ids = {v: [f"{v}-{i}" for i in range(30)] for v in vhosts}
        sent_at = now_ms()
        for v in vhosts:
            publish(chain, v, [(mid, 500 + 50 * i) for i, mid in enumerate(ids[v])])
        # killed while every vhost has messages waiting in its chain and in its distributor
        wait_until(lambda: all(gw.metric("delay_gateway_messages_total", vhost=v) >= 10 for v in vhosts), 10)
        gw.proc.kill()
        gw.proc.wait(10)
        again = gateway(chain, vhosts)
        try:
            for v in vhosts:
                got = arrived(receivers[v], len(ids[v]), 20)
                assert set(got) == set(ids[v]), f"{v} lost {sorted(set(ids[v]) - set(got))}"
                assert all(body.startswith(f"{v}:".encode()) for body in got.values())
                assert min(m.at_ms for m in receivers[v].messages) >= sent_at + 500, "early"
        finally:
            assert again.terminate() == 0
    finally:
        for r in receivers.values():
            r.close()
