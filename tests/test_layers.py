"""The layers of the code (pure, fast): every module of gateway/, topology/ and bench/ read
with `ast`, the imports inside its functions too, against the rules of docs/development.md
(Layout); and every "module:name" the command table names resolves."""

import argparse
import ast
import inspect
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set, Tuple

import pytest

from gateway.cli import COMMANDS, load, own_arguments, parser
from gateway.settings import settings_from

ROOT = Path(__file__).resolve().parent.parent


def _modules() -> Dict[str, Path]:
    found = {}
    for top in ("gateway", "topology", "bench"):
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def imports(module: str) -> Iterator[Tuple[str, int]]:
    """(what `module` imports, line), anywhere in it: a module of ours, or another's name."""
    path = MODULES[module]
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, up level - 1
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            for alias in node.names:  # `from package import module` imports the module
                yield (f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base), node.lineno


def ours(name: str) -> Optional[str]:
    """The module of ours a name is in, if it is ours."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


GRAPH: Dict[str, Set[str]] = {m: {o for name, _ in imports(m) if (o := ours(name)) not in (None, m)}
                              for m in MODULES}


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


# Circles known today, each with what removes it; one that is gone must leave this list too.
KNOWN_CIRCLES: List[Set[str]] = []


def circles() -> List[Set[str]]:
    """The sets of modules that import each other, around (Tarjan's strongly connected components)."""
    order: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    found: List[Set[str]] = []

    def visit(m: str) -> None:
        order[m] = low[m] = len(order)
        stack.append(m)
        for t in sorted(GRAPH[m]):
            if t not in order:
                visit(t)
                low[m] = min(low[m], low[t])
            elif t in stack:
                low[m] = min(low[m], order[t])
        if low[m] == order[m]:
            part = set()
            while True:
                t = stack.pop()
                part.add(t)
                if t == m:
                    break
            if len(part) > 1:
                found.append(part)

    for m in sorted(MODULES):
        if m not in order:
            visit(m)
    return found


def test_the_reader_finds_every_module_and_the_imports_inside_functions():
    assert {"gateway.cli", "gateway.core.flow", "gateway.broker.run.worker", "topology", "bench.cli"} <= set(MODULES)
    # (worker imports upkeep inside `one`; commands/run imports the worker inside `main`)
    assert "gateway.broker.run.upkeep" in GRAPH["gateway.broker.run.worker"]
    assert "gateway.broker.run.worker" in GRAPH["gateway.commands.run"]
    assert "bench.clients" in GRAPH["bench.delayed"]  # (relative)


def test_no_import_circle():
    found = sorted(sorted(c) for c in circles())
    known = sorted(sorted(c) for c in KNOWN_CIRCLES)
    assert found == known, ("modules that import each other (imports inside functions count too): "
                            f"{[c for c in found if c not in known]}; known circles gone (remove them from "
                            f"KNOWN_CIRCLES): {[c for c in known if c not in found]}")


# (modules, what they must not import, why)
RULES = [
    ("gateway.core", ("gateway.broker", "gateway.commands", "pika"), "the core is pure: no I/O, no verbs"),
    ("gateway.broker", ("gateway.commands",), "the broker side serves the verbs, never the other way round"),
    ("topology", ("gateway",), "the topology stays below the gateway"),
    ("gateway.broker.plumbing", ("gateway.broker.run", "gateway.broker.tools"),
     "the plumbing is what the `run` process and the tools stand on"),
]


@pytest.mark.parametrize("modules, forbidden, why", RULES, ids=[r[0] for r in RULES])
def test_a_layer_imports_nothing_above_it(modules, forbidden, why):
    broken = [f"{MODULES[m].relative_to(ROOT)}:{line} imports {name}"
              for m in MODULES if within(m, modules)
              for name, line in imports(m) if any(within(name, f) for f in forbidden)]
    assert not broken, f"{why}: {broken}"


REFERENCES = [(verb, field, getattr(command, field)) for verb, command in COMMANDS.items()
              for field in ("run", "arguments", "actions") if getattr(command, field) is not None]


@pytest.mark.parametrize("verb, field, reference", REFERENCES, ids=[f"{v}-{f}" for v, f, _ in REFERENCES])
def test_every_reference_of_the_command_table_resolves(verb, field, reference):
    module, colon, name = reference.partition(":")
    assert colon and module in MODULES and name, f"{verb}: {field} {reference!r} is not an existing module:name"
    found = load(reference)  # (the Spark verbs' modules import PySpark: the test environment has it)
    if field == "actions":
        assert isinstance(found, dict) and found, reference
        assert all(isinstance(text, str) and callable(add) for text, add in found.values()), reference
    else:
        assert callable(found), reference


LINES = [(name, verb) for name, command in COMMANDS.items()
         for verb in (list(load(command.actions)) if command.actions else [None])]


@pytest.mark.parametrize("name, verb", LINES, ids=[" ".join(filter(None, line)) for line in LINES])
def test_every_command_takes_the_settings_and_what_its_parser_gives(name, verb):
    """What cli.main hands a command (the Settings, its own arguments as keywords) binds to its
    `run`, and to the `Options` its module types them with, for every command and verb: a
    renamed option, parameter or field fails here, not in use."""
    words = [name] + ([verb] if verb else [])
    p = parser({}, " ".join(words))
    sub = subparsers(p)[name]
    if verb:
        sub = subparsers(sub)[verb]
    positionals = [a for a in sub._actions if not a.option_strings and not isinstance(a, argparse._SubParsersAction)]
    required = [[a.option_strings[0], "1"] for a in sub._actions if a.option_strings and a.required]
    # (a value each: what it means is not the point)
    args = p.parse_args(words + ["1"] * len(positionals) + [w for pair in required for w in pair])
    run = load(COMMANDS[name].run)
    inspect.signature(run).bind(settings_from(args), **own_arguments(args))
    options = getattr(sys.modules[run.__module__], "Options", None)  # (a verb's own arguments, typed)
    if options is not None:
        options(**own_arguments(args))


def subparsers(p: argparse.ArgumentParser) -> Dict[str, argparse.ArgumentParser]:
    return next(a for a in p._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_the_process_that_runs_all_day_does_not_import_numpy():
    """`run` carries only what it uses: numpy is for the verbs that read the index (`pending`,
    `status`: gateway/core/listing.py); imported by `run` it cost 12 MiB of RSS at rest and
    about 0.2 s at every start."""
    code = "import sys, gateway.broker.run.worker, gateway.commands.run; print(sorted(m for m in sys.modules " \
           "if m.split('.')[0] in ('numpy', 'pyarrow', 'pandas', 'pyspark')))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout[:500], r.stderr[-2000:])
