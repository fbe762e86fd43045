"""What device credentials cost: per request at the gateway, per record at the aggregator.

    python -m bench.credentials [--requests 2000] [--records 20000] [--http SECONDS]
        [--connections 64] [--threads 2] [--repeat 1]        (or: ipdp bench credentials …)

Times, on this machine and in this process, one Ed25519 verification; the verification of a
new device's credential (``ipdp.credentials.CredentialVerifier``) for version-1 tokens (one
signature each) and version-2 tokens (batches of BATCH under one signature); the gateway's
admission of a request (``gateway.credentials.DeviceCredentials``: parse the Authorization
header, verify the credential (a version-1 token found in the verifier's cache when seen
before), check the record ids against its slots) for a
credential seen for the first time and for one already verified; and the aggregator's stateless
validation of a poll (``aggregator.validate.Validator``) of one-record messages and of gateway
containers, with and without credentials of either version. Figures are CPU time of this
process (time.process_time). With ``--http SECONDS``, also wrk (as in ``ipdp bench devices``)
posting one record per request for SECONDS to one ``ipdp gateway`` worker for a study without
credentials and for one that requires them, with version-2 then version-1 tokens, each request
a new device with its own credential (so every credential is verified once), and to a bare
Starlette endpoint before and after each of them, on the embedded broker, the aggregator paused
while wrk runs and folding the backlog after each server, as in ``ipdp bench devices``:
requests/s against the mean of the two bare runs around it, latency and the server's CPU per
request; then what the aggregator folded and dead-lettered of the credential study. Prints
markdown tables; nothing is asserted.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from aggregator.batch import NOT_IN_CONTAINER, Polled
from aggregator.credentials import CredentialCheck
from aggregator.validate import Validator, split_containers
from bench.devices import _LUA as DEVICES_LUA
from bench.devices import _lua_bytes
from gateway.checks import why_refused
from gateway.credentials import DeviceCredentials
from ipdp.calibration import record_norm_bounds
from ipdp.credentials import (
    AUTH_SCHEME,
    CredentialVerifier,
    credential_id,
    credentials_header,
    issue_batch,
    issue_credential,
    slot_record_ids,
    token_text,
)
from ipdp.settings import RecordWindowSettings
from ipdp.signing import SigningKey, TrustedKeys
from ipdp.study import Study
from ipdp.wire import RECORD_ID_BYTES, encode_container, study_headers
from producer.contributor import perturb_records

PARAMS = {"d": 14, "n": 1_000, "epsilon": 1.0, "delta": 0.01}
WINDOW_S, SKEW_S = 86_400, 300
#: Credentials per version-2 batch: a tree of height 10, tokens of 478 bytes.
BATCH = 1024


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `ipdp bench credentials`."""
    p.add_argument("--requests", type=int, default=2_000,
                   help="Requests (distinct credentials) timed at the gateway (default 2000).")
    p.add_argument("--records", type=int, default=20_000,
                   help="Records (one credential each) in the aggregator's poll (default 20000).")
    p.add_argument("--http", type=float, default=0, metavar="SECONDS",
                   help="Also drive, with wrk, a gateway for SECONDS per study kind, and a "
                   "bare Starlette endpoint for SECONDS before and after each, the yardstick "
                   "of that row (one-record requests; default 0: skip).")
    p.add_argument("--connections", type=int, default=64,
                   help="wrk's connections for --http (default 64).")
    p.add_argument("--threads", type=int, default=2, help="wrk's threads for --http (default 2).")
    p.add_argument("--repeat", type=int, default=1,
                   help="Repetitions of the --http set (default 1).")


def _per_call_us(fn, calls: int) -> float:
    """CPU µs per call of ``fn()`` making ``calls`` calls (process time: other processes on a
    shared machine do not inflate it)."""
    started = time.process_time()
    fn()
    return (time.process_time() - started) / calls * 1e6


def issue(key: SigningKey, study: Study, count: int, version: int) -> list[bytes]:
    """``count`` credentials valid for an hour: version 1, or version 2 in batches of BATCH."""
    now_ms = time.time_ns() // 1_000_000
    if version == 1:
        return [issue_credential(key, study.hash, now_ms, now_ms + 3_600_000)
                for _ in range(count)]
    return [t for lo in range(0, count, BATCH) for t in issue_batch(
        key, study.hash, now_ms, now_ms + 3_600_000, min(BATCH, count - lo))]


