"""Pure parts of the fault-tolerance and security work: no broker needed."""

import argparse
import math

import pika
import pytest

from gateway import envelope, parked
from gateway.settings import Tls, redact, urls_from, with_password


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


def test_unencodable_headers_are_named_and_made_printable():
    props = pika.BasicProperties(headers={"ok": 1, "huge": 2 ** 70})
    problem = envelope.unencodable(props)
    assert problem and "'huge'" in problem and "'ok'" not in problem
    printable = envelope.printable_headers(props)
    assert envelope.unencodable(printable) is None and printable.headers["huge"] == repr(2 ** 70)


def test_float_delays_round_up_never_early():
    assert envelope.due_at({"x-delay": 1500.2}, 0) == 1501
    assert not math.isnan(envelope.due_at({"x-delay": -0.5}, 10))


def message(key="k", reason=None, due=None) -> parked.Parked:
    headers = {envelope.ROUTING_KEY: key}
    if reason:
        headers[envelope.ERROR] = reason
    if due:
        headers[envelope.DUE_AT] = due
    return parked.Parked(1, key, pika.BasicProperties(message_id=key, headers=headers), b"")


def test_parked_selection_report_and_replay_properties():
    a, b = message("orders.eu", "unroutable: ...", 5), message("audit", "x-delay is 'soon', not a number")
    assert parked.selected(a, "unroutable", "orders.*") and not parked.selected(b, "unroutable", None)
    assert not parked.selected(a, None, "audit")
    r = parked.report([a, b, message("orders.eu", "unroutable: ...")])
    assert r["count"] == 3 and r["reasons"]["unroutable: ..."] == 2 and r["routing_keys"]["orders.eu"] == 2
    replayed = parked.replay_properties(a.properties)
    assert envelope.ERROR not in replayed.headers and replayed.headers[envelope.DUE_AT] == 5
    assert message().reason == "(no reason recorded)"
