"""Credentials never in output, TLS with a CA and a client certificate, and a
least-privilege user whose permissions cover only the prefix: all on the private node. And
each role of docs/security.md as a real user with its line, running the real CLI, on the
suite's brokers."""

import base64
import collections
import contextlib
import json
import os
import shlex
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from typing import List
from urllib.parse import urlsplit, urlunsplit

import pika
import pytest

from topology import ChainSettings

from topology.broker import inventory
from topology.index_bands import band_key, bands

from gateway.core import cancels, index_records, rules, writers
from gateway.urls import user_of

from ..support import (ROOT, SENTINEL, GatewayProcess, Receiver, broker_url, chain_args, connect, next_message, now_ms,
                       parked_report, publish_sentinel, wait_until)

cancels_struct = struct.Struct(">qI")  # a handle's bytes: read time and checksum (gateway/core/cancels.py)


def gateway_cli(*args, env=None, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gateway", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ, **(env or {})))


def secret_file(text: str) -> str:
    fd, path = tempfile.mkstemp(prefix="delay-gateway-secret-")
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    return path


@pytest.mark.brokers("rmq3.10", reason="scans the gateway's own output; the broker only refuses a login; 10-15 s")
def test_password_never_in_logs_or_errors(own_node, node_chain):
    password = f"Pw-{uuid.uuid4().hex}"
    user = f"gw{uuid.uuid4().hex[:8]}"
    own_node.ctl("add_user", user, password)
    own_node.ctl("set_permissions", "-p", "/", user, ".*", ".*", ".*")
    chain = node_chain(max_level=3, resolution_ms=100)
    port = own_node.amqp_port
    path = secret_file(password)
    outputs = []
    try:
        fast = ["--connect-timeout", "2", "--log-level", "debug", "--log-format", "json"]
        # 1. the password in the URL, a host where nobody listens
        r = gateway_cli("run", *chain_args(chain), *fast,
                        env={"DELAY_GATEWAY_URL": f"amqp://{user}:{password}@127.0.0.1:1/%2F"})
        outputs.append(("unreachable host, password in URL", r))
        assert r.returncode == 1
        # 2. the password from a file, a wrong user name: the broker refuses the login
        r = gateway_cli("run", *chain_args(chain), *fast, "--password-file", path,
                        env={"DELAY_GATEWAY_URL": f"amqp://nobody@127.0.0.1:{port}/%2F"})
        outputs.append(("login refused, password from file", r))
        assert r.returncode == 3 and "login refused for user 'nobody'" in r.stderr.splitlines()[-1]
        # 3. a wrong password in the URL, while the right one is in the environment file
        wrong = f"Wrong-{uuid.uuid4().hex}"
        r = gateway_cli("declare", *chain_args(chain), "--url", f"amqp://{user}:{wrong}@127.0.0.1:{port}/%2F")
        outputs.append(("declare with a wrong password", r))
        assert r.returncode == 3 and "login refused" in r.stderr and wrong not in r.stdout + r.stderr
        # 4. the right password from DELAY_GATEWAY_PASSWORD_FILE: it works end to end
        gateway = GatewayProcess(chain, "--log-level", "debug", url=f"amqp://{user}@127.0.0.1:{port}/%2F",
                                 env={"DELAY_GATEWAY_PASSWORD_FILE": path}).wait_ready()
        receiver = Receiver(chain, url=own_node.url)  # bound to pick-up before the publish
        try:
            sent = now_ms()
            r = gateway_cli("publish", *chain_args(chain), "--delay", "300", "--routing-key", "end.to.end",
                            "--body", "through", "--url", f"amqp://{user}@127.0.0.1:{port}/%2F",
                            "--password-file", path)
            assert r.returncode == 0, r.stderr
            outputs.append(("publish with the password file", r))
            got = receiver.collect(1, timeout=15)
        finally:
            receiver.close()
        assert len(got) == 1, f"the published message never reached pick-up: {gateway.errors()}"
        [m] = got
        assert (m.body, m.routing_key) == (b"through", "end.to.end")
        assert m.at_ms >= sent + 300, f"delivered {m.at_ms - sent} ms after the publish began: before its delay"
        assert gateway.terminate() == 0
        outputs.append(("a gateway run", subprocess.CompletedProcess([], 0, "", "".join(gateway.raw))))
    finally:
        os.unlink(path)
        own_node.ctl("delete_user", user, check=False)
    for what, r in outputs:
        text = r.stdout + r.stderr
        assert text.strip(), f"{what}: no output at all, nothing was checked"
        assert password not in text, f"{what}: the password appears in the output:\n{text}"
    assert "***" in outputs[0][1].stderr  # the URL was logged, redacted


def test_tls_with_ca_and_client_certificate(own_node, node_chain, tls_files):
    chain = node_chain(max_level=3, resolution_ms=100)
    url = f"amqps://guest:guest@localhost:{own_node.tls_port}/%2F"
    tls = ["--tls-ca-file", tls_files["ca"], "--tls-cert-file", tls_files["client"]]
    # Without our CA the broker's certificate is not trusted: no connection.
    r = gateway_cli("declare", *chain_args(chain), "--url", url)
    assert r.returncode == 1 and "CERTIFICATE_VERIFY_FAILED" in r.stderr, r.stderr
    gateway = GatewayProcess(chain, *tls, url=url).wait_ready()
    receiver_conn = connect(own_node.url)
    channel = receiver_conn.channel()
    queue = channel.queue_declare("", exclusive=True).method.queue
    channel.queue_bind(queue, chain.names.pick_up, "#")
    try:
        sent = now_ms()
        r = gateway_cli("publish", *chain_args(chain), "--url", url, *tls, "--delay", "300",
                        "--routing-key", "over.tls", "--body", "secret")
        assert r.returncode == 0, r.stderr
        method, _, body = next_message(channel, queue, 10, "the message sent over TLS")
        assert body == b"secret" and method.routing_key == "over.tls" and now_ms() - sent >= 300
        listing = own_node.ctl("list_connections", "-q", "--no-table-headers", "name", "ssl",
                               "peer_cert_subject").stdout
        # The gateway is the only TLS client now, and it presented the client certificate.
        tls_lines = [line for line in listing.splitlines() if "\ttrue\t" in line]
        assert tls_lines and all("O=trustme" in line for line in tls_lines), listing
    finally:
        assert gateway.terminate() == 0
        receiver_conn.close()


def readme_permissions_line() -> str:
    """The security guide's set_permissions line, read from the guide: the test runs exactly it."""
    with open(os.path.join(ROOT, "docs", "security.md"), encoding="utf-8") as f:
        [line] = [x.strip() for x in f if x.startswith("rabbitmqctl set_permissions -p / delay-gateway ")]
    return line


def test_least_privilege_user_runs_the_gateway(own_node):
    password = uuid.uuid4().hex
    own_node.ctl("add_user", "delay-gateway", password)
    argv = shlex.split(readme_permissions_line())
    assert argv[-3:] == [r"^delay\."] * 3
    assert argv[0] == "rabbitmqctl"
    own_node.ctl(*argv[1:])
    chain = ChainSettings(prefix="delay", max_level=3, resolution_ms=100)  # the guide's prefix
    url = f"amqp://delay-gateway:{password}@127.0.0.1:{own_node.amqp_port}/%2F"
    gateway = None
    try:
        r = gateway_cli("declare", *chain_args(chain), "--url", url)
        assert r.returncode == 0, r.stderr
        gateway = GatewayProcess(chain, url=url).wait_ready()
        with pika.BlockingConnection(pika.URLParameters(url)) as connection:
            channel = connection.channel()
            # A receiver's queue must be named under the prefix too: a server-named
            # exclusive queue (amq.gen-...) is outside these permissions.
            channel.queue_declare("delay.test-receiver", durable=False, auto_delete=True)
            channel.queue_bind("delay.test-receiver", "delay.pick-up", "#")
            sent = now_ms()
            r = gateway_cli("publish", *chain_args(chain), "--url", url, "--delay", "250",
                            "--routing-key", "least.privilege", "--message-id", "lp")
            assert r.returncode == 0, r.stderr
            _, properties, _ = next_message(channel, "delay.test-receiver", 10)
            assert properties.message_id == "lp" and now_ms() - sent >= 250
            # ...and the permissions really are narrow: nothing outside the prefix.
            try:
                connection.channel().queue_declare("elsewhere")
                raise AssertionError("a queue outside the prefix could be declared")
            except pika.exceptions.ChannelClosedByBroker as exc:
                assert exc.reply_code == 403
        assert gateway.terminate() == 0
        assert not [e for e in gateway.lines if e.get("level") == "error"], gateway.raw
    finally:
        if gateway is not None:
            gateway.kill()
        r = gateway_cli("delete", *chain_args(chain), "--yes", "--url", own_node.url)
        own_node.ctl("delete_user", "delay-gateway", check=False)


def readme_publisher_line() -> str:
    with open(os.path.join(ROOT, "docs", "security.md"), encoding="utf-8") as f:
        [line] = [x.strip() for x in f if x.startswith("rabbitmqctl set_permissions -p / app ")]
    return line


def test_a_least_privileged_publisher_reaches_check_in_and_pick_up_only(own_node):
    """The security guide's line for applications: check-in to publish, pick-up to bind; nothing
    else of the gateway's, not even by dead-lettering into its internal entrance."""
    password = uuid.uuid4().hex
    own_node.ctl("add_user", "app", password)
    own_node.ctl(*shlex.split(readme_publisher_line())[1:])
    chain = ChainSettings(prefix="delay", max_level=3, resolution_ms=100)
    url = f"amqp://app:{password}@127.0.0.1:{own_node.amqp_port}/%2F"
    gateway = None
    try:
        assert gateway_cli("declare", *chain_args(chain), "--url", own_node.url).returncode == 0
        gateway = GatewayProcess(chain, url=own_node.url).wait_ready()
        with pika.BlockingConnection(pika.URLParameters(url)) as connection:
            channel = connection.channel()
            channel.queue_declare("app.reminders", durable=False, auto_delete=True)
            channel.queue_bind("app.reminders", "delay.pick-up", "#")
            channel.confirm_delivery()
            sent = now_ms()
            channel.basic_publish("delay.check-in", "app.key", b"hi", pika.BasicProperties(
                headers={"x-delay": 200}), mandatory=True)
            _, _, body = next_message(channel, "app.reminders", 10)
            assert body == b"hi" and now_ms() - sent >= 200
            refused = []
            for exchange in (chain.names.level(0), chain.names.distributor, chain.names.parked,
                             chain.names.returning, chain.meditation):
                ch = connection.channel()
                try:
                    ch.basic_publish(exchange, "1", b"forged", pika.BasicProperties(headers={"x-gateway-due-at": 1}))
                    ch.basic_get("app.reminders")  # the refusal arrives on the next round trip
                except pika.exceptions.ChannelClosedByBroker as exc:
                    refused.append(exc.reply_code)
            assert refused == [403] * 5
            with pytest.raises(pika.exceptions.ChannelClosedByBroker) as dlx:
                connection.channel().queue_declare("app.sneaky", arguments={
                    "x-dead-letter-exchange": chain.names.returning, "x-message-ttl": 1})
            assert dlx.value.reply_code == 403
    finally:
        if gateway is not None:
            gateway.terminate()
        gateway_cli("delete", *chain_args(chain), "--yes", "--url", own_node.url)
        own_node.ctl("delete_user", "app", check=False)


def retries_permissions_line() -> str:
    with open(os.path.join(ROOT, "docs", "retries.md"), encoding="utf-8") as f:
        [line] = [x.strip() for x in f if x.startswith("rabbitmqctl set_permissions -p / delay-gateway ")]
    return line


def test_retries_need_write_on_amq_default_and_without_it_are_parked_alone(own_node):
    """The least-privileged gateway (its prefix only) parks a retry the broker refuses to take
    through the default exchange, and stays up; with the retries guide's permission line the
    retry goes back to its queue."""
    password = uuid.uuid4().hex
    own_node.ctl("add_user", "delay-gateway", password)
    own_node.ctl(*shlex.split(readme_permissions_line())[1:])
    chain = ChainSettings(prefix="delay", max_level=3, resolution_ms=100)
    url = f"amqp://delay-gateway:{password}@127.0.0.1:{own_node.amqp_port}/%2F"
    gateway = None
    try:
        assert gateway_cli("declare", *chain_args(chain), "--url", url).returncode == 0
        gateway = GatewayProcess(chain, "--retry-base-ms", "200", url=url).wait_ready()
        with pika.BlockingConnection(pika.URLParameters(url)) as connection:
            channel = connection.channel()
            channel.queue_declare("delay.test-work", durable=True, arguments={
                "x-queue-type": "quorum", "x-dead-letter-exchange": "delay.retry"})

            def reject_one(mid: str) -> None:
                channel.basic_publish("delay.retry", "", b"job", pika.BasicProperties(
                    message_id=mid, headers={"x-retry-queue": "delay.test-work"}))

            reject_one("refused")
            listed = parked_report(chain, url=own_node.url)
            assert "ACCESS_REFUSED" in listed["messages"][0]["reason"], listed
            assert gateway.proc.poll() is None and gateway.metric("delay_gateway_connections_total") == 1
            own_node.ctl(*shlex.split(retries_permissions_line())[1:])
            reject_one("allowed")
            _, properties, _ = next_message(channel, "delay.test-work", 10, "the allowed retry")
            assert properties.message_id == "allowed"
            assert properties.headers["x-retry-attempt"] == 1
            channel.queue_delete("delay.test-work")
    finally:
        if gateway is not None:
            gateway.kill()
        gateway_cli("delete", *chain_args(chain), "--yes", "--url", own_node.url)
        own_node.ctl("delete_user", "delay-gateway", check=False)


# -- the roles of docs/security.md, each as a real user on both suite brokers ----------------------
def role_line(role: str, prefix: str, user: str) -> List[str]:
    """The security guide's set_permissions line of `role` (its user name in the guide), for
    `prefix` instead of `delay`, for the user `user`: the arguments rabbitmqctl takes."""
    with open(os.path.join(ROOT, "docs", "security.md"), encoding="utf-8") as f:
        [line] = [x.strip() for x in f if x.startswith(f"rabbitmqctl set_permissions -p / {role} ")]
    argv = shlex.split(line)[1:]
    assert argv[:4] == ["set_permissions", "-p", "/", role]
    escaped = "".join("\\" + c if c in ".^$*+?()[]{}|\\" else c for c in prefix)
    return argv[:3] + [user] + [a.replace(r"delay\.", escaped + r"\.") for a in argv[4:]]


@contextlib.contextmanager
def role_user(broker_ctl, role: str, chain: ChainSettings):
    """A user of its own with `role`'s line for the chain's prefix: (its name, its URL);
    deleted afterwards, also when the test fails."""
    user, password = f"{role}-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    broker_ctl("add_user", user, password)
    try:
        broker_ctl(*role_line(role, chain.prefix, user))
        parts = urlsplit(broker_url())
        yield user, urlunsplit(parts._replace(netloc=f"{user}:{password}@{parts.hostname}:{parts.port or 5672}"))
    finally:
        broker_ctl("delete_user", user)


def run_as(url: str, chain: ChainSettings, *args: str) -> subprocess.CompletedProcess:
    """The real CLI as that user, trusting the records of the gateway's (the suite's URL's)."""
    return gateway_cli(*args, *chain_args(chain), "--url", url, "--gateway-user", user_of(broker_url()))


def one_refusal(r: subprocess.CompletedProcess, verb: str, user: str, permission: str, kind: str, name: str,
                role: str) -> None:
    """Exit 3 and one line naming the one permission missing: no traceback, nothing else."""
    assert r.returncode == 3 and r.stdout == "", (r.returncode, r.stdout, r.stderr)
    verbs = {"read": "read", "write": "write to", "configure": "configure"}
    assert r.stderr.splitlines() == [
        f"delay-gateway {verb}: user {user!r} may not {verbs[permission]} {kind} {name!r} in vhost '/': grant it "
        f"{permission} permission on that name (docs/security.md: {role})"], r.stderr


def publish_refused(url: str, exchange: str, routing_key: str, body: bytes, **props) -> int:
    """Publish with confirms as that user: the reply code the broker closed the channel with."""
    with pika.BlockingConnection(pika.URLParameters(url)) as connection:
        channel = connection.channel()
        channel.confirm_delivery()
        try:
            channel.basic_publish(exchange, routing_key, body, pika.BasicProperties(**props), mandatory=True)
        except pika.exceptions.ChannelClosedByBroker as exc:
            return exc.reply_code
    return 0


def done_key_of(row: dict) -> bytes:
    """The done key (index_records.KEY) of a listed message, from its handle."""
    raw = base64.b32decode(row["handle"][1:].upper() + "====")
    return index_records.KEY.pack(*cancels_struct.unpack(raw))


def signers(stream: str) -> collections.Counter:
    """How many records of `stream` (up to its end) each user_id signed (None: unsigned), read
    back through the broker: the user_id survives a stream, with the arrival stamp too
    (RabbitMQ 4.3's interceptor re-encodes the headers)."""
    found: collections.Counter = collections.Counter()
    with connect() as connection:
        ends = inventory.stream_ends(connection, [stream])
        inventory.read_stream(connection, stream, "first", ends.offsets[stream],
                              lambda properties, body: found.update([writers.user_of(properties.wire)]))
    return found


def test_a_looker_reads_with_read_permission_only_and_trusts_only_the_gateway(make_chain, run_gateway,
                                                                             broker_ctl):
    """The looker's line lists, counts, exports and shows the rules, exactly; without one of
    its three read rights the command says which, in one line, exit 3. It can append
    nothing. Another user with write on `<prefix>.waiting` appends a done key for a waiting
    message and a beat (signed with its user, and a done key unsigned, as before 1.0): the
    message stays listed, and the answer says what it passed over."""
    chain = make_chain(max_level=4, resolution_ms=250)
    run_gateway(chain)
    t0 = now_ms()
    with connect() as c:
        ch = c.channel()
        ch.confirm_delivery()
        for mid in ("look-1", "look-2"):
            ch.basic_publish(chain.names.check_in, f"orders.{mid}", b"x", pika.BasicProperties(
                message_id=mid, delivery_mode=2, headers={"x-deliver-at": t0 + 600_000}), mandatory=True)

    def counted(url: str) -> dict:
        r = run_as(url, chain, "pending", "count", "--json")
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)
    wait_until(lambda: (lambda found: found["total"] == 2 and found["exact"])(counted(broker_url())), 30, 0.2,
               "both listed, exactly")
    gateway_user = user_of(broker_url())
    for key in ["done"] + [band_key(b) for b in range(bands(chain))]:  # entries, keys, beats, marks: signed
        found = signers(chain.names.waiting_stream(key))
        assert set(found) == {gateway_user} and sum(found.values()) >= 1, (key, found)
    with role_user(broker_ctl, "looker", chain) as (user, url):
        found = counted(url)
        assert (found["total"], found["exact"], found["notes"]) == (2, True, []), found
        r = run_as(url, chain, "pending", "list", "--json")
        assert r.returncode == 0 and sorted(json.loads(x)["message_id"] for x in r.stdout.splitlines()) == [
            "look-1", "look-2"], r.stderr
        r = run_as(url, chain, "pending", "export", "-")
        assert r.returncode == 0 and len(r.stdout.splitlines()) == 2, r.stderr
        r = run_as(url, chain, "pending", "rules")
        assert r.returncode == 0 and "no live rule" in r.stdout, r.stderr
        assert publish_refused(url, chain.names.waiting, "done", index_records.pack_done([])) == 403
        line = role_line("looker", chain.prefix, user)
        for gone, stream in (("waiting\\..*|", chain.names.waiting_stream("done")),
                             ("|cancellations", chain.names.cancellations), ("|chains", chain.names.registry)):
            broker_ctl(*line[:-1], line[-1].replace(gone, ""))
            one_refusal(run_as(url, chain, "pending", "count"), "pending count", user, "read", "queue", stream,
                        "the looker's line")
        broker_ctl(*line)

        # Another user who may write to <prefix>.waiting: its records hide nothing.
        with role_user(broker_ctl, "canceller", chain) as (intruder, intruder_url):
            broker_ctl("set_permissions", "-p", "/", intruder, "^$", f"^{chain.prefix}\\.waiting$", "^$")
            [row] = [json.loads(x) for x in run_as(url, chain, "pending", "list", "--json", "--id", "look-1")
                     .stdout.splitlines()]
            done = index_records.pack_done([done_key_of(row)])
            assert publish_refused(intruder_url, chain.names.waiting, "done", done, user_id="guest") == 406
            beat = index_records.pack_beat(b"i" * 16, 3, t0 - 86_400_000, now_ms(), index_records.Consumers(), 0)
            for body, signed in ((done, True), (done, False), (beat, True)):
                assert publish_refused(intruder_url, chain.names.waiting, "done", body,
                                       **({"user_id": intruder} if signed else {})) == 0
        found = counted(url)
        assert found["total"] == 2 and not found["exact"], found
        assert found["notes"] == ["records from before 1.0 or from another user in the index: 1 unsigned record(s) "
                                  "read, 2 record(s) of another user ignored"], found
        r = run_as(url, chain, "pending", "list", "--json")
        assert sorted(json.loads(x)["message_id"] for x in r.stdout.splitlines()) == ["look-1", "look-2"]


