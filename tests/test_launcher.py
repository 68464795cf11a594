"""tests/launcher.py reads /metrics and /readyz only from its own gateway process."""

import http.server
import os
import threading

import pytest

from topology import ChainSettings

from .launcher import GatewayProcess, PortNotOurs, free_port, listening_inodes, socket_inodes

NOWHERE = "amqp://guest:guest@127.0.0.1:1/%2F"  # no broker: this gateway never gets ready


class Answer(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (the http.server name)
        body = b"ready\n" if self.path == "/readyz" else b"delay_gateway_connections_total 1.0\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def squatter():
    """Another process's listener, as far as a gateway is concerned: an HTTP server of ours
    that answers /readyz and /metrics on a port picked by free_port."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def test_an_answer_from_another_process_on_the_metrics_port_fails_loudly(squatter):
    port = squatter.server_address[1]
    assert set(listening_inodes(port, os.getpid())) <= socket_inodes(os.getpid())  # this process's listener
    gateway = GatewayProcess(ChainSettings(prefix="nowhere"), "--metrics-port", str(port), url=NOWHERE)
    try:
        with pytest.raises(PortNotOurs, match=f"port {port} answered"):
            gateway.wait_ready(timeout=20)
        with pytest.raises(PortNotOurs):
            gateway.metric("delay_gateway_connections_total")  # never the squatter's 1
    finally:
        gateway.kill()


def test_the_gateways_own_listener_is_found_among_its_sockets(make_chain, run_gateway):
    gateway = run_gateway(make_chain(max_level=2, resolution_ms=100))  # wait_ready checked the port
    listening = listening_inodes(gateway.port, os.getpid())
    assert listening and set(listening) <= socket_inodes(gateway.proc.pid)
    assert gateway.metric("delay_gateway_connections_total") >= 1
    assert gateway.terminate() == 0
    assert not socket_inodes(gateway.proc.pid)  # exited: it holds nothing any more
