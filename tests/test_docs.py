"""The documentation, checked (pure, fast): every relative link resolves, every
`delay-gateway ...` command line quoted in the docs parses with the real CLI parser, and
nothing in the repository points outside it."""

import argparse
import contextlib
import functools
import glob
import inspect
import io
import os
import re
import shlex
import subprocess
from typing import Callable, Dict, Iterator, List, Set, Tuple, cast

import pytest

from gateway import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def doc_files() -> List[str]:
    patterns = ["README.md", "BENCHMARKS.md", "CHANGELOG.md", "docs/*.md", "deploy/**/*.md"]
    found = {os.path.relpath(path, ROOT) for pattern in patterns
             for path in glob.glob(os.path.join(ROOT, pattern), recursive=True)}
    return sorted(found)


def read(relative: str) -> str:
    with open(os.path.join(ROOT, relative), encoding="utf-8") as f:
        return f.read()


# -- Markdown, as far as these checks need it -------------------------------------------------
FENCE = re.compile(r"^\s*(```|~~~)")


def lines_outside_code(text: str) -> Iterator[Tuple[int, str, bool]]:
    """(line number, line, inside a fenced code block) for every line."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        yield number, line, fenced


def transcripts(text: str) -> Set[int]:
    """Line numbers of the code blocks that are console transcripts (`$ command` lines)."""
    blocks: List[List[Tuple[int, str]]] = []
    for number, line, fenced in lines_outside_code(text):
        if fenced:
            if not blocks or blocks[-1][-1][0] != number - 1:
                blocks.append([])
            blocks[-1].append((number, line))
    return {number for block in blocks if any(line.lstrip().startswith("$ ") for _, line in block)
            for number, _ in block}


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip())
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(relative: str) -> Set[str]:
    seen: Dict[str, int] = {}
    result = set()
    for _, line, fenced in lines_outside_code(read(relative)):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if fenced or not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        result.add(base if n == 0 else f"{base}-{n}")
    return result


LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")


def links(relative: str) -> Iterator[Tuple[int, str]]:
    for number, line, fenced in lines_outside_code(read(relative)):
        if fenced:
            continue
        prose = INLINE_CODE.sub("", line)
        for m in LINK.finditer(prose):
            yield number, m.group(1)


GUIDES = ["docs/contract.md", "docs/operating.md", "docs/kubernetes.md", "docs/spark.md", "docs/security.md",
          "docs/development.md", "docs/how-it-works.md", "docs/reliability.md", "docs/migrating-from-the-plugin.md",
          "docs/cancelling.md", "docs/retries.md", "docs/upgrading.md"]


def test_the_docs_exist():
    files = doc_files()
    for required in ["README.md", "BENCHMARKS.md", "CHANGELOG.md"] + GUIDES:
        assert required in files


def test_every_relative_link_resolves():
    broken = []
    for relative in doc_files():
        for number, target in links(relative):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            resolved = os.path.normpath(os.path.join(os.path.dirname(relative), path)) if path else relative
            where = f"{relative}:{number}: {target}"
            if resolved.startswith(".."):
                broken.append(f"{where}: points outside the repository")
            elif not os.path.exists(os.path.join(ROOT, resolved)):
                broken.append(f"{where}: no such file")
            elif anchor and resolved.endswith(".md") and anchor not in anchors(resolved):
                broken.append(f"{where}: no heading with this anchor in {resolved}")
    assert not broken, "\n".join(broken)


# -- command lines ------------------------------------------------------------------------------
PROGRAM = re.compile(r"^(?:\S*/)?delay-gateway$")
SHELL_OPERATORS = {"|", "||", "&", "&&", ";", ">", ">>", "<", "2>"}
# Placeholders the docs use in command lines, and a value of the right kind for each.
PLACEHOLDERS = {"MS": "1000", "DELAY_MS": "1000", "EPOCH_MS": "1795324334323", "N": "1",
                "SECONDS": "1", "COMMAND": "run", "URL": "amqp://127.0.0.1/%2F", "ROWS_PER_S": "100"}
SAMPLE_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"


def command_lines(relative: str) -> Iterator[Tuple[int, str]]:
    """Every `delay-gateway ...` line: in code blocks (with continuation lines joined; in a
    console transcript only the `$ ` lines, not the output), and in inline code."""
    text = read(relative)
    in_transcript = transcripts(text)
    pending: List[str] = []
    start = 0
    for number, line, fenced in lines_outside_code(text):
        if fenced:
            if not pending and number in in_transcript and not line.lstrip().startswith("$ "):
                continue
            if pending:
                pending.append(line.strip())
            else:
                start = number
                pending = [line.strip()]
            if pending[-1].endswith("\\"):
                pending[-1] = pending[-1][:-1]
                continue
            joined, pending = " ".join(pending), []
            words = joined.lstrip("$ ").split()
            while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):  # VAR=value delay-gateway ...
                words.pop(0)
            if words and PROGRAM.match(words[0]) and len(words) > 1:
                yield start, " ".join(words)
        else:
            pending = []
            for m in INLINE_CODE.finditer(line):
                words = m.group(2).split()
                # `delay-gateway run: ...` is a message the command prints, not a command line
                if len(words) > 1 and PROGRAM.match(words[0]) and words[1] not in ("...", "…") \
                        and not words[1].endswith(":"):
                    yield number, m.group(2)


def argv_of(line: str) -> List[str]:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    argv = []
    for token in lexer:
        if token in SHELL_OPERATORS:
            break
        if token.startswith("$"):  # a shell variable: in these docs always a URL
            token = SAMPLE_URL
        argv.append(PLACEHOLDERS.get(token, token))
    return argv[1:]


@functools.cache
def real_parser() -> argparse.ArgumentParser:
    """The CLI's own parser, built without the environment (its defaults come from it)."""
    build = cast(Callable[..., argparse.ArgumentParser], cli.parser)
    return build({}) if inspect.signature(build).parameters else build()


