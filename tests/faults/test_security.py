"""Credentials never in output, TLS with a CA and a client certificate, and a
least-privilege user whose permissions cover only the prefix: all on the private node."""

import os
import shlex
import subprocess
import sys
import tempfile
import uuid

import pika
import pytest

from topology import ChainSettings

from ..support import ROOT, GatewayProcess, Receiver, chain_args, connect, next_message, now_ms, parked_report


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
