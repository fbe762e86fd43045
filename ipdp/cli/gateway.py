"""`ipdp gateway`: the HTTP ingest service (gateway/ does the work)."""

from __future__ import annotations

import argparse
import sys

from ipdp.cli.common import lazy


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register `gateway` on the `ipdp` sub-command parser."""
    p = sub.add_parser(
        "gateway", help="Accept devices' records over HTTP and write them to Kafka.",
        description="Serve POST /studies/{id}/records, GET /studies/{id}, /healthz, /readyz, "
        "/metrics and /openapi.json. Settings come from IPDP_GATEWAY_*, IPDP_KAFKA_* and "
        "IPDP_TOPIC_*; the flags below override the first.")
    p.add_argument("--host", default=None, help="Listen address (IPDP_GATEWAY_HOST).")
    p.add_argument("--port", type=int, default=None, help="TCP port (IPDP_GATEWAY_PORT).")
    p.add_argument("--workers", type=int, default=None,
                   help="Worker processes (IPDP_GATEWAY_WORKERS).")
    p.add_argument("--openapi", action="store_true",
                   help="Print the OpenAPI document (docs/gateway-openapi.json) and exit.")
    p.set_defaults(func=cmd_gateway)


def cmd_gateway(args: argparse.Namespace) -> int:
    """`ipdp gateway`: print the OpenAPI document, or run the service."""
    if args.openapi:
        from gateway.openapi import openapi_text

        sys.stdout.write(openapi_text())
        return 0
    return lazy("gateway.service", "cmd_run")(args)
