"""What the `delay-gateway` command prints, byte for byte, against files in tests/golden/:
every --help (the top level, each command, each verb of a command with verbs), the outputs
that need no broker (render in each format, explain, argument and environment errors with
their exit codes), and a few that do, with the random prefix and the clock taken out.

The files hold what the command printed when they were written; a change to any output
shows here as a diff. After a change that is meant, write them again:
`DELAY_GATEWAY_GOLDEN=write python -m pytest tests/test_cli_golden.py` (and read the diff).

The commands run in this process (a subprocess each would add seconds); one test runs
`python -m gateway --help` as a user does, to prove the two agree. Help text is wrapped to
the terminal's width: COLUMNS is fixed here.
"""

import io
import os
import re
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

from gateway.cli import COMMANDS, load, main

from .support import ROOT, broker_url, unique_prefix

GOLDEN = Path(__file__).parent / "golden"
WRITE = os.environ.get("DELAY_GATEWAY_GOLDEN") == "write"
COLUMNS = "100"


def helps() -> List[Tuple[str, List[str]]]:
    cases = [("help", ["--help"])]
    for name, command in COMMANDS.items():
        cases.append((f"help-{name}", [name, "--help"]))
        for verb in load(command.actions) if command.actions else ():
            cases.append((f"help-{name}-{verb}", [name, verb, "--help"]))
    return cases


# (golden file, argv, environment): each needs no broker (an error is said before connecting)
OFFLINE: List[Tuple[str, List[str], Dict[str, str]]] = [
    ("render-definitions", ["render"], {}),
    ("render-definitions-options", ["render", "--format", "definitions", "--vhost", "v1", "--prefix", "orders",
                                    "--max-level", "5", "--resolution-ms", "100", "--queue-type", "classic",
                                    "--zero-bits", "exchange", "--cancel-retention", "3600"], {}),
    ("render-terraform", ["render", "--format", "terraform", "--max-level", "6"], {}),
    ("render-operator", ["render", "--format", "operator", "--max-level", "4", "--cluster-name", "rabbit",
                         "--cluster-namespace", "mq", "--vhost", "v2"], {}),
    ("render-operator-secret", ["render", "--format", "operator", "--max-level", "3", "--connection-secret", "s"],
     {}),
    ("render-operator-no-cluster", ["render", "--format", "operator"], {}),
    ("render-bad-format", ["render", "--format", "nope"], {}),
    ("explain-3000", ["explain", "3000"], {}),
    ("explain-zero", ["explain", "0"], {}),
    ("explain-long", ["explain", "3000000000000", "--lead-ms", "10"], {}),
    ("explain-short-chain", ["explain", "123456", "--max-level", "3", "--resolution-ms", "7", "--zero-bits",
                             "exchange", "--queue-type", "classic"], {}),
    ("explain-env", ["explain", "5000"], {"DELAY_GATEWAY_MAX_LEVEL": "8", "DELAY_GATEWAY_LEAD_MS": "0"}),
    ("explain-carrier-wait", ["explain", "12100"], {}),
    ("explain-rate", ["explain", "5000", "--rate", "500"], {}),
    ("explain-bad-rate", ["explain", "5000", "--rate", "-1"], {}),
    ("explain-missing", ["explain"], {}),
    ("explain-not-integer", ["explain", "x"], {}),
    ("explain-too-long", ["explain", str(10 ** 20)], {}),
    ("explain-bad-level", ["explain", "1", "--max-level", "41"], {}),
    ("explain-bad-env", ["explain", "1"], {"DELAY_GATEWAY_MAX_LEVEL": "x"}),
    ("explain-bad-env-beaten", ["explain", "1", "--max-level", "4"], {"DELAY_GATEWAY_MAX_LEVEL": "x"}),
    ("no-command", [], {}),
    ("unknown-command", ["nosuch"], {}),
    ("unknown-flag", ["declare", "--nosuch"], {}),
    ("ambiguous-flag", ["declare", "--tls", "x"], {}),
    ("unknown-flag-of-another", ["declare", "--retire-after", "5"], {}),
    ("bad-boolean-env", ["run", "--help"], {"DELAY_GATEWAY_DECLARE": "maybe"}),
    ("bad-boolean-env-no-command", ["--help"], {"DELAY_GATEWAY_DECLARE": "maybe"}),
    ("declare-chain-before-url", ["declare", "--max-level", "30", "--url", "http://x"], {}),
    ("run-chain-before-url", ["run", "--max-level", "30", "--url", "http://x"], {}),
    ("delete-without-yes", ["delete"], {}),
    ("declare-not-amqp", ["declare", "--url", "http://localhost"], {}),
    ("declare-no-url", ["declare", "--url", " , "], {}),
    ("declare-tls-plain", ["declare", "--tls-ca-file", "ca.pem"], {}),
    ("declare-key-without-cert", ["declare", "--tls-key-file", "k.pem"], {}),
    ("declare-password-file", ["declare", "--password-file", "/nonexistent/secret"], {}),
    ("declare-bad-vhosts", ["declare", "--vhosts", "a,,b"], {}),
    ("publish-delay-and-at", ["publish", "--delay", "5", "--at", "6"], {}),
    ("publish-count-zero", ["publish", "--count", "0"], {}),
    ("publish-bad-header", ["publish", "--header", "novalue"], {}),
    ("publish-long-key", ["publish", "--routing-key", "k" * 300], {}),
    ("publish-too-long", ["publish", "--delay", str(10 ** 20)], {}),
    ("status-interval-zero", ["status", "--interval", "0"], {}),
    ("status-two-vhosts", ["status", "--vhosts", "a,b"], {}),
    ("migrate-not-amqp", ["migrate", "--url", "ftp://x"], {}),
    ("cancel-no-ids", ["cancel"], {}),
    ("cancel-bad-file", ["cancel", "--from-file", "/nonexistent/ids"], {}),
    ("parked-no-action", ["parked"], {}),
    ("parked-bad-action", ["parked", "look"], {}),
    ("pending-no-action", ["pending"], {}),
    ("move-bad-rabbitmqctl", ["move-from-plugin", "--rabbitmqctl", "'unclosed"], {}),
    ("move-bad-batch", ["move-from-plugin", "--batch", "0"], {}),
    ("move-to-missing", ["move"], {}),
    ("move-to-itself", ["move", "--url", "amqp://rabbit.old/%2F", "--to", "amqp://rabbit.old:5672/%2F"], {}),
    ("demo-bad-delays", ["demo", "--delays", "1,x"], {}),
    ("selftest-bad-url", ["selftest", "--url", "amqp://a,http://b"], {}),
]


