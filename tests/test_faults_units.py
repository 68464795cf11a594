"""Pure parts of the fault-tolerance and security work: no broker needed."""

import argparse

import pika
import pytest

from gateway.core import envelope
from gateway.commands import parked
from gateway.core.envelope import Inside
from gateway.core.wire import Properties
from topology.names import Names
from gateway.settings import Tls
from gateway.urls import redact, urls_from, with_password


def test_password_file_replaces_the_url_password_and_is_redacted(tmp_path):
    secret = tmp_path / "password"
    secret.write_text("p@ss:w/rd%\n")
    args = argparse.Namespace(url="amqp://gw@a:5672/%2F, amqp://gw:old@b/%2F", password_file=str(secret),
                              tls_ca_file=None, tls_cert_file=None)
    urls = urls_from(args)
    assert [pika.URLParameters(u).credentials.password for u in urls] == ["p@ss:w/rd%"] * 2
    assert all("p@ss" not in redact(u) and "p%40ss" not in redact(u) for u in urls)
    assert with_password("amqp://h/", "x") == "amqp://guest:x@h/"


def test_missing_password_file_names_the_file_only(tmp_path):
    args = argparse.Namespace(url="amqp://gw@a/", password_file=str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="nope"):
        urls_from(args)


def test_tls_options_need_amqps_urls():
    args = argparse.Namespace(url="amqp://a/", password_file=None, tls_ca_file="ca.pem", tls_cert_file=None)
    with pytest.raises(ValueError, match="amqps"):
        urls_from(args)
    with pytest.raises(ValueError):  # a key without a certificate
        Tls(key_file="k.pem")




def message(key=b"k", reason=None, due=None) -> parked.Parked:
    user = Properties.build(message_id=key)
    return parked.Parked(1, envelope.inside(user, key, due, reason), b"", key)


def test_parked_selection_report_and_where_replay_sends_them():
    a, b = message(b"orders.eu", "unroutable: ...", 5), message(b"audit", "x-delay is 'soon', not a number")
    assert parked.selected(a, "unroutable", "orders.*") and not parked.selected(b, "unroutable", None)
    assert not parked.selected(a, None, "audit")
    r = parked.report([a, b, message(b"orders.eu", "unroutable: ...")])
    assert r["count"] == 3 and r["reasons"]["unroutable: ..."] == 2 and r["routing_keys"]["orders.eu"] == 2
    names = Names("d")
    exchange, key, props = parked.destination(a, names)  # it had a due time: to the distributor
    assert exchange == "d.distributor" and Inside(props).due_ms == 5 and Inside(props).error is None
    exchange, key, props = parked.destination(b, names)  # it had none: to check-in, as first sent
    assert (exchange, key, props.raw) == ("d.check-in", b"audit", Properties.build(message_id=b"audit").raw)
    assert message().reason == "(no reason recorded)"