def _records(study: Study, tokens: list[bytes]) -> list[bytes]:
    """One perturbed record per token (the device step, seeded noise), in the token's slot 0."""
    ids = np.concatenate([slot_record_ids(credential_id(t), 1) for t in tokens])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(len(tokens), study.d)) / np.sqrt(study.d)
    return perturb_records(study, x, np.clip(x[:, 0], -1, 1), rng, ids)[1]


def gateway_rows(requests: int) -> list[tuple[str, float]]:
    """µs per request of each part of the gateway's admission, one record per request."""
    key = SigningKey(Ed25519PrivateKey.generate())
    trusted = TrustedKeys([key.private.public_key()])
    study = Study(study_id="bench", require_credentials=True, **PARAMS)
    now_ms = time.time_ns() // 1_000_000
    tokens = {version: issue(key, study, requests, version) for version in (1, 2)}
    message = b"x" * 57
    signature = key.private.sign(message)
    public = key.private.public_key()

    def verify() -> None:
        for _ in range(requests):
            public.verify(signature, message)

    def verify_new(verifier: CredentialVerifier, version: int) -> None:
        for token in tokens[version]:
            verifier.parsed(token)

    known_batches = CredentialVerifier(trusted)
    for token in tokens[2][::BATCH]:  # one device of each batch came before
        known_batches.parsed(token)

    def admit(check: DeviceCredentials, version: int) -> None:
        for header, body in zip(headers[version], bodies[version], strict=True):
            _token, cred = check.verify(header, study)
            check.check_slots(body, study, cred)

    headers = {v: [f"{AUTH_SCHEME} {token_text(t)}".encode() for t in tokens[v]] for v in (1, 2)}
    bodies = {v: _records(study, tokens[v]) for v in (1, 2)}
    window = RecordWindowSettings().window()
    _ = study.norm_bounds  # the gateway computes them when it reads the study, not in a request

    def records_check() -> None:
        for body in bodies[1]:
            why_refused(body, study, window, now_ms)

    cold = {v: DeviceCredentials(trusted) for v in (1, 2)}
    return [
        ("one Ed25519 verification", _per_call_us(verify, requests)),
        ("per-record checks of a 1-record request (no credential)",
         _per_call_us(records_check, requests)),
        ("verify a new device's credential, version 1",
         _per_call_us(lambda: verify_new(CredentialVerifier(trusted), 1), requests)),
        (f"verify a new device's credential, version 2 (batches of {BATCH}, each signature once)",
         _per_call_us(lambda: verify_new(CredentialVerifier(trusted), 2), requests)),
        ("verify a new device's credential, version 2, its batch verified before",
         _per_call_us(lambda: verify_new(known_batches, 2), requests)),
        ("credential admission, first request of a credential, version 1",
         _per_call_us(lambda: admit(cold[1], 1), requests)),
        (f"credential admission, first request of a credential, version 2 (batches of {BATCH})",
         _per_call_us(lambda: admit(cold[2], 2), requests)),
        ("credential admission, credential already verified (version 1)",
         _per_call_us(lambda: admit(cold[1], 1), requests)),
        ("credential admission, credential already verified (version 2)",
         _per_call_us(lambda: admit(cold[2], 2), requests)),
    ]


