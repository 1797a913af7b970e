"""Every sub-command's --help: each flag has help text, shows its default and its choices; one
spelling per concept across sub-commands; `schemoe --version`."""

from __future__ import annotations

import argparse

import pytest

from schemoe import __version__, cli
from schemoe.cliargs import show_default


def _parsers(parser: argparse.ArgumentParser, name: str = "schemoe"):
    yield name, parser
    for act in parser._actions:
        if isinstance(act, argparse._SubParsersAction):
            for sub, p in act.choices.items():
                yield from _parsers(p, f"{name} {sub}")


PARSERS = dict(_parsers(cli.build_parser()))
SKIP = (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)
FLAGS = [
    (name, act)
    for name, p in PARSERS.items()
    for act in p._actions
    if act.option_strings and not isinstance(act, SKIP) and act.help != argparse.SUPPRESS
]


@pytest.mark.parametrize(
    ("command", "action"), FLAGS, ids=[f"{n} {a.option_strings[-1]}" for n, a in FLAGS]
)
def test_every_flag_has_help_that_shows_its_default(command, action):
    assert action.help and action.help.strip(), f"{command} {action.option_strings}: no help"
    text = PARSERS[command].format_help()
    shown = show_default(action.default)
    if shown is not None:
        assert f"(default: {shown})" in " ".join(text.split()), (command, action.dest)
    if action.choices:
        assert "{" + ",".join(map(str, action.choices)) + "}" in text


def test_one_spelling_per_concept_across_sub_commands():
    seen = {opt for _, act in FLAGS for opt in act.option_strings}
    for old in ("--dim", "--hidden", "--compress", "--compress-backward", "--grad-compress"):
        assert old not in seen, old
    assert {"--model-dim", "--hidden-dim", "--compressor", "--compressors"} <= seen
    for _, act in FLAGS:  # the expert count: one default rule everywhere
        if "--experts" in act.option_strings and act.default is None:
            assert "2 per" in act.help


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"schemoe {__version__}"


def test_top_level_help_describes_the_tool_in_full_sentences():
    text = PARSERS["schemoe"].format_help()
    assert "Mixture-of-Experts" in text and "lists each command's flags" in text
    assert cli.DESCRIPTION.endswith(".")