def test_cancellers_cancel_ids_or_groups_as_their_lines_allow(make_chain, run_gateway, broker_ctl):
    """The canceller's line cancels its id (`delay-gateway cancel`); a rule it publishes to
    `<prefix>.rules` is refused by the broker (403), one it sends to `<prefix>.cancel` is
    parked and cancels nothing. The group canceller's line runs `pending cancel --key
    ... --yes`. A consumer's line receives what is due at its queue."""
    chain = make_chain(max_level=4, resolution_ms=250)
    run_gateway(chain)
    with role_user(broker_ctl, "consumer", chain) as (_, consumer_url), \
            role_user(broker_ctl, "canceller", chain) as (_, canceller_url), \
            role_user(broker_ctl, "group-canceller", chain) as (_, group_url):
        with pika.BlockingConnection(pika.URLParameters(consumer_url)) as connection:
            channel = connection.channel()
            queue = f"consumer.{chain.prefix}"
            channel.queue_declare(queue, exclusive=True)
            channel.queue_bind(queue, chain.names.pick_up, "#")
            t0 = now_ms()
            due = t0 + 12_000  # (after the cancels: each command takes a second or two)
            with connect() as c:
                ch = c.channel()
                ch.confirm_delivery()
                for mid, key in (("keep", "orders.1"), ("drop", "orders.2"), ("group-1", "group.1"),
                                 ("group-2", "group.2")):
                    ch.basic_publish(chain.names.check_in, key, b"x", pika.BasicProperties(
                        message_id=mid, delivery_mode=2, headers={"x-deliver-at": due}), mandatory=True)
            r = run_as(canceller_url, chain, "cancel", "drop")
            assert r.returncode == 0 and r.stdout.startswith("drop: sent (the broker confirmed it)"), r.stderr
            assert "may not read queue" in r.stderr  # (it may not see whether a gateway recorded it)
            rule = {"headers": {rules.NAME: "everything", rules.ALL: True}, "delivery_mode": 2}
            assert publish_refused(canceller_url, chain.names.rules, "", b"", **rule) == 403
            assert publish_refused(canceller_url, chain.names.cancel, "", b"", message_id="x", **rule) == 0
            parked = parked_report(chain)
            assert f"goes to {chain.names.rules!r}" in parked["messages"][0]["reason"], parked
            r = run_as(group_url, chain, "pending", "cancel", "--key", "group.#", "--yes", "--wait", "10")
            assert r.returncode == 0 and "recorded at" in r.stdout, r.stdout + r.stderr
            # the cancel and the rule as check-in recorded them: signed by the gateway (its
            # follower's own marks and tallies are not signed yet)
            recorded = collections.Counter()
            with connect() as c:
                stream = chain.names.cancellations
                ends = inventory.stream_ends(c, [stream])
                inventory.read_stream(c, stream, "first", ends.offsets[stream], lambda p, body: recorded.update(
                    [writers.user_of(p.wire)] if cancels.read_record(p.wire.headers) or rules.read_record(
                        p.wire.headers, body) else []))
            assert recorded == {user_of(broker_url()): 2}, recorded
            publish_sentinel(chain, due, absolute=True, routing_key="orders.zz")
            got: List[str] = []

            def sentinel() -> bool:
                method, properties, _ = channel.basic_get(queue, auto_ack=True)
                if method is not None and properties.message_id != SENTINEL:
                    got.append(properties.message_id)
                return method is not None and properties.message_id == SENTINEL
            wait_until(sentinel, due / 1000 - time.time() + 30, 0.05, "the sentinel at the consumer's queue")
            assert got == ["keep"], got  # the rule sent to the cancels by id cancelled nothing
