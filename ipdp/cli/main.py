"""`ipdp`: one entry point per role. A command's module is imported only when it runs.

Every expected failure is an :class:`ipdp.errors.IpdpError`: printed as one line, no traceback,
exit status ``exc.exit_code`` (2 unless the error says otherwise).
"""

from __future__ import annotations

import argparse
import os
import sys

from ipdp.cli import bench, credentials, demo, gateway, keys, loadgen, models, study, up
from ipdp.cli.common import lazy
from ipdp.errors import IpdpError


def build_parser() -> argparse.ArgumentParser:
    """The whole command tree; `ipdp COMMAND --help` documents each one."""
    parser = argparse.ArgumentParser(
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
    loadgen.add_commands(sub)
    models.add_commands(sub)
    demo.add_commands(sub)
    bench.add_commands(sub)
    return parser


def add_resume(actions) -> None:
    """`ipdp aggregator resume`: the operator's answer to a partition paused for its log."""
    resume = actions.add_parser(
        "resume", help="Resume folding a partition the aggregator paused because its Kafka log "
        "was replaced or truncated: store where its unfolded records start.")
    resume.add_argument("--partition", type=int, required=True)
    where = resume.add_mutually_exclusive_group(required=True)
    where.add_argument("--from-offset", dest="from_offset", type=int,
                       help="First offset of the current log to fold.")
    where.add_argument("--from-beginning", dest="from_beginning", action="store_true",
                       help="Fold the current log from its first retained record.")
    resume.set_defaults(func=lazy("aggregator.logs", "cmd_resume"))


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point."""
    parser = build_parser()
    args = parser.parse_args(argv)
    from ipdp.process import setup_logging

    setup_logging()
    try:
        return int(args.func(args) or 0)
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
