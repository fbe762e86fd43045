"""`ipdp demo --two-server`: a two-server study end to end, both trust domains on this machine.

The leader's domain is the embedded runtime (Kafka, the leader's Redis, `ipdp aggregator run`,
`ipdp trainer run`); the helper's is a second redis-server and `ipdp helper run`, with a key
pair of its own. The study is signed by a fresh owner key and names the helper (its URL and
public key); the simulated devices split every record into two shares and seal the helper's to
its key; the aggregator folds the leader's shares and has the helper fold the others; the
trainer combines the round's two sums. At the end the demo reads what each domain holds and
prints it next to the model: bytes that test as uniform where a share is, and the count and
checksum both sides agreed on.

Everything lives in the runtime directory (keys, logs, both Redis servers' data), which
stopping removes.
"""

from __future__ import annotations

import secrets
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ipdp.cli.demo import SERVER_STOP_S, Services, _create_study, _first_model

if TYPE_CHECKING:
    import argparse

    from ipdp.study import Study

#: Records read back from the records topic to show what the leader's domain holds of them.
SAMPLE_RECORDS = 2_000
#: The fields `ipdp demo` sets on its study.
_DEMO_FIELDS = ("study_id", "loss", "d", "n", "epsilon", "delta", "mode")


def byte_uniformity(data: bytes) -> tuple[float, int]:
    """Pearson's χ² statistic of the byte values of ``data`` against the uniform law, and its
    degrees of freedom (255): uniform bytes give 255 ± 23 (the law's mean ± one standard
    deviation, √(2·255)); an encoding of real numbers gives thousands."""
    import numpy as np

    counts = np.bincount(np.frombuffer(data, dtype=np.uint8), minlength=256)
    expected = len(data) / 256
    return float(((counts - expected) ** 2 / expected).sum()), 255


def run(args: argparse.Namespace, base: Study, devices: int, train) -> dict:
    """Run the two-server demo; the result's rows (the caller prints them)."""
    from ipdp import state
    from ipdp.embedded.children import free_port
    from ipdp.embedded.runtime import EmbeddedRuntime
    from ipdp.embedded.servers import EmbeddedRedis
    from ipdp.redis_io import redis_client
    from ipdp.report import calibration_rows, table, two_server_rows
    from ipdp.sealing import generate_helper_key_files
    from ipdp.signing import generate_key_files
    from ipdp.study import TwoServer
    from producer.loadgen import run_loadgen

    say = (lambda *_: None) if args.json else (lambda msg: print(msg, file=sys.stderr))
    with EmbeddedRuntime(stop_timeout_s=SERVER_STOP_S) as rt:
        directory = Path(rt.directory)
        owner = generate_key_files(directory / "study-owner")
        helper_key = generate_helper_key_files(directory / "helper")
        helper_port = free_port()
        # The same study, naming the helper (its calibration and encoding are filled in).
        study = type(base)(**{k: getattr(base, k) for k in _DEMO_FIELDS}, two_server=TwoServer(
            helper_id="demo-helper", helper_url=f"http://127.0.0.1:{helper_port}",
            helper_key=helper_key.public_b64))
        token = secrets.token_urlsafe(32)
        with EmbeddedRedis(data_dir=directory / "helper-redis",
                           stop_timeout_s=SERVER_STOP_S) as helper_redis:
            say(f"leader's domain: kafka {rt.broker.bootstrap}, redis {rt.redis.url}; "
                f"helper's domain: redis {helper_redis.url}, helper on port {helper_port} "
                f"(in {directory})")
            _create_study(rt, study, owner)
            say(table(calibration_rows(study.calibration) + two_server_rows(study),
                      title=f"study {study.study_id} (two-server)"))
            trust = {"IPDP_TRUSTED_STUDY_KEYS": owner.public_b64}
            with Services(rt, ("helper",), None, **trust, IPDP_HELPER_HOST="127.0.0.1",
                          IPDP_HELPER_PORT=str(helper_port),
                          IPDP_HELPER_REDIS_URL=helper_redis.url,
                          IPDP_HELPER_KEY_FILE=str(directory / "helper.key"),
                          IPDP_HELPER_LEADER_TOKEN=token) as helper, \
                    Services(rt, ("aggregator", "trainer"), None, **trust,
                             IPDP_HELPER_LEADER_TOKEN=token) as leader:
                _wait_for_helper(study.two_server.helper_url, helper)
                say(f"simulating {devices} devices: each splits its record into two shares and "
                    "seals the helper's to the helper's key …")
                sent = run_loadgen(study, rt.kafka_settings(), rt.topics, train.x, train.y,
                                   progress=not args.json)
                say(f"sent {sent.sent} records in {sent.seconds:.1f} s; waiting for the model …")
                model = _first_model(rt.kafka_settings(), rt.topics, study.study_id, leader)
                helper.check_alive()
                leader_redis = redis_client(rt.redis_settings())
                folded = int(leader_redis.hget(state.StudyKeys(study.study_id).counts,
                                               "folded") or 0)
                seen = _what_each_domain_holds(rt, study, redis_client(helper_redis.settings()),
                                               model.round, train)
    return {"study": study, "model": model, "sent": sent, "folded": folded, "domains": seen}