def aggregator_rows(records: int) -> tuple[list[tuple[str, float]], dict[int, int]]:
    """µs per record of the aggregator's stateless validation of one poll; and the bytes per
    device of the ``credentials`` header of a gateway container of one-record devices, per token
    version."""
    key = SigningKey(Ed25519PrivateKey.generate())
    trusted = TrustedKeys([key.private.public_key()])
    plain = Study(study_id="plain", **PARAMS)
    study = Study(study_id="bench", require_credentials=True, **PARAMS)
    now_ms = time.time_ns() // 1_000_000
    tokens = {version: issue(key, study, records, version) for version in (1, 2)}
    values = {version: _records(study, tokens[version]) for version in (1, 2)}
    plain_values = _records(plain, tokens[1])
    for s_ in (plain, study):  # the norm bounds are computed once per study in service
        record_norm_bounds(s_.calibration)

    by_hash = {plain.hash: plain, study.hash: study}

    def validator() -> Validator:
        return Validator(replay_window_s=WINDOW_S,
                         max_future_skew_s=SKEW_S, max_message_bytes=1 << 20,
                         credentials=CredentialCheck(trusted, replay_window_s=WINDOW_S,
                                                     max_future_skew_s=SKEW_S))

    def polled(vals: list[bytes], heads: list) -> Polled:
        n = len(vals)
        return Polled(np.zeros(n, np.int64), np.arange(n, dtype=np.int64), vals,
                      np.full(n, NOT_IN_CONTAINER, np.int64), heads)

    per = 1_000  # records per gateway container, one device (credential) per record
    singles, boxes, header_bytes = {}, {}, {}
    for version in (1, 2):
        singles[version] = polled(values[version], [
            [*study_headers("bench"), credentials_header([(t, 1)])] for t in tokens[version]])
        containers, heads = [], []
        for lo in range(0, records, per):
            containers.append(encode_container(values[version][lo:lo + per]))
            heads.append([*study_headers("bench"), credentials_header(
                [(t, 1) for t in tokens[version][lo:lo + per]])])
        header_bytes[version] = len(heads[0][-1][1]) // min(per, records)
        boxes[version] = split_containers(polled(containers, heads), 1 << 20)[0]
    plain_singles = polled(plain_values, [study_headers("plain")] * records)

    def run(v: Validator, p: Polled) -> float:
        def validate() -> None:
            rejects, valid = v.validate(p, v.decode(p), by_hash, {}, now_ms)
            if rejects or sum(len(x.row) for x in valid) != records:
                raise RuntimeError("the benchmark's records did not all pass")
        return _per_call_us(validate, records)

    rows = [("no credentials (one-record messages)", run(validator(), plain_singles))]
    for version in (1, 2):
        name = "version 1" if version == 1 else f"version 2 (batches of {BATCH})"
        for what, poll in (("one-record messages", singles[version]),
                           (f"{per}-record gateway containers", boxes[version])):
            v = validator()
            rows.append((f"credentials {name}, {what}, first sight", run(v, poll)))
            rows.append((f"credentials {name}, {what}, verified before", run(v, poll)))
    return rows, header_bytes


# A pool of (Authorization header, record id) pairs, one per device; wrk thread t sends entries
# t, t + threads, t + 2·threads, … so no two requests of a run share a credential.
_LUA = """
local prefix, suffix = "%(prefix)s", "%(suffix)s"
local pool = {}
%(pool)s
local threads, started, at = %(threads)d, 0, 0
wrk.method = "POST"
function setup(thread)
  thread:set("first", started)
  started = started + 1
end
function init(args)
  at = first
end
function request()
  local entry = pool[(at %% #pool) + 1]
  at = at + threads
  return wrk.format(nil, nil, {["Content-Type"] = "application/octet-stream",
                               ["Authorization"] = entry[1]}, prefix .. entry[2] .. suffix)
end
"""


def credential_script(study: Study, tokens: list[bytes], threads: int) -> str:
    """The wrk script posting one record per request, each in its own credential's slot 0."""
    record = _records(study, tokens[:1])[0]
    entries = [f'{{"{AUTH_SCHEME} {token_text(t)}", '
               f'"{_lua_bytes(slot_record_ids(credential_id(t), 1).tobytes())}"}}' for t in tokens]
    # A Lua function holds at most 65,536 constants (two per entry): one function per 10,000.
    pool = "\n".join(
        f";(function() local chunk = {{{','.join(entries[lo:lo + 10_000])}}} "
        "for i = 1, #chunk do pool[#pool + 1] = chunk[i] end end)()"
        for lo in range(0, len(entries), 10_000))
    done = DEVICES_LUA[DEVICES_LUA.index("function done"):]
    return (_LUA + done) % {"prefix": _lua_bytes(record[:RECORD_ID_BYTES.start]),
                            "suffix": _lua_bytes(record[RECORD_ID_BYTES.stop:]),
                            "pool": pool, "threads": threads}


