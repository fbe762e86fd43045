"""Two-server soak: SIGKILL the leader's aggregator, the helper, either Redis and the trainer
again and again under load; every record still folds once on each side and every closed round
is published once.

    python -m bench.two_server_soak --kills 50 --n 200        (or: ipdp soak --two-server ...)

Starts the embedded runtime (Kafka and the leader's Redis), a second redis-server for the
helper, a signed two-server study, and `ipdp helper run`, `ipdp aggregator run` and
`ipdp trainer run` (with the leader's token) as subprocesses. A load thread sends the study's
version-3 records through Kafka in small batches. Each kill waits until the aggregator has
folded more records (so it lands while folds run, not during a group join), then a random
moment, then SIGKILLs the next of the aggregator, the helper, the leader's redis-server, the
helper's redis-server and the trainer, in turn, and starts it again (a Redis on its port and
AOF, ``appendfsync always``). Then the load stops, everything drains, the trainer publishes
every closed round, and each invariant is checked:

* every record folded once on the leader (its folded count) and no helper commit left owed;
* every closed round holds exactly n on the helper, and on the leader until its model is
  published (the trainer deletes it then, having found count and checksum equal on both sides);
* every closed round was published exactly once: one ``{study}:{round}`` key per round on the
  models topic, any repeat of a key byte for byte the same value (which subscribers drop), each
  model of n records with a two-server report, ``ipdp:{S}:published`` naming every round and
  no refusal;
* the rounds (closed and open) hold every id sent, once (count and checksum);
* the helper's open round has the leader's open round's count and checksum;
* round by round, the helper's checksum and sum are those of the records in that round (with
  one records partition a round's records are fixed by their offsets; the test holds the
  helper's key, so it opens each share), and the open round's two sums, added, are the exact
  sum of its records.

Prints one table; exit status 1 if any invariant breaks.
"""

from __future__ import annotations

import argparse
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import redis
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from kafka import TopicPartition

from bench.soak import Service, _inherited_env, _wait
from helper.store import round_key
from ipdp import state
from ipdp.embedded.children import free_port
from ipdp.embedded.runtime import EmbeddedRuntime
from ipdp.embedded.servers import EmbeddedRedis
from ipdp.fixed_point import combine, fold
from ipdp.helper_protocol import id_checksum
from ipdp.kafka_io import kafka_consumer, kafka_producer, read_to_end
from ipdp.model_message import model_key, parse_model_value
from ipdp.redis_io import redis_client
from ipdp.report import table
from ipdp.sealing import generate_helper_key_files, open_share
from ipdp.settings import RedisSettings, TopicSettings
from ipdp.signing import SigningKey
from ipdp.study import Study
from ipdp.two_server_wire import decode_two_server_batch
from producer.contributor import Contributor

TOKEN = "two-server-soak-token"
DRAIN_TIMEOUT_S = 180.0


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} < 1: the soak needs at least one kill, and "
                                         "records to kill it over")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kills", type=_at_least_one, default=20, help="SIGKILLs, in turn of the aggregator, "
                   "the helper, the leader's Redis, the helper's Redis and the trainer "
                   "(default 20)")
    p.add_argument("--n", type=int, default=200, help="records per round (default 200)")
    p.add_argument("--d", type=int, default=3, help="dimension (default 3)")
    p.add_argument("--rate", type=float, default=400.0, help="records per second sent")
    p.add_argument("--max-batch", type=int, default=50,
                   help="the aggregator's IPDP_AGGREGATOR_MAX_BATCH: small, so kills land in "
                   "folds")
    p.add_argument("--max-delay", type=float, default=0.5,
                   help="largest random delay (s) between a fold seen and the kill")
    p.add_argument("--seed", type=int, default=37)
    p.add_argument("--dir", default=None, help="keep logs here (default: a temporary directory, "
                   "removed on success)")


class RedisVictim:
    """An embedded redis-server to SIGKILL and start again on its port and AOF."""

    def __init__(self, role: str, server: EmbeddedRedis) -> None:
        self.role, self.server = role, server

    def kill(self) -> None:
        self.server.proc.kill()
        self.server.proc.wait()

    def start(self) -> None:
        self.server.restart()


