"""What device credentials cost: per request at the gateway, per record at the aggregator.

    python -m bench.credentials [--requests 2000] [--records 20000] [--http 2000]
    (or: ipdp bench credentials …)

Times, on this machine and in this process, one Ed25519 verification; the gateway's admission of
a request (``gateway.credentials.DeviceCredentials``: parse the Authorization header, verify or
find the cached credential, check the record ids against its slots) for a credential seen for
the first time and for one already verified; and the aggregator's stateless validation of a
poll (``aggregator.validate.Validator``) of one-record messages and of gateway containers, with
and without credentials. Figures are CPU time of this process (time.process_time). With
``--http N``, also N one-record requests over HTTP to an ``ipdp gateway`` child process on the
embedded broker, alternating a study without credentials and one that requires them (each
request a new device, so every credential is verified once): requests/s and the gateway's CPU
per request. Prints markdown tables; nothing is asserted.
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
    p.add_argument("--http", type=int, default=0, metavar="N",
                   help="Also post N one-record requests per study and run over HTTP to a "
                   "gateway child process (default 0: skip).")
    p.add_argument("--connections", type=int, default=8,
                   help="Client threads (keep-alive connections) for --http (default 8).")


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


def http_rows(requests: int, connections: int, runs: int = 2) -> list[tuple[str, float, float]]:
    """(study, requests/s, gateway CPU µs per request) of one-record POSTs, alternating a study
    without credentials and one that requires them, ``runs`` times each."""
    import os
    import subprocess
    import sys
    import tempfile
    import threading

    from bench.gateway_load import _cpu_seconds
    from ipdp import registry
    from ipdp.embedded import EmbeddedRuntime
    from ipdp.embedded.children import free_port
    from ipdp.kafka_io import ensure_topics, kafka_producer
    from ipdp.redis_io import redis_client
    from ipdp.settings import TopicSettings
    from ipdp.signing import generate_key_files
    from producer.gateway_client import GatewayClient

    with tempfile.TemporaryDirectory() as tmp, EmbeddedRuntime() as rt:
        key = generate_key_files(f"{tmp}/issuer")
        kafka = rt.kafka_settings()
        topics = TopicSettings(records="bench.cred.records", models="bench.cred.models",
                               dead_letter="bench.cred.dlq", studies="bench.cred.studies")
        ensure_topics(kafka, topics)
        plain = Study(study_id="bench-plain", **PARAMS)
        study = Study(study_id="bench-cred", require_credentials=True, **PARAMS)
        producer = kafka_producer(kafka)
        for s_ in (plain, study):
            registry.create_study(redis_client(rt.redis_settings()), producer, topics, s_)
        producer.close()
        now_ms = time.time_ns() // 1_000_000
        port = free_port()
        env = {**os.environ, **rt.env(), "IPDP_METRICS_PORT": "0", "IPDP_LOG_LEVEL": "WARNING",
               "IPDP_TOPIC_RECORDS": topics.records, "IPDP_TOPIC_MODELS": topics.models,
               "IPDP_TOPIC_DEAD_LETTER": topics.dead_letter, "IPDP_TOPIC_STUDIES": topics.studies,
               "IPDP_GATEWAY_HOST": "127.0.0.1", "IPDP_GATEWAY_PORT": str(port),
               "IPDP_GATEWAY_RATE_LIMIT_PER_S": "0",
               "IPDP_TRUSTED_CREDENTIAL_KEYS": key.public_b64}
        gw = subprocess.Popen([sys.executable, "-m", "ipdp.cli", "gateway"], env=env)
        rows = []
        try:
            url = f"http://127.0.0.1:{port}"
            with GatewayClient(url, timeout_s=5) as c:
                c.wait_ready(60, alive=lambda: gw.poll() is None)
                for s_ in (plain, study):
                    while c.study(s_.study_id) is None:
                        time.sleep(0.1)
            for _ in range(runs):
                for s_ in (plain, study):
                    tokens = [issue_credential(key, study.hash, now_ms, now_ms + 3_600_000)
                              for _ in range(requests)]
                    bodies = _records(s_, tokens, now_ms)
                    creds = [token_text(t) if s_.require_credentials else None for t in tokens]
                    refused: list[int] = []

                    def client(lo: int, s_=s_, bodies=bodies, creds=creds, refused=refused):
                        with GatewayClient(url) as c:
                            for i in range(lo, requests, connections):
                                answer = c.post_records(s_.study_id, bodies[i],
                                                        credential=creds[i])
                                if answer.status != 202:
                                    refused.append(answer.status)

                    threads = [threading.Thread(target=client, args=(lo,))
                               for lo in range(connections)]
                    cpu0, t0 = _cpu_seconds(gw.pid), time.perf_counter()
                    for t in threads:
                        t.start()
                    for t in threads:
                        t.join()
                    seconds = time.perf_counter() - t0
                    cpu = _cpu_seconds(gw.pid) - cpu0
                    if refused:
                        raise RuntimeError(f"the gateway refused {len(refused)} requests")
                    rows.append(("requires credentials" if s_.require_credentials
                                 else "no credentials", requests / seconds,
                                 cpu / requests * 1e6))
        finally:
            gw.terminate()
            try:
                gw.wait(timeout=30)
            except subprocess.TimeoutExpired:
                gw.kill()
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
    if args.http:
        print(f"\n#### Gateway over HTTP: {args.http} one-record requests per run, "
              f"{args.connections} connections, 1 worker, d = 14; each request a new device\n")
        print("| run | study | requests/s | gateway CPU µs per request |\n|---|---|---|---|")
        for i, (name, rate, us) in enumerate(http_rows(args.http, args.connections)):
            print(f"| {i + 1} | {name} | {rate:,.0f} | {us:.0f} |")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