def _wait_for_helper(url: str, services: Services) -> None:
    """Until the helper answers /healthz (raising if it exited)."""
    import http.client
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    deadline = time.monotonic() + 60
    while True:
        services.check_alive()
        try:
            conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=2)
            try:
                conn.request("GET", "/healthz")
                if conn.getresponse().status == 200:
                    return
            finally:
                conn.close()
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the helper at {url} did not answer within 60 s")
        time.sleep(0.2)


def _what_each_domain_holds(rt, study: Study, helper_redis, round_no: int, train) -> dict:
    """What the leader's records topic and the helper's Redis hold, each as the χ² of its bytes
    against uniform (byte_uniformity), next to the same figure for the plain fixed-point
    encoding of the training rows, which is what a record would carry unshared."""
    from ipdp.fixed_point import encode
    from ipdp.losses import clip
    from ipdp.losses import encode as encode_rows
    from ipdp.two_server_wire import TwoServerLayout

    layout = TwoServerLayout(study.d)
    values = _first_values(rt.kafka_settings(), rt.topics.records, SAMPLE_RECORDS)
    q, p = clip(*encode_rows(study.loss, train.x[:len(values)], train.y[:len(values)]),
                study.lam, study.p_bound)
    plain, _ = encode(q, p, study.encoding)
    key = f"ipdp-helper:{{{study.study_id}}}:round:{round_no}"
    helper_sum = helper_redis.hget(key, "sum") or b""
    opened = sum(1 for k in helper_redis.scan_iter("ipdp-helper:job:*")
                 if helper_redis.hget(k, "shares"))
    return {
        "records_read": len(values),
        "leader_shares_chi2": byte_uniformity(b"".join(v[layout.leader] for v in values))[0],
        "sealed_helper_shares_chi2": byte_uniformity(
            b"".join(v[layout.sealed] for v in values))[0],
        "helper_round_sum_chi2": byte_uniformity(helper_sum)[0] if helper_sum else None,
        "helper_jobs_holding_opened_shares": opened,
        "plain_encoding_chi2": byte_uniformity(plain.astype("<u8").tobytes())[0],
    }


#: What each figure of `_what_each_domain_holds` is; printed next to it.
DOMAIN_LEGEND = {
    "records_read": "records read back from the leader's records topic",
    "leader_shares_chi2": "their leader shares (what the gateway, Kafka and the leader's "
                          "aggregator and Redis see of a record)",
    "sealed_helper_shares_chi2": "their helper shares, sealed to the helper's key (the leader "
                                 "cannot open them)",
    "helper_round_sum_chi2": "the helper's sum of shares of the published round (its Redis)",
    "helper_jobs_holding_opened_shares": "jobs in the helper's Redis still holding opened "
                                         "shares (dropped once committed into a round)",
    "plain_encoding_chi2": "for comparison: the same rows' fixed-point encoding, unshared, "
                           "which one-server mode's records carry in the clear",
}


def domain_table(seen: dict) -> str:
    """The figures of `_what_each_domain_holds` as a table with their meaning."""
    from ipdp.report import table

    values = {k: "-" if v is None else f"{v:,.0f}" for k, v in seen.items()}
    width = max(len(v) for v in values.values())
    rows = [(k, f"{v.rjust(width)}  {DOMAIN_LEGEND[k]}") for k, v in values.items()]
    return table(rows, title="what each domain holds: χ² of the byte values against uniform "
                 "(255 degrees of freedom; uniform bytes give 255 ± 23)")


def _first_values(kafka, topic: str, count: int) -> list[bytes]:
    """Up to ``count`` values of ``topic`` from its beginning (one record each, as the load
    generator sends them), reading for at most ten seconds."""
    from kafka import TopicPartition

    from ipdp.kafka_io import kafka_consumer

    consumer = kafka_consumer(kafka, group_id=None)
    try:
        parts = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic))]
        consumer.assign(parts)
        consumer.seek_to_beginning(*parts)
        values: list[bytes] = []
        deadline = time.monotonic() + 10
        while len(values) < count and time.monotonic() < deadline:
            for batch in consumer.poll(timeout_ms=200).values():
                values += [m.value for m in batch]
        return values[:count]
    finally:
        consumer.close()