class Load(threading.Thread):
    """Sends the study's records through Kafka at ``rate`` until stopped; keeps every value."""

    def __init__(self, study: Study, kafka, topic: str, rate: float, seed: int) -> None:
        super().__init__(daemon=True)
        self.study, self.kafka, self.topic, self.rate = study, kafka, topic, rate
        self.rng = np.random.default_rng(seed)
        self.stop = threading.Event()
        self.sent = 0
        self.error: Exception | None = None

    def run(self) -> None:
        producer = kafka_producer(self.kafka)
        device = Contributor(self.study, producer, self.topic, records_per_device=10**9)
        chunk = 20
        try:
            while not self.stop.is_set():
                x = np.clip(self.rng.normal(0, 0.4, (chunk, self.study.d)), -0.5, 0.5)
                device.submit_many(x, np.clip(x.sum(axis=1), -1, 1))
                device.flush()
                self.sent += chunk
                self.stop.wait(chunk / self.rate)
        except Exception as exc:  # noqa: BLE001 - reported as a failed invariant
            self.error = exc
        finally:
            producer.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m bench.two_server_soak",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from ipdp.cli.common import UsageError, format_validation_error

    try:  # the study's parameters, checked before any server starts
        Study(study_id="soak-two", d=args.d, n=args.n, epsilon=1.0, delta=0.01)
    except ValidationError as exc:
        raise UsageError(format_validation_error(exc)) from None
    signal.signal(signal.SIGTERM, lambda s, _f: (_ for _ in ()).throw(SystemExit(128 + s)))
    work = Path(args.dir or tempfile.mkdtemp(prefix="ipdp-two-server-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    topics = TopicSettings(records_partitions=1)
    started = time.monotonic()
    with EmbeddedRuntime(work / "runtime", topics=topics) as rt, \
            EmbeddedRedis(data_dir=work / "helper-redis") as helper_redis:
        kafka, r = rt.kafka_settings(), redis_client(rt.redis_settings())
        hr = redis_client(RedisSettings(url=helper_redis.settings().url))
        owner = SigningKey(Ed25519PrivateKey.generate())
        key = generate_helper_key_files(work / "helper")
        port = free_port()
        study = Study(study_id="soak-two", d=args.d, n=args.n, epsilon=1.0, delta=0.01,
                      two_server={"helper_id": "helper-soak",
                                  "helper_url": f"http://127.0.0.1:{port}",
                                  "helper_key": key.public_b64})
        producer = kafka_producer(kafka)
        state.create_study(r, producer, topics, study, owner)
        producer.close()
        keys = state.StudyKeys(study.study_id)
        base = {**_inherited_env(), "IPDP_HELPER_LEADER_TOKEN": TOKEN,
                "IPDP_TRUSTED_STUDY_KEYS": owner.public_b64}
        helper = Service("helper", {**base, "IPDP_HELPER_HOST": "127.0.0.1",
                                    "IPDP_HELPER_PORT": str(port),
                                    "IPDP_HELPER_REDIS_URL": helper_redis.settings().url,
                                    "IPDP_HELPER_KEY_FILE": str(work / "helper.key")},
                         work / "helper.log")
        aggregator = Service("aggregator", {**base, **rt.env(),
                                            "IPDP_AGGREGATOR_MAX_BATCH": str(args.max_batch),
                                            "IPDP_AGGREGATOR_HELPER_RETRY_S": "1",
                                            "IPDP_AGGREGATOR_SESSION_TIMEOUT_MS": "6000"},
                             work / "aggregator.log")
        trainer = Service("trainer", {**base, **rt.env(), "IPDP_TRAINER_BLOCK_MS": "200",
                                      "IPDP_TRAINER_HELPER_WAIT_S": "5",
                                      "IPDP_TRAINER_HELPER_RETRY_S": "1"},
                          work / "trainer.log")

        def folded() -> int:
            try:
                return int(r.hget(keys.counts, "folded") or 0)
            except redis.RedisError:  # the leader's Redis restarting
                return -1

        load = Load(study, kafka, topics.records, args.rate, args.seed)
        victims = [aggregator, helper, RedisVictim("leader's Redis", rt.redis),
                   RedisVictim("helper's Redis", helper_redis), trainer]
        kills = dict.fromkeys((v.role for v in victims), 0)
        stalled = 0
        try:
            helper.start()
            aggregator.start()
            trainer.start()
            load.start()
            for kill in range(args.kills):
                before = folded()
                stalled += not _wait(lambda b=before: aggregator.check() or folded() > b, 60)
                time.sleep(rng.uniform(0.0, args.max_delay))
                victim = victims[kill % len(victims)]
                victim.kill()
                victim.start()
                kills[victim.role] += 1
                helper.check()
                aggregator.check()
                trainer.check()
            load.stop.set()
            load.join(timeout=60)
            drained = _wait(lambda: aggregator.check() or helper.check() or (
                folded() == load.sent and not r.hlen(keys.helper_pending)), DRAIN_TIMEOUT_S)
            published = _wait(lambda: trainer.check() or helper.check() or (
                r.hlen(keys.published) == int(r.hget(keys.counts, "rounds_closed") or 0)),
                DRAIN_TIMEOUT_S)
        finally:
            load.stop.set()
            aggregator.stop()
            trainer.stop()
            helper.stop()
        rows, ok = _invariants(r, hr, study, kafka, topics, key, load, drained and published)
        rows = [("records sent", str(load.sent)), ("records folded (leader)", str(folded())),
                *((f"{role} SIGKILLs", str(k)) for role, k in kills.items()),
                ("kills with no fold in the 60 s before", str(stalled)),
                *_log_events(work / "aggregator.log"),
                ("unasked exits", (f"aggregator {aggregator.died}, helper {helper.died}, "
                                   f"trainer {trainer.died}")),
                *rows, ("wall time", f"{time.monotonic() - started:.0f} s")]
        print(table(rows, f"two-server soak: n = {args.n}, d = {args.d}, {args.kills} kills"))
    if not ok or load.error is not None:
        print(f"\nan invariant broke (load: {load.error}); logs in {work}", file=sys.stderr)
        return 1
    print("\nall invariants held")
    if not args.dir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _invariants(r, hr, study: Study, kafka, topics, key, load: Load, settled: bool):
    """(table rows, whether every invariant held); ``settled``: drained and every closed round
    published or refused."""
    keys = state.StudyKeys(study.study_id)
    n = study.n
    values = _records(kafka, topics.records, load.sent)
    sent, _ = decode_two_server_batch(values, study.d)
    opened = np.stack([np.frombuffer(open_share(key.private, s, h.tobytes()), "<u8")
                       for s, h in zip(sent.sealed, sent.header, strict=True)])
    ids = [bytes(i) for i in sent.record_id]
    rounds = int(r.hget(keys.counts, "rounds_closed") or 0)
    unpublished = sorted(int(k.rsplit(b":", 1)[1]) for k in r.scan_iter(f"{keys.closed('*')}"))

    # Round k holds the records at offsets [(k − 1)·n, k·n): one records partition.
    helper_rounds_ok, leader_rounds_ok = True, True
    checksum = bytes(32)
    for round_no in range(1, rounds + 1):
        part = slice((round_no - 1) * n, round_no * n)
        help_ = hr.hgetall(round_key(study.study_id, round_no))
        helper_rounds_ok &= (
            int(help_.get(b"count", 0)) == n
            and help_.get(b"checksum") == id_checksum(ids[part])
            and np.array_equal(np.frombuffer(help_.get(b"sum", b""), "<u8"), fold(opened[part])))
        checksum = _xor(checksum, help_.get(b"checksum", bytes(32)))
        if round_no in unpublished:
            lead = r.hgetall(keys.closed(round_no))
            leader_rounds_ok &= (
                int(lead[b"count"]) == n and lead[b"checksum"] == help_.get(b"checksum")
                and np.array_equal(np.frombuffer(lead[b"sum"], "<u8"), fold(sent.leader[part])))
    count = rounds * n
    open_lead = r.hgetall(keys.open)
    open_ok = True
    open_exact = True
    if open_lead and int(open_lead[b"count"]):
        part = slice(rounds * n, None)
        open_help = hr.hgetall(round_key(study.study_id, int(open_lead[b"round"])))
        open_ok = (int(open_help.get(b"count", 0)) == int(open_lead[b"count"])
                   and open_help.get(b"checksum") == open_lead[b"checksum"])
        open_exact = (open_lead[b"checksum"] == id_checksum(ids[part]) and np.array_equal(
            combine(np.frombuffer(open_lead[b"sum"], "<u8"),
                    np.frombuffer(open_help.get(b"sum", b""), "<u8")),
            fold(combine(sent.leader[part], opened[part]))))
        checksum = _xor(checksum, open_lead[b"checksum"])
        count += int(open_lead[b"count"])
    every_id = (count == len(sent) == load.sent and checksum == id_checksum(ids))

    published = {int(k): v.decode() for k, v in r.hgetall(keys.published).items()}
    refused = sum(v.startswith("refused") for v in published.values())
    on_topic = _models(kafka, topics.models)
    want = {model_key(study.study_id, k) for k in range(1, rounds + 1)}
    models = {k: parse_model_value(v[0]) for k, v in on_topic.items() if k in want}
    repeats = sum(len(v) - 1 for v in on_topic.values())
    inexact = sum(len(set(v)) > 1 for v in on_topic.values())
    reports_ok = all(m.key == k and m.n == n and m.privacy.servers == "two-server"
                     for k, m in models.items())
    published_ok = (settled and set(on_topic) == want and not inexact and reports_ok
                    and sorted(published) == list(range(1, rounds + 1)) and not refused)
    rows = [("drained, every closed round published", str(settled)),
            ("closed rounds: n and their records' checksum and sum on the helper",
             f"{rounds}, {helper_rounds_ok}"),
            ("closed rounds not yet published (leader): n, helper's checksum, their sum",
             f"{len(unpublished)}, {leader_rounds_ok}"),
            ("models on the topic: rounds, repeats (differing)",
             f"{len(on_topic)}, {repeats} ({inexact})"),
            ("models of n records with a two-server report", str(reports_ok)),
            ("ipdp:{S}:published: rounds, refused", f"{len(published)}, {refused}"),
            ("every round published exactly once", str(published_ok)),
            ("open round equal on both sides", str(open_ok)),
            ("open round's combined sum = exact sum of its records", str(open_exact)),
            ("every id once on the leader", str(every_id))]
    return rows, (settled and helper_rounds_ok and leader_rounds_ok and published_ok
                  and open_ok and open_exact and every_id)


def _models(kafka, topic: str, timeout_s: float = 60.0) -> dict[bytes, list[bytes]]:
    """Every value on the models topic, by key, in topic order."""
    consumer = kafka_consumer(kafka, group_id=None)
    try:
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic))]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        out: dict[bytes, list[bytes]] = {}
        for m in read_to_end(consumer, tps, timeout_s=timeout_s):
            out.setdefault(m.key, []).append(m.value)
        return out
    finally:
        consumer.close()


