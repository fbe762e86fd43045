"""`ipdp keys generate --out PREFIX [--helper]`: an Ed25519 key pair for signing studies or
models, or a helper's X25519 key pair that devices seal their shares to."""

from __future__ import annotations

import argparse


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register `keys` (generate) on the `ipdp` sub-parsers."""
    keys = sub.add_parser("keys", help="Keys that sign studies and models, or open a helper's "
                          "shares.", description="Keys that sign studies and models (Ed25519), "
                          "or open a two-server study's helper shares (X25519).")
    ksub = keys.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    p = ksub.add_parser(
        "generate", help="Write PREFIX.key (private, PKCS#8 PEM, mode 0600) and PREFIX.pub.",
        description="PREFIX.pub is one line, the standard base64 of the raw 32-byte public key: "
        "pin a signing key on devices (--trust, IPDP_TRUSTED_STUDY_KEYS) or model consumers "
        "(IPDP_TRUSTED_MODEL_KEYS); a helper's (--helper) goes into a two-server study, and "
        "devices seal the helper's share of each record to it (HPKE, RFC 9180). Existing "
        "files are never overwritten.")
    p.add_argument("--out", required=True, metavar="PREFIX", help="Path prefix of both files.")
    p.add_argument("--helper", action="store_true",
                   help="An X25519 key pair for a two-server study's helper, instead of an "
                   "Ed25519 signing key.")
    p.set_defaults(func=cmd_keys_generate)


def cmd_keys_generate(args: argparse.Namespace) -> int:
    if args.helper:
        from ipdp.sealing import generate_helper_key_files

        helper = generate_helper_key_files(args.out)
        print(f"wrote {args.out}.key (private, mode 0600: the helper's alone) and {args.out}.pub")
        print(f"public key  {helper.public_b64}")
        return 0
    from ipdp.signing import generate_key_files

    key = generate_key_files(args.out)
    print(f"wrote {args.out}.key (private, mode 0600) and {args.out}.pub")
    print(f"key id      {key.key_id}")
    print(f"public key  {key.public_b64}")
    return 0