def parse(argv: List[str]) -> str:
    """'' when the real parser takes argv, else what it said."""
    parser = real_parser()
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(argv)
    except SystemExit as exc:
        if exc.code:
            return err.getvalue().strip() or f"exit {exc.code}"
    return ""


def test_the_command_lines_are_found():
    found = {relative: list(command_lines(relative)) for relative in doc_files()}
    assert len(found["docs/operating.md"]) >= 20
    assert any("publish" in line for _, line in found["README.md"])
    assert argv_of("delay-gateway status --watch   # redrawn > every 2 s") == ["status", "--watch"]
    assert argv_of("delay-gateway render --format terraform > main.tf") == ["render", "--format", "terraform"]
    transcript = [line for _, line in command_lines("docs/operating.md") if "5999" in line]
    assert transcript and all(line.startswith("delay-gateway status --url") for line in transcript)


def test_every_quoted_command_line_parses():
    wrong = []
    for relative in doc_files():
        for number, line in command_lines(relative):
            try:
                said = parse(argv_of(line))
            except ValueError as exc:  # shlex: an unclosed quote
                said = f"not a shell command line: {exc}"
            if said:
                wrong.append(f"{relative}:{number}: {line}\n    {said}")
    assert not wrong, "\n".join(wrong)


BENCH = re.compile(r"(?:^|[\s`])((?:\S*/)?python3? -m bench [^`#>|]*)")


def bench_lines(relative: str) -> Iterator[Tuple[int, str]]:
    """Every `python -m bench ...` line, in code blocks and in inline code."""
    for number, line, fenced in lines_outside_code(read(relative)):
        spans = [line] if fenced else [m.group(2) for m in INLINE_CODE.finditer(line)]
        for span in spans:
            m = BENCH.search(span)
            if m:
                yield number, m.group(1).strip()


def parse_bench(line: str) -> str:
    from bench import cli as bench_cli
    argv = argv_of(line.split(" -m ", 1)[1])  # argv_of drops the first word ("bench")
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            args = bench_cli.parser({}).parse_args(argv)
        bench_cli.expand(args.scenarios)
    except SystemExit as exc:
        if exc.code:
            return err.getvalue().strip() or f"exit {exc.code}"
    except ValueError as exc:
        return str(exc)
    return ""


