"""Every name the docs use exists: imports in code blocks, dotted `lightning_varuna.*` names, the keyword
arguments of the package's classes in examples, and the `lightning-varuna` sub-commands and their options."""

from __future__ import annotations

import importlib
import inspect
import re
import shlex
from pathlib import Path

import pytest

import lightning_varuna
from lightning_varuna.cli import build_parser

ROOT = Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "benchmarks").glob("*.md"))]


def _code_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.DOTALL)


def _text(page: Path) -> str:
    return page.read_text()


def _import_lines(page: Path) -> list[str]:
    lines = [line.strip() for block in _code_blocks(_text(page), "python") for line in block.splitlines()]
    return [line for line in lines if re.match(r"(from lightning_varuna\S* import |import lightning_varuna)", line)]


def _dotted_names(page: Path) -> list[str]:
    return sorted(set(re.findall(r"`(lightning_varuna(?:\.\w+)+)", _text(page))))


def _resolve(dotted: str) -> object:
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        for attr in parts[split:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_in_code_blocks_work(page):
    for line in _import_lines(page):
        exec(line, {})  # raises ImportError naming what the docs promise and the package lacks


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_dotted_names_exist(page):
    for dotted in _dotted_names(page):
        _resolve(dotted)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_keyword_arguments_of_public_classes_exist(page):
    """``VarunaStrategy(micro_batch_size=2, ...)`` in the docs: every keyword is a parameter of the class."""
    text = _text(page)
    for name in lightning_varuna.__all__:
        parameters = inspect.signature(getattr(lightning_varuna, name)).parameters
        for call in re.finditer(rf"\b{name}\(", text):
            depth, end = 1, call.end()
            while depth and end < len(text):
                depth += {"(": 1, ")": -1}.get(text[end], 0)
                end += 1
            for keyword in re.findall(r"(?<![\w.=])(\w+)=(?!=)", text[call.end() : end]):
                assert keyword in parameters, f"{page.name}: `{name}({keyword}=...)` but {name} has no `{keyword}`"


def _cli_commands(page: Path) -> list[list[str]]:
    commands = []
    for block in _code_blocks(_text(page), "bash"):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.split(" #")[0].strip()
            if line.startswith("lightning-varuna "):
                commands.append(shlex.split(line)[1:])
    return commands


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_cli_commands_parse(page):
    parser = build_parser()
    for argv in _cli_commands(page):
        parser.parse_args(argv)  # exits with argparse's usage error on an unknown command or option


def test_the_checks_see_the_docs():
    """The checks above read what they should: the pages' imports, names, calls and commands."""
    assert any("VarunaStrategy" in line for line in _import_lines(ROOT / "README.md"))
    assert "lightning_varuna.pipeline.schedules" in _dotted_names(ROOT / "docs" / "pipelines.md")
    assert any(argv[0] == "profile" for argv in _cli_commands(ROOT / "docs" / "autoconfig.md"))


def test_every_command_line_option_has_help():
    """`lightning-varuna --help` and each `COMMAND --help` explain every command and option, in plain text."""
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    assert "``" not in parser.format_help()
    for name, command in commands.items():
        assert command.description, f"`lightning-varuna {name}` has no description"
        for action in command._actions:
            assert action.help, f"`lightning-varuna {name}` option {action.option_strings or action.dest} has no help"


def test_ci_runs_the_readmes_two_commands():
    """The README sets up in two commands, one that installs what is needed and trains the example and one that runs
    the tests, and `.ci/run` runs those very two."""
    (block, *_) = _code_blocks(_text(ROOT / "README.md"), "bash")
    commands = [line.split(" #")[0].strip() for line in block.splitlines() if line.strip()]
    assert len(commands) == 2, commands
    assert "pip install" in commands[0] and "examples/gpt.py" in commands[0] and "pytest" in commands[1]
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    for command in commands:
        assert command in ci, f"`.ci/run` does not run the README's `{command}`"
