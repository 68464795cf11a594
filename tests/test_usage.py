"""Every command's help, and settings that cannot work: refused in one line that says the
fix, with exit 2, before anything touches a broker (in-process: no broker needed)."""

import pytest

from gateway.cli import COMMANDS, main


@pytest.mark.parametrize("command", [None] + sorted(COMMANDS))
def test_every_help_reads(command, capsys):
    assert main(([command] if command else []) + ["--help"], environ={}) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: delay-gateway")
    if command:
        assert COMMANDS[command].help in " ".join(out.split())
        assert not COMMANDS[command].help.rstrip().endswith("...")  # nothing left unsaid


@pytest.mark.parametrize("argv,says", [
    (["declare", "--max-level", "29"], "use max_level <= 28 at this resolution"),
    (["declare", "--resolution-ms", "400000000000"], "use resolution_ms <= 315360000000"),
    (["declare", "--resolution-ms", "0"], "0 is out of range (from 1 up)"),
    (["run", "--queue-type", "stream"], "'stream' is not one of quorum, classic"),
    (["status", "--zero-bits", "bits"], "'bits' is not one of queue, exchange"),
    (["declare", "--prefix", ""], "prefix must be 1 to 120 bytes long"),
    (["declare", "--prefix", "a b"], "must not contain white space"),
    (["run", "--max-level", "41"], "41 is out of range (from 1 to 40)"),
    (["publish", "--count", "0"], "0 is out of range (from 1 up)"),
    (["publish", "--header", "novalue"], "--header 'novalue': expected NAME=VALUE"),
    (["parked", "list", "--limit", "0"], "0 is out of range (from 1 up)"),
    (["demo", "--delays", "1,x"], "'x' in '1,x' is not a delay in ms"),
    (["status", "--interval", "0"], "must be above 0"),
    (["migrate", "--retire-after", "-1"], "-1.0 is below 0"),
    (["render", "--format", "yaml"], "invalid choice: 'yaml' (choose from"),
    (["declare", "--url", "http://rabbit/"], "is not an amqp:// or amqps:// URL"),
    (["delete"], "add --yes"),
])
def test_settings_that_cannot_work_are_refused_with_the_fix(argv, says, capsys):
    code = main(argv, environ={"DELAY_GATEWAY_URL": "amqp://guest:guest@127.0.0.1:1/%2F"})
    err = capsys.readouterr().err
    assert code == 2
    assert says in err
    assert len(err.strip().splitlines()) == 1, err


def test_a_bad_environment_value_names_the_variable(capsys):
    code = main(["declare"], environ={"DELAY_GATEWAY_QUEUE_TYPE": "stream"})
    err = capsys.readouterr().err
    assert code == 2
    assert "DELAY_GATEWAY_QUEUE_TYPE" in err and "'stream' is not one of quorum, classic" in err


def test_what_reads_the_environment_is_said_as_it_is(capsys):
    """Every setting reads its variable, and only the settings: the help and the README say
    so, not that every flag does (`--format` of render reads nothing)."""
    import os
    from gateway.settings import OPTIONS
    assert main(["--help"], environ={}) == 0
    top = " ".join(capsys.readouterr().out.split())
    assert "Every option also reads" not in top and "Every setting" in top, top
    with open(os.path.join(os.path.dirname(__file__), "..", "README.md"), encoding="utf-8") as f:
        readme = " ".join(f.read().split())
    assert "every flag also reads an environment variable" not in readme
    assert "every setting also reads an environment variable" in readme.lower()
    assert main(["render", "--help"], environ={}) == 0
    page = capsys.readouterr().out
    assert "DELAY_GATEWAY_FORMAT" not in page and "[DELAY_GATEWAY_PREFIX;" in " ".join(page.split())
    assert all(f"[{o.env};" in " ".join(page.split()) for o in OPTIONS if o.group == "chain")
