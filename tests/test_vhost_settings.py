"""--vhosts / DELAY_GATEWAY_VHOSTS (pure): how the list is read, the URLs each command gets
from it, and the one-line errors that name the fix."""

import pytest

from gateway.cli import main, parser
from gateway.settings import settings_from, vhost_list
from gateway.urls import per_vhost, urls_from, vhost_of, with_vhost


def test_a_list_is_names_separated_by_commas_and_empty_is_the_urls_own():
    assert vhost_list("orders, billing ,/") == ("orders", "billing", "/")
    assert vhost_list("") == vhost_list("  ") == ()


@pytest.mark.parametrize("text,says", [
    ("a,,b", "has an empty name: separate the virtual hosts with single commas"),
    ("a,", "has an empty name"),
    ("a,b,a", "'a' named twice: name each virtual host once"),
    ("x" * 256, "longer than 255 bytes"),
])
def test_a_bad_list_says_what_is_wrong(text, says):
    with pytest.raises(ValueError, match=says):
        vhost_list(text)


def test_a_bad_list_in_the_environment_is_one_line_naming_the_variable(capsys):
    assert main(["run"], environ={"DELAY_GATEWAY_VHOSTS": "a,,b"}) == 2
    err = capsys.readouterr().err
    assert err == ("delay-gateway run: error: argument --vhosts/--vhost: 'a,,b' has an empty name: separate the "
                   "virtual hosts with single commas (from DELAY_GATEWAY_VHOSTS)\n")


def test_a_vhost_goes_into_the_urls_path_encoded():
    assert with_vhost("amqp://u:p@h:5672/%2F", "billing/eu") == "amqp://u:p@h:5672/billing%2Feu"
    assert with_vhost("amqp://h", "/") == "amqp://h/%2F"
    for name in ("billing/eu", "/", "a b", "ü"):
        assert vhost_of(with_vhost("amqps://h:5671/x", name)) == name
    assert vhost_of("amqp://h") == vhost_of("amqp://h/") == vhost_of("amqp://h/%2F") == "/"


def test_run_keeps_the_urls_and_serves_each_vhost():
    s = settings_from(parser({}).parse_args(["run", "--url", "amqp://a/,amqp://b/", "--vhosts", "x,y"]))
    assert s.urls == ("amqp://a/", "amqp://b/") and s.vhosts == ("x", "y")
    assert per_vhost(s.urls, s.vhosts) == (("x", ("amqp://a/x", "amqp://b/x")), ("y", ("amqp://a/y", "amqp://b/y")))
    assert per_vhost(s.urls, ()) == ((None, s.urls),)
    assert settings_from(parser({}).parse_args(["run"])).vhosts == ()


def test_a_command_of_one_vhost_takes_it_from_vhost_or_the_environment():
    args = parser({}).parse_args(["cancel", "m1", "--url", "amqp://a/%2F,amqp://b/%2F", "--vhost", "orders"])
    assert urls_from(args) == ("amqp://a/orders", "amqp://b/orders")
    args = parser({"DELAY_GATEWAY_VHOSTS": "orders"}).parse_args(["status", "--url", "amqp://a/%2F"])
    assert urls_from(args) == ("amqp://a/orders",)
    args = parser({}).parse_args(["status", "--url", "amqp://a/%2F"])
    assert urls_from(args) == ("amqp://a/%2F",)  # unset: the URL as given


@pytest.mark.parametrize("argv", [["publish", "--delay", "5"], ["cancel", "m1"], ["status"], ["parked", "list"],
                                  ["pending", "count"], ["move-from-plugin", "--dry-run"],
                                  ["move", "--to", "amqp://new/%2F", "--dry-run"]])
def test_several_vhosts_for_a_command_of_one_is_one_line_naming_the_fix(argv, capsys):
    assert main(argv, environ={"DELAY_GATEWAY_VHOSTS": "a,b"}) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "--vhosts names 2 virtual hosts (a, b; from DELAY_GATEWAY_VHOSTS unless given as a flag) and this " \
           "command works on one: name it with --vhost NAME" in err
