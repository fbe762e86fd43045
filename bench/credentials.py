"""What device credentials cost: per request at the gateway, per record at the aggregator.

    python -m bench.credentials [--requests 2000] [--records 20000]   (or: ipdp bench credentials)

Times, on this machine and in this process, one Ed25519 verification; the gateway's admission of
a request (``gateway.credentials.DeviceCredentials``: parse the Authorization header, verify or
find the cached credential, check the record ids against its slots) for a credential seen for
the first time and for one already verified; and the aggregator's stateless validation of a
poll (``aggregator.validate.Validator``) of one-record messages and of gateway containers, with
and without credentials. Figures are CPU time of this process (time.process_time). Prints
markdown tables; nothing is asserted.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from aggregator.credentials import CredentialCheck
from aggregator.validate import NOT_IN_CONTAINER, Polled, Validator, split_containers
from gateway.checks import first_rejection
from gateway.credentials import DeviceCredentials
from ipdp.credentials import (
    AUTH_SCHEME,
    CREDENTIAL_ID,
    credentials_header,
    issue_credential,
    slot_record_ids,
    token_text,
)
from ipdp.signing import SigningKey, TrustedKeys
from ipdp.study import Study
from ipdp.wire import encode_batch, encode_container, study_headers

PARAMS = {"d": 14, "n": 1_000, "epsilon": 1.0, "delta": 0.01}
WINDOW_S, SKEW_S = 86_400, 300


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `ipdp bench credentials`."""
    p.add_argument("--requests", type=int, default=2_000,
                   help="Requests (distinct credentials) timed at the gateway (default 2000).")
    p.add_argument("--records", type=int, default=20_000,
                   help="Records (one credential each) in the aggregator's poll (default 20000).")


def _per_call_us(fn, calls: int) -> float:
    """CPU µs per call of ``fn()`` making ``calls`` calls (process time: other processes on a
    shared machine do not inflate it)."""
    started = time.process_time()
    fn()
    return (time.process_time() - started) / calls * 1e6


def _records(study: Study, tokens: list[bytes], now_ms: int) -> list[bytes]:
    """One record per token, in the token's slot 0."""
    ids = np.concatenate([slot_record_ids(t[CREDENTIAL_ID], 1) for t in tokens])
    rng = np.random.default_rng(0)
    q = rng.normal(size=(len(tokens), study.d)) * 0.05
    return encode_batch(study.hash, ids, np.full(len(tokens), now_ms), q, q)


def gateway_rows(requests: int) -> list[tuple[str, float]]:
    """µs per request of each part of the gateway's admission, one record per request."""
    key = SigningKey(Ed25519PrivateKey.generate())
    trusted = TrustedKeys([key.private.public_key()])
    study = Study(study_id="bench", require_credentials=True, **PARAMS)
    now_ms = time.time_ns() // 1_000_000
    tokens = [issue_credential(key, study.hash, now_ms, now_ms + 3_600_000)
              for _ in range(requests)]
    headers = [f"{AUTH_SCHEME} {token_text(t)}" for t in tokens]
    bodies = _records(study, tokens, now_ms)
    message = b"x" * 57
    signature = key.private.sign(message)
    public = key.private.public_key()

    def verify() -> None:
        for _ in range(requests):
            public.verify(signature, message)

    def admit(check: DeviceCredentials) -> None:
        for header, body in zip(headers, bodies, strict=True):
            _token, cred = check.admit(header, study)
            check.check_slots(body, study, cred)

    def records_check() -> None:
        for body in bodies:
            first_rejection(body, study)

    cold = DeviceCredentials(trusted)
    rows = [("one Ed25519 verification", _per_call_us(verify, requests)),
            ("per-record checks of a 1-record request (no credential)",
             _per_call_us(records_check, requests)),
            ("credential admission, first request of a credential",
             _per_call_us(lambda: admit(cold), requests)),
            ("credential admission, credential already verified",
             _per_call_us(lambda: admit(cold), requests))]
    return rows


def aggregator_rows(records: int) -> list[tuple[str, float]]:
    """µs per record of the aggregator's stateless validation of one poll."""
    key = SigningKey(Ed25519PrivateKey.generate())
    trusted = TrustedKeys([key.private.public_key()])
    plain = Study(study_id="plain", **PARAMS)
    study = Study(study_id="bench", require_credentials=True, **PARAMS)
    now_ms = time.time_ns() // 1_000_000
    tokens = [issue_credential(key, study.hash, now_ms, now_ms + 3_600_000)
              for _ in range(records)]
    values = _records(study, tokens, now_ms)
    plain_values = _records(plain, tokens, now_ms)

    def validator() -> Validator:
        by_hash = {plain.hash: plain, study.hash: study}
        return Validator(by_hash.get, lambda sid: True, replay_window_s=WINDOW_S,
                         max_future_skew_s=SKEW_S, max_message_bytes=1 << 20,
                         credentials=CredentialCheck(trusted, replay_window_s=WINDOW_S,
                                                     max_future_skew_s=SKEW_S))

    def polled(vals: list[bytes], heads: list) -> Polled:
        n = len(vals)
        return Polled(np.zeros(n, np.int64), np.arange(n, dtype=np.int64), vals,
                      np.full(n, NOT_IN_CONTAINER, np.int64), heads)

    singles = polled(values, [[*study_headers("bench"), credentials_header([(t, 1)])]
                              for t in tokens])
    plain_singles = polled(plain_values, [study_headers("plain")] * records)
    per = 1_000  # records per gateway container, one device (credential) per record
    containers, heads = [], []
    for lo in range(0, records, per):
        containers.append(encode_container(values[lo:lo + per]))
        heads.append([*study_headers("bench"),
                      credentials_header([(t, 1) for t in tokens[lo:lo + per]])])
    boxes = split_containers(polled(containers, heads))[0]

    def run(v: Validator, p: Polled) -> float:
        def validate() -> None:
            rejects, valid = v.validate(p, now_ms)
            if rejects or sum(len(x.row) for x in valid) != records:
                raise RuntimeError("the benchmark's records did not all pass")
        return _per_call_us(validate, records)

    v = validator()
    rows = [("no credentials (one-record messages)", run(v, plain_singles))]
    rows.append(("credentials, one-record messages, first sight", run(v, singles)))
    rows.append(("credentials, one-record messages, verified before", run(v, singles)))
    v = validator()
    rows.append((f"credentials, {per}-record gateway containers, first sight", run(v, boxes)))
    rows.append((f"credentials, {per}-record gateway containers, verified before",
                 run(v, boxes)))
    return rows


def run(args: argparse.Namespace) -> int:
    """Entry point of `ipdp bench credentials`."""
    print(f"#### Gateway: µs per request, d = 14, {args.requests} requests of one record, "
          "each with its own credential\n")
    print("| step | µs per request |\n|---|---|")
    for name, us in gateway_rows(args.requests):
        print(f"| {name} | {us:.1f} |")
    print(f"\n#### Aggregator: µs per record of the stateless validation, d = 14, {args.records} "
          "records, each with its own credential\n")
    print("| poll | µs per record |\n|---|---|")
    for name, us in aggregator_rows(args.records):
        print(f"| {name} | {us:.2f} |")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
