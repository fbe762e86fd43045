"""Every command's `--help` explains itself: a description, and a help line for every option
and positional argument."""

from __future__ import annotations

import argparse
import subprocess
import sys

from ipdp.cli.main import Parser, build_parser


def undocumented(parser: argparse.ArgumentParser, path: str = "ipdp") -> list[str]:
    """The commands without a description and the arguments without help, under ``parser``."""
    missing = [] if parser.description else [f"{path}: no description"]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                missing += undocumented(child, f"{path} {name}")
        elif not action.help or action.help == argparse.SUPPRESS:
            missing.append(f"{path} {'/'.join(action.option_strings) or action.dest}: no help")
    return missing


def test_every_command_has_a_description_and_every_argument_a_help_line():
    assert undocumented(build_parser()) == []


def test_the_walk_reaches_nested_commands_and_names_what_is_missing():
    root = Parser(prog="ipdp", description="root")
    sub = root.add_subparsers(dest="command", metavar="COMMAND")
    group = sub.add_parser("group", help="A group.").add_subparsers(dest="action")
    leaf = group.add_parser("leaf")
    leaf.add_argument("--flag")
    leaf.add_argument("target")
    assert undocumented(root) == ["ipdp group leaf: no description", "ipdp group leaf --flag: no help",
                                  "ipdp group leaf target: no help"]


def test_a_subcommand_help_opens_with_its_description():
    out = subprocess.run([sys.executable, "-m", "ipdp.cli", "models", "--help"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    usage, description = out.split("\n\n")[:2]
    assert usage.startswith("usage: ipdp models")
    assert "norm constraint" in description
