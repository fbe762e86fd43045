"""Soak: SIGKILL the aggregator hundreds of times under load; every record still counts once.

    python -m bench.soak --kills 200 --n 2000        (or: ipdp soak ...)

Starts the embedded runtime, a study, and a trainer and an aggregator as `ipdp ... run`
subprocesses. A load thread produces honest records at a steady rate with a few hostile ones mixed
in (replays of earlier records, undecodable bytes, NaN). The aggregator is SIGKILLed and restarted
at random moments: every other kill after a random delay from its start (start-up, group join,
seek or fold), the others soon after it has folded something (inside the fold loop). Then the
load stops, everything drains, and each invariant is checked against a clean refold of the exact
records produced:

* every honest record folded once: the count, and the statistics to 1e-9;
* every hostile record counted once under its reason, and on the dead-letter topic;
* every closed round has exactly n records and exactly one model (repeats dropped by key);
* no service exited on its own.

With one records partition (the default) a round's records are fixed by their offsets, so each
model is compared with a clean solve of exactly its n records and the open round with the rest.
With more partitions round membership depends on how batches interleave partitions, so the
trainer starts after the drain and models are compared with the closed rounds' statistics, whose
sum (with the open round) is compared with the clean refold.

Prints one table; exit status 1 if any invariant breaks.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

import numpy as np

from ipdp import state
from ipdp.dead_letters import read_dead_letters
from ipdp.embedded.runtime import EmbeddedRuntime
from ipdp.kafka_io import kafka_consumer, kafka_producer
from ipdp.redis_io import redis_client
from ipdp.report import table
from ipdp.settings import TopicSettings
from ipdp.study import Study
from ipdp.subscriber import ModelSubscriber
from ipdp.wire import RECORD_ID_BYTES, RejectReason, decode_batch
from producer.contributor import perturb_records
from trainer.solver import solve_constrained

REPO = Path(__file__).resolve().parents[1]
TOLERANCE = 1e-9
"""Largest difference from the clean refold, relative to its largest entry when that is > 1."""
DRAIN_TIMEOUT_S = 180.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `ipdp soak`."""
    p.add_argument("--kills", type=int, default=200, help="SIGKILLs of the aggregator (200).")
    p.add_argument("--n", type=int, default=2000, help="Records per round (2000).")
    p.add_argument("--d", type=int, default=6, help="Dimension (6).")
    p.add_argument("--partitions", type=int, default=1,
                   help="Partitions of the records topic (1: every model checked exactly).")
    p.add_argument("--rate", type=float, default=400.0, help="Records per second (400).")
    p.add_argument("--bad-every", dest="bad_every", type=int, default=40,
                   help="One hostile record per this many honest ones (40).")
    p.add_argument("--min-interval", dest="min_interval", type=float, default=0.2,
                   help="Shortest time from a start to its kill, in seconds (0.2).")
    p.add_argument("--max-interval", dest="max_interval", type=float, default=3.0,
                   help="Longest time from a start to its kill, in seconds (3.0).")
    p.add_argument("--session-timeout-ms", dest="session_timeout_ms", type=int, default=1500,
                   help="Aggregator consumer-group session timeout: how soon a killed member's "
                   "partitions are reassigned (1500).")
    p.add_argument("--max-batch", dest="max_batch", type=int, default=100,
                   help="Records per fold transaction (100).")
    p.add_argument("--seed", type=int, default=0, help="Seed of data, noise and kill times.")
    p.add_argument("--dir", default=None, help="Work directory (default: a temporary one).")


