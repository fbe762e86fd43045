"""`ipdp credentials issue`: signed device credentials for a study that requires them."""

from __future__ import annotations

import argparse
import json
import sys
import time

from ipdp.cli.common import UsageError, add_redis_flag, redis_connection
from ipdp.errors import UnknownStudy


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register `credentials` (issue) on the `ipdp` sub-parsers."""
    creds = sub.add_parser("credentials", help="Device credentials for studies that require "
                           "them (docs/security.md).")
    csub = creds.add_subparsers(dest="credentials_command", required=True, metavar="ACTION")
    p = csub.add_parser(
        "issue", help="Print COUNT signed credentials for a study, one per line.",
        description="Run by whoever vouches for devices (the study owner or the app backend): "
        "give each vetted device one line. A credential is bound to the study's id and hash, "
        "expires after --valid-for seconds and lets its device contribute the study's "
        "records_per_device records. The gateway and the aggregator accept it only if they pin "
        "the issuer's public key (IPDP_TRUSTED_CREDENTIAL_KEYS).")
    p.add_argument("study_id", metavar="ID", help="The study the credential is for.")
    p.add_argument("--key", required=True, metavar="PREFIX.key",
                   help="The issuer's Ed25519 private key (`ipdp keys generate`).")
    p.add_argument("--count", type=int, default=1, help="How many credentials (default 1).")
    p.add_argument("--token-version", dest="token_version", type=int, choices=(1, 2),
                   default=None, help="1: one signature per credential (121-byte tokens); 2: "
                   "batches of up to 2^20 credentials under one signature (a Merkle tree; "
                   "158 + 32·⌈log2 batch⌉ bytes), which the gateway and the aggregator verify "
                   "with a few hashes per new device instead of a signature each. Default: 2 "
                   "when --count > 1.")
    p.add_argument("--valid-for", dest="valid_for", type=int, default=None, metavar="SECONDS",
                   help="Validity; at most the aggregator's replay window "
                   "(IPDP_AGGREGATOR_REPLAY_WINDOW_S), which is also the default.")
    p.add_argument("--json", action="store_true",
                   help="One JSON object per line: credential, credential_id, expires_ms.")
    add_redis_flag(p)
    p.set_defaults(func=cmd_credentials_issue)


def cmd_credentials_issue(args: argparse.Namespace) -> int:
    from aggregator.settings import AggregatorSettings
    from ipdp.credentials import (
        MAX_TREE_HEIGHT,
        credential_id,
        issue_batch,
        issue_credential,
        token_text,
    )
    from ipdp.settings import TrustSettings
    from ipdp.signing import load_signing_key
    from ipdp.state import load_study

    window_s = AggregatorSettings().replay_window_s
    valid_for = window_s if args.valid_for is None else args.valid_for
    if not 0 < valid_for <= window_s:
        raise UsageError(f"--valid-for {valid_for} must lie in 1 … {window_s} s, the "
                         "aggregator's replay window (IPDP_AGGREGATOR_REPLAY_WINDOW_S): a longer "
                         "credential could reuse its slots once the window forgets them")
    if args.count < 1:
        raise UsageError(f"--count {args.count} must be ≥ 1")
    key = load_signing_key(args.key)
    with redis_connection(args) as r:
        got = load_study(r, args.study_id, TrustSettings().study_keys())
    if got is None:
        raise UnknownStudy(f"unknown study {args.study_id!r}")
    study, _status = got
    if not study.require_credentials:
        raise UsageError(f"study {study.study_id!r} does not require credentials "
                         "(ipdp study create --require-credentials)")
    issued_ms = time.time_ns() // 1_000_000
    expires_ms = issued_ms + valid_for * 1000
    version = args.token_version or (2 if args.count > 1 else 1)
    most = 1 if version == 1 else 1 << MAX_TREE_HEIGHT
    for first in range(0, args.count, most):
        k = min(most, args.count - first)
        tokens = [issue_credential(key, study.hash, issued_ms, expires_ms)] if version == 1 \
            else issue_batch(key, study.hash, issued_ms, expires_ms, k)
        for token in tokens:
            if args.json:
                print(json.dumps({"credential": token_text(token),
                                  "credential_id": credential_id(token).hex(),
                                  "study_id": study.study_id, "expires_ms": expires_ms}))
            else:
                print(token_text(token))
    batches = "" if version == 1 else f" as {-(-args.count // most)} batch(es), one signature " \
        "per batch"
    print(f"issued {args.count} version-{version} credential(s){batches} for study "
          f"{study.study_id} by key {key.key_id}, valid for {valid_for} s, "
          f"{study.records_per_device} record(s) each", file=sys.stderr)
    return 0