def with_bare_reference(measured: list[dict]) -> list[dict]:
    """The runs of one repetition, each gateway run with ``bare_reference``: the mean
    requests/s of the bare runs just before and just after it (the one there is, at an end)."""
    for i, x in enumerate(measured):
        if x["server"] == "bare":
            x["bare_reference"] = x["requests_per_second"]
            continue
        near = [y["requests_per_second"] for y in (
            next((y for y in reversed(measured[:i]) if y["server"] == "bare"), None),
            next((y for y in measured[i + 1:] if y["server"] == "bare"), None)) if y]
        x["bare_reference"] = sum(near) / len(near)
    return measured


def http_rows(seconds: float, connections: int, threads: int, repeat: int) -> dict:
    """wrk against ``ipdp gateway`` (one worker, started afresh for each row) posting to a study
    without credentials and to one that requires them (a new device per request), and against a
    bare Starlette endpoint before and after each of those rows, ``repeat`` times, the aggregator
    paused while wrk runs; the runs (each gateway run with its ``bare_reference``) and the
    credential study's records."""
    import os
    import signal
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from aggregator.settings import AggregatorSettings
    from bench.devices import _stop, _wrk, start_server, wrk_script
    from bench.process_tree import cpu_seconds
    from ipdp import state
    from ipdp.embedded import EmbeddedRuntime
    from ipdp.kafka_io import ensure_topics, kafka_producer
    from ipdp.redis_io import redis_client
    from ipdp.settings import TopicSettings
    from ipdp.signing import generate_key_files

    runs = []
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRuntime() as rt:
        key = generate_key_files(f"{tmp}/issuer")
        kafka = rt.kafka_settings()
        topics = TopicSettings(records="bench.cred.records", models="bench.cred.models",
                               dead_letter="bench.cred.dlq", studies="bench.cred.studies")
        ensure_topics(kafka, topics)
        plain = Study(study_id="bench-plain", **{**PARAMS, "n": 10**8})
        study = Study(study_id="bench-cred", require_credentials=True, **{**PARAMS, "n": 10**8})
        r = redis_client(rt.redis_settings())
        producer = kafka_producer(kafka)
        for s_ in (plain, study):
            state.create_study(r, producer, topics, s_)
        producer.close()
        # More credentials than one run can use at this machine's rates (docs/benchmarks.md,
        # "Device credentials"), so no run reuses one: a reused credential would be
        # dead-lettered, not folded, and its 202 would not be a device's.
        tokens = {f"cred{v}": issue(key, study, int(seconds * per_s) * repeat, v)
                  for v, per_s in ((1, 16_000), (2, 40_000))}
        scripts = {name: Path(tmp) / f"{name}.lua" for name in ("plain", "cred1", "cred2")}
        scripts["plain"].write_text(wrk_script(plain))
        env = {**os.environ, **rt.env(), "IPDP_METRICS_PORT": "0", "IPDP_LOG_LEVEL": "WARNING",
               "IPDP_TOPIC_RECORDS": topics.records, "IPDP_TOPIC_MODELS": topics.models,
               "IPDP_TOPIC_DEAD_LETTER": topics.dead_letter, "IPDP_TOPIC_STUDIES": topics.studies,
               "IPDP_GATEWAY_RATE_LIMIT_PER_S": "0", "IPDP_GATEWAY_RECORD_LIMIT_PER_S": "1e9",
               "IPDP_GATEWAY_RECORD_LIMIT_BURST": "1000000000",
               "IPDP_TRUSTED_CREDENTIAL_KEYS": key.public_b64}
        aggregator = subprocess.Popen([sys.executable, "-m", "ipdp.cli", "aggregator", "run"],
                                      env=env)
        accepted = 0
        try:
            for rep in range(repeat):
                for name, pool in tokens.items():
                    per_run = len(pool) // repeat
                    scripts[name].write_text(credential_script(
                        study, pool[rep * per_run:(rep + 1) * per_run], threads))
                # Every row is a freshly started server, warmed up for a second: a row measures
                # what serving its kind of study costs, not what an earlier row left behind (a
                # worker that served version-1 devices first carries their cache into the
                # version-2 row). The bare endpoint runs before and after each gateway row,
                # which is read against the mean of the two: on a shared machine the same work
                # can take half again as long from one minute to the next, and a gateway row
                # read against one bare run measured 30 s earlier would read that drift as the
                # gateway's.
                bare = ("bare", "bare", plain, "plain")
                rows = [bare, ("gateway", "no credentials", plain, "plain"), bare,
                        ("gateway", f"requires credentials, version 2 (batches of {BATCH})",
                         study, "cred2"), bare,
                        ("gateway", "requires credentials, version 1", study, "cred1"), bare]
                measured = []
                for server, name, s_, script in rows:
                    proc, url = start_server(server, env)
                    try:
                        # As in `ipdp bench devices`: the aggregator waits while wrk runs (on
                        # two cores its CPU would go to the gateway's runs only) and folds
                        # the backlog after each run.
                        os.kill(aggregator.pid, signal.SIGSTOP)
                        _wrk(f"{url}/studies/bench-plain/records", scripts["plain"], 1.0,
                             connections, threads)  # warm-up
                        cpu0 = cpu_seconds(proc.pid)
                        figures = _wrk(f"{url}/studies/{s_.study_id}/records", scripts[script],
                                       seconds, connections, threads)
                        figures.update(repetition=rep + 1, server=name, cpu_us_per_request=(
                            cpu_seconds(proc.pid) - cpu0) / max(1, figures["requests"]) * 1e6)
                        measured.append(figures)
                        if script != "plain":
                            accepted += figures["accepted"]
                    finally:
                        _stop(proc)
                        os.kill(aggregator.pid, signal.SIGCONT)
                runs += with_bare_reference(measured)

            def count(field: str) -> int:
                return int(r.hget(state.StudyKeys(study.study_id).counts, field) or 0)

            def refused() -> dict[str, int]:
                return state.rejected_counts(r, AggregatorSettings().group, topics.records)

            # Every answered 202 is either folded or dead-lettered with its reason.
            deadline = time.monotonic() + 120
            while (count("folded") + sum(refused().values()) < accepted
                   and time.monotonic() < deadline):
                time.sleep(0.2)
            time.sleep(2)
            rejected = refused()
            folded = count("folded")
        finally:
            _stop(aggregator)
    return {"runs": runs, "accepted": accepted, "folded": folded, "rejected": rejected}


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
    rows, header_bytes = aggregator_rows(args.records)
    for name, us in rows:
        print(f"| {name} | {us:.2f} |")
    print("\nThe `credentials` header of a gateway container of one-record devices: "
          f"{header_bytes[1]:,} bytes per device with version-1 tokens, {header_bytes[2]:,} with "
          f"version-2 tokens (batches of {BATCH}).")
    if args.http:
        result = http_rows(args.http, args.connections, args.threads, args.repeat)
        print(f"\n#### Over HTTP: wrk -t{args.threads} -c{args.connections} -d{args.http:g}s, one "
              "d = 14 record per request, 1 gateway worker, the aggregator paused while wrk "
              "runs; with credentials each request is a new device\n")
        print("Each gateway row is read against the mean of the bare runs just before and after "
              "it (× bare).\n")
        print("| run | server | requests/s | × bare | p50 ms | p99 ms | server CPU µs per "
              "request | non-202 |\n|---|---|---|---|---|---|---|---|")
        for x in result["runs"]:
            name = "bare Starlette + uvicorn" if x["server"] == "bare" else \
                f"`ipdp gateway`, {x['server']}"
            ratio = "" if x["server"] == "bare" else \
                f"{x['requests_per_second'] / x['bare_reference']:.2f}"
            print(f"| {x['repetition']} | {name} | {x['requests_per_second']:,.0f} | {ratio} | "
                  f"{x['p50_us'] / 1000:.2f} | {x['p99_us'] / 1000:.2f} | "
                  f"{x['cpu_us_per_request']:.0f} | "
                  f"{x['status_errors'] + x['socket_errors']} |")
        print(f"\nThe credential study: {result['accepted']:,} requests answered 202, "
              f"{result['folded']:,} records folded; dead letters: {result['rejected'] or 'none'}.")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