def run(argv: List[str], environ: Dict[str, str], monkeypatch) -> str:
    """What `delay-gateway ARGV` prints and its exit code, as one text."""
    monkeypatch.setenv("COLUMNS", COLUMNS)
    monkeypatch.setenv("LINES", "50")
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(argv, environ=environ)
    return shown(code, out.getvalue(), err.getvalue())


def shown(code: int, out: str, err: str) -> str:
    return f"exit {code}\n--- stdout\n{out}--- stderr\n{err}"


def check(name: str, got: str) -> None:
    path = GOLDEN / f"{name}.txt"
    if WRITE:
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(got, encoding="utf-8")
    assert path.exists(), f"no {path.relative_to(ROOT)}: write it (this module's docstring)"
    assert got == path.read_text(encoding="utf-8")


@pytest.mark.parametrize("name,argv", helps(), ids=[name for name, _ in helps()])
def test_help(name, argv, monkeypatch):
    check(name, run(argv, {}, monkeypatch))


@pytest.mark.parametrize("name,argv,environ", OFFLINE, ids=[name for name, _, _ in OFFLINE])
def test_offline_output(name, argv, environ, monkeypatch):
    check(name, run(argv, environ, monkeypatch))


def test_python_m_gateway_prints_the_same_help():
    env = {k: v for k, v in os.environ.items() if not k.startswith("DELAY_GATEWAY_")}
    env["COLUMNS"] = COLUMNS
    r = subprocess.run([sys.executable, "-m", "gateway", "--help"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60, env=env)
    assert shown(r.returncode, r.stdout, r.stderr) == (GOLDEN / "help.txt").read_text(encoding="utf-8")


# -- with a broker: the random prefix and the clock taken out ----------------------------------
CLOCK = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC")
EPOCH_MS = re.compile(r"\b1\d{12}\b")  # a time in ms since 1970, from 2001 to 2286


def normalised(text: str, prefix: str) -> str:
    return EPOCH_MS.sub("EPOCH_MS", CLOCK.sub("CLOCK", text.replace(prefix, "PREFIX")))


def broker_steps(chain: List[str]) -> List[Tuple[str, List[str]]]:
    """(golden file, argv) in order: a chain declared under a new prefix, seen, and deleted."""
    return [
        ("broker-status-undeclared", ["status", *chain]),
        ("broker-declare", ["declare", *chain]),
        ("broker-status", ["status", *chain]),
        ("broker-status-json", ["status", "--json", "--no-index", *chain]),
        ("broker-migrate-dry-run", ["migrate", "--dry-run", *chain]),
        ("broker-migrate-other-chain", ["migrate", "--dry-run", *chain[:-2], "--resolution-ms", "200"]),
        ("broker-delete", ["delete", "--yes", *chain]),
    ]


@pytest.mark.brokers("rmq3.10", reason="the outputs are the same on every version: one is enough")
def test_broker_facing_outputs(broker, monkeypatch):
    prefix = unique_prefix()
    chain = ["--url", broker_url(), "--prefix", prefix, "--max-level", "4", "--resolution-ms", "100"]
    for name, argv in broker_steps(chain):
        check(name, normalised(run(argv, {}, monkeypatch), prefix))


def test_every_golden_file_is_read():
    read = {name for name, _ in helps()} | {name for name, _, _ in OFFLINE} | {name for name, _ in broker_steps([])}
    on_disk = {p.stem for p in GOLDEN.glob("*.txt")}
    assert on_disk <= read, f"golden files no test reads: {sorted(on_disk - read)}"