def _records(kafka, topic: str, expected: int, timeout_s: float = 60.0) -> list[bytes]:
    """Every value of the one-partition ``topic``, read by count (tansu's end offsets can stop
    short of the last record)."""
    consumer = kafka_consumer(kafka, group_id=None)
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        consumer.seek_to_beginning(tp)
        out: list[bytes] = []
        deadline = time.monotonic() + timeout_s
        while len(out) < expected and time.monotonic() < deadline:
            for msgs in consumer.poll(timeout_ms=200).values():
                out += [m.value for m in msgs]
        return out
    finally:
        consumer.close()


#: What the aggregator's log says when a kill landed in the two-server protocol: its line's text.
_EVENTS = (("prepares retried (helper out of reach)", "helper prepare failed"),
           ("commits left owed in the journal", "is owed"),
           ("folds retried (leader's Redis gone)", "redis fold failed"),
           ("closed rounds announced after a restart", "closed rounds a crash had left"))


def _log_events(path: Path) -> list[tuple[str, str]]:
    """How often each of :data:`_EVENTS` appears in the aggregator's log."""
    text = path.read_text(encoding="utf-8", errors="replace")
    return [(label, str(text.count(needle))) for label, needle in _EVENTS]


def _xor(a: bytes, b: bytes) -> bytes:
    return (np.frombuffer(a, np.uint8) ^ np.frombuffer(b, np.uint8)).tobytes()


if __name__ == "__main__":
    sys.exit(main())
