"""`ipdp helper run`: the helper of two-server studies (helper/ does the work)."""

from __future__ import annotations

import argparse

from ipdp.cli.common import lazy


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register `helper run` on the `ipdp` sub-command parser."""
    actions = sub.add_parser(
        "helper", help="The helper of two-server studies: open, check and fold the helper's "
        "shares in its own Redis.").add_subparsers(dest="action", required=True,
                                                   metavar="ACTION")
    run = actions.add_parser(
        "run", help="Serve the helper's HTTP API to the leader's aggregator.",
        description="Serve PUT /jobs/{id}, POST /jobs/{id}/commit, "
        "GET /studies/{id}/rounds/{round} (the leader's bearer token required) and /healthz. "
        "Settings come from IPDP_HELPER_* and IPDP_TRUSTED_STUDY_KEYS; the flags below override "
        "the first.")
    run.add_argument("--host", default=None, help="Listen address (IPDP_HELPER_HOST).")
    run.add_argument("--port", type=int, default=None, help="TCP port (IPDP_HELPER_PORT).")
    run.set_defaults(func=lazy("helper.service", "cmd_run"))
