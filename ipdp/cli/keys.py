"""`ipdp keys generate --out PREFIX`: an Ed25519 key pair for signing studies or models."""

from __future__ import annotations

import argparse


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register `keys` (generate) on the `ipdp` sub-parsers."""
    keys = sub.add_parser("keys", help="Ed25519 keys that sign studies and models.")
    ksub = keys.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    p = ksub.add_parser(
        "generate", help="Write PREFIX.key (private, PKCS#8 PEM, mode 0600) and PREFIX.pub.",
        description="PREFIX.pub is one line, the standard base64 of the raw 32-byte public key: "
        "pin it on devices (--trust, IPDP_TRUSTED_STUDY_KEYS) or model consumers "
        "(IPDP_TRUSTED_MODEL_KEYS). Existing files are never overwritten.")
    p.add_argument("--out", required=True, metavar="PREFIX", help="Path prefix of both files.")
    p.set_defaults(func=cmd_keys_generate)


def cmd_keys_generate(args: argparse.Namespace) -> int:
    from ipdp.signing import generate_key_files

    key = generate_key_files(args.out)
    print(f"wrote {args.out}.key (private, mode 0600) and {args.out}.pub")
    print(f"key id      {key.key_id}")
    print(f"public key  {key.public_b64}")
    return 0