class Load(threading.Thread):
    """Produces honest and hostile records until stopped; remembers where each one landed."""

    def __init__(self, study: Study, kafka, topic: str, rate: float, bad_every: int,
                 seed: int) -> None:
        super().__init__(daemon=True)
        self.study, self.kafka, self.topic = study, kafka, topic
        self.rate, self.bad_every = rate, bad_every
        self.rng = np.random.default_rng(seed)
        self.noise = np.random.default_rng(seed + 1)
        self.stop = threading.Event()
        self.q: list[np.ndarray] = []
        self.p: list[np.ndarray] = []
        self.where: list[tuple[int, int]] = []  # (partition, offset) of each honest record
        self.bad: dict[tuple[int, int], RejectReason] = {}
        self.sent = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._produce()
        except BaseException as exc:  # noqa: BLE001 - reported as a broken invariant
            self.error = exc

    def _produce(self) -> None:
        study, chunk = self.study, max(1, int(self.rate / 10))
        producer = kafka_producer(self.kafka)
        earlier: deque[bytes] = deque(maxlen=1000)
        started = time.monotonic()
        kinds = [RejectReason.REPLAYED, RejectReason.UNDECODABLE, RejectReason.NON_FINITE]
        try:
            while not self.stop.is_set():
                x = self.rng.normal(size=(chunk, study.d))
                x /= np.maximum(1.0, np.linalg.norm(x, axis=1, keepdims=True))
                y = np.clip(x @ np.linspace(-0.5, 0.5, study.d), -1, 1)
                _, values = perturb_records(study, x, y, self.noise)
                (sent,), _ = decode_batch(values)  # exactly what went on the wire
                q, p = sent.q, sent.p
                hostile = []
                for _ in range(chunk // self.bad_every + (self.rng.random() < 0.5)):
                    kind = kinds[len(self.bad) % len(kinds)] if earlier else kinds[1]
                    hostile.append((kind, self._hostile(kind, earlier)))
                good = [producer.send(self.topic, key=v[RECORD_ID_BYTES], value=v) for v in values]
                bad = [(kind, producer.send(self.topic, key=v[RECORD_ID_BYTES], value=v))
                       for kind, v in hostile]
                producer.flush()
                self.where += [(m.partition, m.offset) for m in (f.get(0) for f in good)]
                self.q.append(q)
                self.p.append(p)
                for kind, f in bad:
                    m = f.get(0)
                    self.bad[(m.partition, m.offset)] = kind
                self.sent += len(good) + len(bad)
                earlier.extend(values)
                self.stop.wait(max(0.0, started + self.sent / self.rate - time.monotonic()))
        finally:
            producer.close()

    def _hostile(self, kind: RejectReason, earlier: deque[bytes]) -> bytes:
        if kind is RejectReason.UNDECODABLE:
            return b"\x01" + self.rng.bytes(40)
        value = earlier[int(self.rng.integers(len(earlier)))]
        if kind is RejectReason.REPLAYED:  # an acknowledged record, sent again (same key)
            return value
        poisoned = bytearray(value)
        poisoned[48:56] = np.float64(np.nan).tobytes()
        return bytes(poisoned)

    def honest(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(q̃, p̃) of every honest record in fold order (partition, then offset), and where."""
        q, p = np.concatenate(self.q), np.concatenate(self.p)
        where = np.array(self.where, dtype=np.int64).reshape(-1, 2)
        order = np.lexsort((where[:, 1], where[:, 0]))
        return q[order], p[order], where[order]


class Service:
    """An `ipdp ROLE run` subprocess that can be SIGKILLed and started again."""

    def __init__(self, role: str, env: dict[str, str], log_path: Path) -> None:
        self.role, self.env, self.log_path = role, env, log_path
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.died: list[int] = []  # exit codes of exits nobody asked for

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ipdp.cli", self.role, "run"], env=self.env, cwd=REPO,
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        self.starts += 1

    def check(self) -> bool:
        """Record an exit nobody asked for and start again; always False (for `or` chains)."""
        if self.proc is not None and self.proc.poll() is not None:
            self.died.append(self.proc.returncode)
            self.start()
        return False

    def kill(self) -> None:
        self.check()
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _wait(cond, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return cond()


def _dead_letters(kafka, topic: str, want: set[tuple[int, int]]) -> tuple[dict, int]:
    """source (partition, offset) → reasons seen on the dead-letter topic; and dead letters read."""
    from kafka import TopicPartition

    consumer = kafka_consumer(kafka, group_id=None)
    seen: dict[tuple[int, int], list[str]] = {}
    read = 0
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        consumer.seek_to_beginning(tp)
        quiet_since = time.monotonic()
        deadline = time.monotonic() + 60
        # Until every expected source is seen and nothing more arrives for 2 s (tansu's
        # end_offsets is the last batch's base + 1, so the end cannot be asked for).
        while time.monotonic() < deadline and (
                not want <= seen.keys() or time.monotonic() - quiet_since < 2):
            got = consumer.poll(timeout_ms=300)
            for msgs in got.values():
                for m in msgs:
                    for x in read_dead_letters(m.value, m.headers):
                        seen.setdefault((x.partition, x.offset), []).append(x.reason)
                        read += 1
            if got:
                quiet_since = time.monotonic()
    finally:
        consumer.close()
    return seen, read


def _clean(q: np.ndarray, p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return q.T @ q, p.sum(axis=0)


def _solve(study: Study, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return solve_constrained(a + study.calibration.delta_in * np.eye(study.d), b, study.eta).w


def closed_rounds(r, study: Study) -> dict[int, tuple[np.ndarray, np.ndarray, int]]:
    """round → (A, b, count) of every closed round of `study` still in Redis."""
    out = {}
    for key in r.scan_iter(match=state.StudyKeys(study.study_id).closed(0)[:-1] + "*"):
        raw = r.hmget(key, ["A", "b", "count"])
        a, b = state.unpack_stats(raw[0], raw[1], study.d)
        out[int(key.decode().rsplit(":", 1)[1])] = (a, b, int(raw[2]))
    return out


def _open_round(r, study: Study) -> tuple[np.ndarray, np.ndarray, int]:
    raw = r.hmget(state.StudyKeys(study.study_id).open, ["A", "b", "count"])
    a, b = state.unpack_stats(raw[0], raw[1], study.d)
    return a, b, int(raw[2] or 0)


def main(argv: list[str] | None = None) -> int:
    """Parse the flags and run the soak."""
    p = argparse.ArgumentParser(allow_abbrev=False, prog="ipdp soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """`ipdp soak`: returns 0 when every invariant held, 1 otherwise."""
    signal.signal(signal.SIGTERM, _raise_system_exit)  # so the services are stopped too
    work = Path(args.dir or tempfile.mkdtemp(prefix="ipdp-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    topics = TopicSettings(records_partitions=args.partitions)
    rng = random.Random(args.seed)
    started = time.monotonic()
    with EmbeddedRuntime(work / "runtime", topics=topics) as rt:
        kafka, r = rt.kafka_settings(), redis_client(rt.redis_settings())
        study = Study(study_id="soak", d=args.d, n=args.n, epsilon=1.0, delta=0.01)
        keys = state.StudyKeys(study.study_id)
        producer = kafka_producer(kafka)
        state.create_study(r, producer, topics, study)
        producer.close()
        env = {**_inherited_env(), **rt.env(),
               "IPDP_AGGREGATOR_SESSION_TIMEOUT_MS": str(args.session_timeout_ms),
               "IPDP_AGGREGATOR_MAX_BATCH": str(args.max_batch),
               "IPDP_TRAINER_BLOCK_MS": "200"}
        aggregator = Service("aggregator", env, work / "aggregator.log")
        trainer = Service("trainer", env, work / "trainer.log")
        offsets_key = state.offsets_key("ipdp-aggregator", topics.records)

        def consumed() -> int:
            return sum(int(v) for k, v in r.hgetall(offsets_key).items() if b":" not in k)

        load = Load(study, kafka, topics.records, args.rate, args.bad_every, args.seed)
        stalled = 0
        try:
            if args.partitions == 1:
                trainer.start()
            aggregator.start()
            load.start()
            for kill in range(args.kills):
                before = consumed()
                if kill % 2:
                    time.sleep(rng.uniform(args.min_interval, args.max_interval))
                else:
                    stalled += not _wait(lambda b=before: consumed() > b, 60)
                    time.sleep(rng.uniform(0.0, 0.5))
                aggregator.kill()
                aggregator.start()
                trainer.check()
                if (kill + 1) % 20 == 0:
                    print(f"soak: {kill + 1}/{args.kills} kills, {load.sent} sent, "
                          f"{consumed()} consumed", file=sys.stderr, flush=True)
            load.stop.set()
            load.join(timeout=60)
            drained = _wait(lambda: aggregator.check() or consumed() == load.sent,
                            DRAIN_TIMEOUT_S)
            snapshot = (closed_rounds(r, study), _open_round(r, study))
            if args.partitions > 1:
                trainer.start()
            rounds_closed = int(r.hget(keys.counts, "rounds_closed") or 0)
            published = _wait(lambda: trainer.check() or r.hlen(
                keys.published) == rounds_closed, DRAIN_TIMEOUT_S)
        finally:
            load.stop.set()
            aggregator.stop()
            trainer.stop()
        elapsed = time.monotonic() - started

        sub = ModelSubscriber(kafka, topics, study_id=study.study_id)
        models = {m.round: m for m in sub}
        letters, letter_messages = _dead_letters(kafka, topics.dead_letter, set(load.bad))
        q, p, _ = load.honest()
        folded = int(r.hget(keys.counts, "folded") or 0)
        rejected = state.rejected_counts(r, "ipdp-aggregator", topics.records)
        expected_rejected: dict[str, int] = {}
        for reason in load.bad.values():
            expected_rejected[reason.value] = expected_rejected.get(reason.value, 0) + 1
        n_rounds = folded // study.n

        d_stats, d_w = 0.0, 0.0
        closed, (a_open, b_open, open_count) = snapshot
        if args.partitions == 1:
            for k, m in models.items():
                seg = slice((k - 1) * study.n, k * study.n)
                d_w = max(d_w, float(np.abs(np.subtract(
                    m.weights, _solve(study, *_clean(q[seg], p[seg])))).max()))
            for k, (a, b, _) in closed.items():  # closed but not yet published at the snapshot
                seg = slice((k - 1) * study.n, k * study.n)
                ca, cb = _clean(q[seg], p[seg])
                d_stats = max(d_stats, float(np.abs(a - ca).max()), float(np.abs(b - cb).max()))
            ca, cb = _clean(q[n_rounds * study.n:], p[n_rounds * study.n:])
        else:
            for k, m in models.items():
                if k in closed:
                    d_w = max(d_w, float(np.abs(np.subtract(
                        m.weights, _solve(study, *closed[k][:2]))).max()))
            a_open = a_open + sum((a for a, _, _ in closed.values()), np.zeros_like(a_open))
            b_open = b_open + sum((b for _, b, _ in closed.values()), np.zeros_like(b_open))
            ca, cb = _clean(q, p)
        d_stats = max(d_stats, float(np.abs(a_open - ca).max()), float(np.abs(b_open - cb).max()))
        scale = max(1.0, float(np.abs(ca).max()), float(np.abs(cb).max()))

        checks = [
            (load.error is None, f"the load thread failed: {load.error!r}"),
            (stalled == 0, f"{stalled} restarted aggregator(s) made no progress within 60 s"),
            (drained, f"not drained: {consumed()} of {load.sent} records consumed"),
            (published, (f"{r.hlen(keys.published)} of {rounds_closed}"
                         " closed rounds published")),
            (not aggregator.died, f"the aggregator exited by itself: codes {aggregator.died}"),
            (not trainer.died, f"the trainer exited by itself: codes {trainer.died}"),
            (folded == len(q), f"folded {folded}, honest records sent {len(q)}"),
            (rejected == expected_rejected,
             f"rejections counted {rejected}, hostile sent {expected_rejected}"),
            ({k: v[0] for k, v in letters.items()} == {k: r.value for k, r in load.bad.items()}
             and all(len(set(v)) == 1 for v in letters.values()),
             "dead-letter topic does not hold exactly the hostile records with their reasons"),
            (rounds_closed == n_rounds, f"{rounds_closed} rounds closed, expected {n_rounds}"),
            (sorted(models) == list(range(1, n_rounds + 1)),
             f"models for rounds {sorted(models)[:5]}…, expected 1…{n_rounds}"),
            (all(m.n == study.n for m in models.values()), "a model not from exactly n records"),
            (open_count == folded - n_rounds * study.n,
             f"open round holds {open_count} records"),
            (args.partitions == 1 or all(c == study.n for _, _, c in closed.values()),
             "a closed round without exactly n records"),
            (args.partitions == 1 or sorted(closed) == list(range(1, n_rounds + 1)),
             f"closed rounds {sorted(closed)[:5]}… before the trainer started"),
            (d_stats <= TOLERANCE * scale,
             f"statistics differ from a clean refold by {d_stats:.3g} (largest entry {scale:.3g})"),
            (d_w <= TOLERANCE, f"a model differs from a clean solve by {d_w:.3g}"),
        ]
        broken = [msg for ok, msg in checks if not ok]

    rows = [
        ("kills (SIGKILL)", str(args.kills)),
        ("aggregator starts", f"{aggregator.starts} (exits on its own: {len(aggregator.died)})"),
        ("records sent", f"{load.sent:,} ({len(q):,} honest, {len(load.bad):,} hostile)"),
        ("folded", f"{folded:,}"),
        ("dead-lettered (counted once)", f"{sum(rejected.values()):,} {rejected}"),
        ("dead letters (at least once)", f"{letter_messages:,}"),
        ("rounds closed", f"{rounds_closed:,} of n = {study.n:,}"),
        ("models published (distinct)", f"{len(models):,} ({sub.duplicates_dropped} repeats)"),
        ("max |Δ| statistics vs clean refold", f"{d_stats:.3g} (largest entry {scale:.3g})"),
        ("max |Δ| model weights vs clean solve", f"{d_w:.3g}"),
        ("records partitions", str(args.partitions)),
        ("elapsed", f"{elapsed:.0f} s"),
    ]
    print(table(rows, title=f"soak: {args.kills} aggregator kills"))
    if broken:
        print("\nBROKEN:\n  " + "\n  ".join(broken), file=sys.stderr)
        print(f"logs in {work}", file=sys.stderr)
        return 1
    print("\nall invariants held")
    if not args.dir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _raise_system_exit(signum, _frame) -> None:
    raise SystemExit(128 + signum)


def _inherited_env() -> dict[str, str]:
    """This process's environment without IPDP_* settings (the runtime's replace them)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("IPDP_")}


if __name__ == "__main__":
    sys.exit(main())