def test_every_quoted_benchmark_command_parses():
    lines = [(relative, number, line) for relative in doc_files() for number, line in bench_lines(relative)]
    assert len(lines) >= 10
    wrong = [f"{relative}:{number}: {line}\n    {said}" for relative, number, line in lines
             for said in [parse_bench(line)] if said]
    assert not wrong, "\n".join(wrong)
    assert "unknown scenario" in parse_bench("python -m bench accuracy")


def test_a_wrong_command_line_is_caught():
    assert "invalid choice" in parse(argv_of("delay-gateway definitions"))
    assert parse(argv_of("delay-gateway publish --delay 5000 --routing-key a.b --body hi")) == ""


# -- nothing points outside the repository ------------------------------------------------------
OUTSIDE = [
    (re.compile(r"\.\./shared|/work/|shared notes|CONTRACT\.md"), "a file outside the repository"),
    (re.compile(r"\bissues? #?\d+", re.IGNORECASE), "an issue number a reader cannot see"),
    (re.compile(r"\bbranch(?:es)? `|\bon the `\w+` branch", re.IGNORECASE), "a branch a reader cannot see"),
]


def tracked_text_files() -> List[str]:
    try:
        listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        files = listed.split()
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: the docs at least
        files = doc_files()
    return [f for f in files if f.endswith((".md", ".py", ".yaml", ".yml", ".txt", ".toml", ".tpl", ".json"))
            and f != "tests/test_docs.py" and os.path.exists(os.path.join(ROOT, f))]


@pytest.mark.parametrize("pattern,what", OUTSIDE, ids=["files", "issues", "branches"])
def test_nothing_points_outside_the_repository(pattern, what):
    hits = []
    for relative in tracked_text_files():
        for number, line in enumerate(read(relative).splitlines(), 1):
            if pattern.search(line):
                hits.append(f"{relative}:{number}: {what}: {line.strip()}")
    assert not hits, "\n".join(hits)


def test_the_install_hint_is_the_one_that_works_from_a_clone():
    from gateway.spark import INSTALL
    assert "pip install -e" in INSTALL and "rabbitmq-delay-gateway[" not in INSTALL


def test_anchors_are_githubs():
    assert slug("What waits where: `delay-gateway status`") == "what-waits-where-delay-gateway-status"
    assert slug("Names (prefix `delay`)") == "names-prefix-delay"
    assert slug("Side by side with the plugin, 2026-11-22") == "side-by-side-with-the-plugin-2026-11-22"
    assert "changing-the-chain" in anchors("docs/operating.md")


# Sections the README once had and the guides in docs/ now hold: a pointer to one of them
# beside the word README is stale.
MOVED_SECTIONS = ["Changing the chain", "Changing the max level", "Least privilege", "Tested on",
                  "What survives what", "Performance", "How it works", "Data pipeline", "Operating it",
                  "Running it", "Settings table", "Kubernetes:"]


def test_no_pointer_to_a_readme_section_that_moved():
    stale = []
    for relative in tracked_text_files():
        for number, line in enumerate(read(relative).splitlines(), 1):
            if "README" in line:
                stale += [f"{relative}:{number}: {line.strip()}" for name in MOVED_SECTIONS if name in line]
    assert not stale, "\n".join(stale)


def test_the_readme_is_a_front_page_that_starts_with_the_two_commands():
    readme = read("README.md")
    assert len(readme.splitlines()) <= 250, "the README is a front page: move the detail into a guide in docs/"
    first_block = readme.split("```")[1]
    commands = [line.split("#")[0].strip() for line in first_block.splitlines()[1:] if line.strip()]
    assert commands == ["./scripts/run", "./scripts/test"]
    for guide in GUIDES:
        assert f"]({guide})" in readme, f"the README's table of guides does not link {guide}"
