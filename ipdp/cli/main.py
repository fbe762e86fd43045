"""`ipdp`: one entry point per role. A command's module is imported only when it runs.

Every expected failure is an :class:`ipdp.errors.IpdpError`: printed as one line, no traceback,
exit status ``exc.exit_code`` (2 unless the error says otherwise).
"""

from __future__ import annotations

import argparse
import sys

from ipdp.cli import bench, demo, loadgen, models, study, up
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
    up.add_commands(sub)
    for role, text in (("aggregator", "Fold records into sufficient statistics in Redis."),
                       ("trainer", "Solve closed rounds and publish models.")):
        p = sub.add_parser(role, help=text)
        run = p.add_subparsers(dest="action", required=True, metavar="ACTION").add_parser(
            "run", help=text + " Settings come from IPDP_* environment variables.")
        run.add_argument("--idle-exit", dest="idle_exit", type=float, default=None,
                         help="Exit after this many seconds without work (default: never).")
        run.set_defaults(func=lazy(f"{role}.service", "cmd_run"))
    loadgen.add_commands(sub)
    models.add_commands(sub)
    demo.add_commands(sub)
    bench.add_commands(sub)
    return parser


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


if __name__ == "__main__":
    sys.exit(main())
