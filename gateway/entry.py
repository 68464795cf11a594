"""Where the `delay-gateway` command starts: a check of the installation, then the CLI.

The gateway's two import packages are `gateway` and `topology`; an unrelated PyPI
distribution is also called `topology` and installs an import package of that name. In one
Python environment the two share a directory, and whichever was installed last has
overwritten the other's files. That is said here, in one line, before anything imports
`topology` (the CLI does at once)."""

import sys
from importlib import metadata
from typing import Optional, Sequence

from gateway.exits import EXIT_REFUSED


def conflict() -> Optional[str]:
    """What is wrong with this installation, if anything."""
    try:
        other = metadata.distribution("topology")
    except metadata.PackageNotFoundError:
        return None
    return (f"the PyPI distribution `topology` {other.version} is installed in this Python environment, "
            "and its import package `topology` is the gateway's too: one overwrote the other's files. "
            "Install the gateway in an environment of its own (python3 -m venv, or pipx)")


def main(argv: Optional[Sequence[str]] = None) -> int:
    problem = conflict()
    if problem:
        print(f"delay-gateway: {problem}", file=sys.stderr)
        return EXIT_REFUSED
    from gateway.cli import main as cli_main
    return cli_main(argv)
