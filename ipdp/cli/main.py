"""`ipdp`: one entry point per role. A command's module is imported only when it runs.

Every expected failure is an :class:`ipdp.errors.IpdpError`: printed as one line, no traceback,
exit status ``exc.exit_code`` (2 unless the error says otherwise). Building the parser imports
no role and no client library, so `ipdp --help` starts as fast as Python does
(tests/system/test_cli_errors.py checks the modules it leaves out).
"""

from __future__ import annotations

import argparse
import os
import sys

from ipdp.cli import (
    bench,
    credentials,
    dead_letters,
    demo,
    gateway,
    helper,
    keys,
    loadgen,
    models,
    study,
    up,
)
from ipdp.cli.common import START_THE_RUNTIME, check_backends, lazy
from ipdp.errors import BackendUnavailable, IpdpError


class SubCommands(argparse._SubParsersAction):
    """Sub-parsers whose `--help` opens with a description: the command's one-line help when it
    is given none of its own (tests/system/test_cli_help.py checks every command has one)."""

    def add_parser(self, name, **kwargs):
        if kwargs.get("description") is None and kwargs.get("help"):
            kwargs["description"] = kwargs["help"]
        return super().add_parser(name, **kwargs)


class Parser(argparse.ArgumentParser):
    """An argparse parser that takes no abbreviated flag and reports a flag it does not know
    itself, with its own usage: `ipdp demo --epsilion 1` shows `ipdp demo`'s usage, where
    argparse would hand the flag up to the top-level parser. Sub-parsers are of this class too
    (argparse makes them of their parent's class)."""

    def __init__(self, *args, **kwargs) -> None:
        # `--device 10` must not be taken for `--devices 10`.
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.register("action", "parsers", SubCommands)

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The command tree; `ipdp COMMAND --help` documents each one.

    With ``argv``, the commands whose flags come from their implementation (bench, soak, audit,
    loadgen) get their flags only if ``argv`` runs them, so a command imports only what it
    uses; without, every command is built in full."""
    words = None if argv is None else [a for a in argv if not a.startswith("-")][:2]
    parser = Parser(
        prog="ipdp",
        description="Differentially private model training by input perturbation, streamed "
        "through Kafka with sufficient statistics in Redis.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    study.add_commands(sub)
    keys.add_commands(sub)
    credentials.add_commands(sub)
    up.add_commands(sub)
    for role, text in (("aggregator", "Fold records into sufficient statistics in Redis."),
                       ("trainer", "Solve closed rounds and publish models.")):
        actions = sub.add_parser(role, help=text).add_subparsers(
            dest="action", required=True, metavar="ACTION")
        run = actions.add_parser("run", help=text + " Settings come from IPDP_* environment "
                                 "variables.")
        run.add_argument("--idle-exit", dest="idle_exit", type=float, default=None,
                         help="Exit after this many seconds without work (default: never).")
        run.set_defaults(func=lazy(f"{role}.service", "cmd_run"))
        if role == "aggregator":
            add_resume(actions)
    gateway.add_commands(sub)
    helper.add_commands(sub)
    loadgen.add_commands(sub, with_flags=words is None or words[:1] == ["loadgen"])
    models.add_commands(sub)
    dead_letters.add_commands(sub)
    demo.add_commands(sub)
    bench.add_commands(sub, words, two_server_soak=argv is not None and "--two-server" in argv)
    return parser


def add_resume(actions) -> None:
    """`ipdp aggregator resume`: the operator's answer to a partition paused for its log."""
    resume = actions.add_parser(
        "resume", help="Resume folding a partition the aggregator paused because its Kafka log "
        "was replaced or truncated: store where its unfolded records start.")
    resume.add_argument("--partition", type=int, required=True,
                        help="The records-topic partition to resume.")
    where = resume.add_mutually_exclusive_group(required=True)
    where.add_argument("--from-offset", dest="from_offset", type=int,
                       help="First offset of the current log to fold.")
    where.add_argument("--from-beginning", dest="from_beginning", action="store_true",
                       help="Fold the current log from its first retained record.")
    resume.set_defaults(func=lazy("aggregator.logs", "cmd_resume"))


def backends_needed(args: argparse.Namespace) -> tuple[str, ...]:
    """The backends a command needs, checked before it runs (ipdp.cli.common.check_backends)."""
    match (args.command, getattr(args, "action", None) or getattr(args, "study_command", None)):
        case ("aggregator" | "trainer", _):
            return ("redis", "kafka")
        case ("gateway", _):
            return () if args.openapi else ("kafka",)
        case ("loadgen", _):
            return () if args.via else ("kafka",)
        case ("models", _):
            return ("kafka",) if args.study is None else ("redis", "kafka")
        case ("dead-letters", _):
            return ("kafka",)
        case ("study", "create" | "close" | "delete"):
            return ("redis", "kafka")
        case ("study", "show" | "list") | ("credentials", _):
            return ("redis",)
    return ()


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point."""
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    try:
        from ipdp.process import setup_logging

        setup_logging()
        check_backends(args, backends_needed(args))
        return int(args.func(args) or 0)
    except BackendUnavailable as exc:
        print(f"ipdp {args.command}: {str(exc).rstrip('.')} — {START_THE_RUNTIME}",
              file=sys.stderr)
        return exc.exit_code
    except IpdpError as exc:
        print(f"ipdp {args.command}: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `ipdp … | head`: the reader left; say nothing more
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's exit flush must not raise again
        return 141  # 128 + SIGPIPE, as a shell reports a process a pipe killed


if __name__ == "__main__":
    sys.exit(main())
