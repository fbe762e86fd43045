"""Throughput and cost of ipdp against the limits, in one run; prints markdown tables.

    python -m bench.throughput            (or: ipdp bench throughput)

It prints; ``--out DIR`` also writes the tables to DIR/throughput.md, and ``--write-docs`` puts
them between the bench.throughput markers of the repository's docs/benchmarks.md.

Sections: the fold path without a broker (and its ceilings), end to end through the embedded
broker next to a bare consumer of the same topic, the trainer, and memory. Every figure is
measured here, in this run; nothing is asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from aggregator.batch import Polled
from aggregator.fold import Folder
from aggregator.replay import ReplayIds
from bench.markdown import replace_block
from ipdp import state
from ipdp.embedded import EmbeddedRedis, EmbeddedRuntime
from ipdp.embedded.children import spawn
from ipdp.kafka_io import ensure_topics, kafka_consumer, kafka_producer
from ipdp.redis_io import redis_client
from ipdp.settings import TopicSettings
from ipdp.study import Study
from ipdp.wire import decode_batch
from producer.contributor import perturb_records
from trainer.solver import solve_constrained

#: The page --write-docs regenerates (its bench.throughput block only).
DOCS_PAGE = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"

TARGETS = {
    "fold": "≥ 1,000,000 records/s/core at d = 14",
    "e2e": "≥ 90 % of the broker's bare consume rate",
    "solve": "< 100 ms at d = 100",
    "bytes": "statistics bytes identical at n = 10³ and 10⁶",
    "replay": "≤ 16 bytes per id, no false negatives",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `ipdp bench throughput`."""
    p.add_argument("--records", type=int, default=1_000_000,
                   help="Records per fold-path measurement at d = 14 (default 1000000: the "
                        "replay state then grows to a million ids, as it does in service, and a "
                        "run lasts seconds, not a fraction of one).")
    p.add_argument("--e2e-records", dest="e2e_records", type=int, default=300_000,
                   help="Records through the embedded broker, directly and through the gateway "
                        "(default 300000: at 200,000 records/s a smaller run is over too soon "
                        "to time).")
    p.add_argument("--quick", action="store_true", help="Small sizes, for a smoke run.")
    p.add_argument("--json", action="store_true",
                   help="Print the headline figures as one JSON line on stdout (the tables go "
                        "to stderr).")
    p.add_argument("--scale-records", dest="scale_records", type=int, default=100_000,
                   help="Records per aggregator process in the scale-out table (default 100000).")
    p.add_argument("--scale-out-only", dest="scale_out_only", action="store_true",
                   help="Print only the scale-out table (k aggregator processes on one Redis and "
                        "on a three-primary Redis Cluster); not with --out, --write-docs or "
                        "--json.")
    p.add_argument("--replay-ids", dest="replay_ids", type=int, nargs="+",
                   default=[10**6, 10**7],
                   help="Sizes of the replay-state memory table (default 1000000 10000000; the "
                        "larger one takes about a minute).")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--out", type=Path, default=None, metavar="DIR",
                       help="Also write the tables to DIR/throughput.md.")
    where.add_argument("--write-docs", dest="write_docs", action="store_true",
                       help="Also put the tables between the bench.throughput markers of the "
                            "repository's docs/benchmarks.md.")


def _records(study: Study, k: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(k, study.d)) / np.sqrt(study.d)
    x /= np.maximum(1.0, np.linalg.norm(x, axis=1, keepdims=True))
    return perturb_records(study, x, np.clip(x[:, 0], -1, 1), rng)[1]


def _polled(values: list[bytes], start: int, size: int, first_offset: int | None = None) -> Polled:
    """values[start:start + size] as one poll of partition 0 (offsets from first_offset)."""
    chunk = values[start:start + size]
    first = start if first_offset is None else first_offset
    return Polled(np.zeros(len(chunk), np.int64), np.arange(first, first + len(chunk)), chunk)


def fold_path(k14: int, figures: dict | None = None) -> list[list[str]]:
    """Decode + validate + fold + atomic Redis commit, per batch size, and its ceilings."""
    rows = []
    with EmbeddedRedis() as srv:
        r = redis_client(srv.settings())
        for d, k in ((14, k14), (100, max(10_000, k14 // 4))):
            study = Study(study_id=f"bench-{d}", d=d, n=10**9, epsilon=1.0, delta=0.01)
            state.register_study(r, study)
            values = _records(study, k, seed=d)
            batches, _ = decode_batch(values)
            q, p = batches[0].q, batches[0].p
            t0 = time.perf_counter()
            for s in range(0, k, 5000):
                q[s:s + 5000].T @ q[s:s + 5000]
                p[s:s + 5000].sum(axis=0)
            numpy_rate = k / (time.perf_counter() - t0)
            rows.append([str(d), "5000", "numpy fold only (ceiling)", f"{numpy_rate:,.0f}", "—"])
            folder = Folder(r, group="bench", topic=f"t{d}", replay_window_s=86_400,
                            max_future_skew_s=300, max_message_bytes=1 << 20)
            t0 = time.perf_counter()
            for s in range(0, k, 5000):
                polled = _polled(values, s, 5000)
                folder.validator.validate(polled, folder.validator.decode(polled),
                                          {study.hash: study}, {}, int(time.time() * 1000))
            rows.append([str(d), "5000", "decode + validate, no Redis",
                         f"{k / (time.perf_counter() - t0):,.0f}", "—"])
            for batch in (500, 2000, 5000, 20000):
                r.delete(state.offsets_key("bench", f"t{d}"),
                         state.StudyKeys(study.study_id).open, *_replay_keys(r, study.study_id))
                wall0, cpu0 = time.perf_counter(), time.process_time()
                for s in range(0, k, batch):
                    folder.fold(_polled(values, s, batch))
                wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
                if figures is not None and d == 14 and batch == 5000:
                    figures["fold_records_per_cpu_second_d14"] = round(k / cpu)
                    figures["fold_records_per_second_d14"] = round(k / wall)
                rows.append([str(d), str(batch), "full fold path (real Redis)",
                             f"{k / wall:,.0f}", f"{k / cpu:,.0f}"])
    return rows


def _fold_partition(redis_settings, study_id: str, partition: int, k: int, batch: int, ready,
                    go, out) -> None:
    """One aggregator process folding partition `partition` of study `study_id` (no broker)."""
    r = redis_client(redis_settings)
    study = state.load_study(r, study_id)[0]
    values = _records(study, k, seed=100 + partition)
    folder = Folder(r, group="scale", topic="t", replay_window_s=86_400, max_future_skew_s=300,
                    max_message_bytes=1 << 20)
    polls = [Polled(np.full(len(values[s:s + batch]), partition, np.int64),
                    np.arange(s, s + len(values[s:s + batch])), values[s:s + batch])
             for s in range(0, k, batch)]
    ready.put(partition)
    go.wait()
    cpu0, folds, conflicts = time.process_time(), 0, 0
    for polled in polls:
        conflicts += folder.fold(polled).conflicts
        folds += 1
    out.put((folds, conflicts, time.process_time() - cpu0))


@contextlib.contextmanager
def _redis(kind: str):
    """(settings, redis-server pids) of a fresh single Redis or three-primary cluster."""
    import tempfile

    from ipdp.embedded import EmbeddedRedisCluster

    if kind == "single":
        with EmbeddedRedis() as srv:
            yield srv.settings(), [srv.pid]
    else:
        with tempfile.TemporaryDirectory(prefix="ipdp-cluster-") as tmp, \
                EmbeddedRedisCluster(tmp) as cluster:
            yield cluster.settings(), [node.pid for node in cluster.nodes]


SCALE_REDIS = {"single": "one redis-server", "cluster": "cluster, 3 primaries"}


def scale_out(k_per_process: int, batch: int = 5000,
              redis_kinds: tuple[str, ...] = ("single", "cluster"),
              processes: tuple[int, ...] = (1, 2, 4)) -> list[list[str]]:
    """k = 1, 2, 4 aggregator processes, each folding its own partition, of one study or of
    k studies (one each), on one Redis and on a Redis Cluster; no broker."""
    import multiprocessing as mp

    rows = []
    ctx = mp.get_context("spawn")
    for kind in redis_kinds:
        for shared in (True, False):
            for procs in processes:
                if not shared and procs == 1:
                    continue  # the same run as one study with one process
                with _redis(kind) as (settings, pids):
                    r = redis_client(settings)
                    ids = ["scale-0"] * procs if shared else [f"scale-{i}" for i in range(procs)]
                    for sid in sorted(set(ids)):
                        state.register_study(r, Study(study_id=sid, d=14, n=10**9,
                                                      epsilon=1.0, delta=0.01))
                    ready, go, out = ctx.Queue(), ctx.Event(), ctx.Queue()
                    workers = [ctx.Process(target=_fold_partition, args=(
                        settings, sid, i, k_per_process, batch, ready, go, out))
                        for i, sid in enumerate(ids)]
                    for w in workers:
                        w.start()
                    for _ in workers:  # every worker builds its records before the clock
                        ready.get(timeout=600)
                    redis_cpu0 = sum(_cpu_seconds(pid) for pid in pids)
                    t0 = time.perf_counter()
                    go.set()
                    results = [out.get(timeout=600) for _ in workers]
                    wall = time.perf_counter() - t0
                    redis_cpu = sum(_cpu_seconds(pid) for pid in pids) - redis_cpu0
                    for w in workers:
                        w.join()
                    folded = sum(int(r.hget(state.StudyKeys(sid).counts, "folded") or 0)
                                 for sid in set(ids))
                    r.close()
                rows.append([SCALE_REDIS[kind], "1" if shared else str(procs), str(procs),
                             f"{folded:,}", f"{folded / wall:,.0f}",
                             f"{sum(x[1] for x in results):,}",
                             f"{redis_cpu:.2f} s ({redis_cpu / wall:.0%} of a core)"])
    return rows


def end_to_end(k: int) -> tuple[list[list[str]], dict]:
    """The aggregator (a child process) against a bare consumer of the same topic."""
    out = {}
    with EmbeddedRuntime() as rt:
        kafka = rt.kafka_settings()
        topics = TopicSettings(records="bench.records", models="bench.models",
                               dead_letter="bench.dlq", studies="bench.studies")
        ensure_topics(kafka, topics)
        # n = k + 1: the first k records measure throughput, the last one the latency from
        # the n-th record to the published model.
        study = Study(study_id="bench-e2e", d=14, n=k + 1, epsilon=1.0, delta=0.01)
        r = redis_client(rt.redis_settings())
        producer = kafka_producer(kafka)
        state.create_study(r, producer, topics, study)
        values = _records(study, k, seed=1)
        t0 = time.perf_counter()
        for v in values:
            producer.send(topics.records, value=v)
        producer.flush()
        out["produce_rate"] = k / (time.perf_counter() - t0)

        consumer = kafka_consumer(kafka, group_id=None)
        from kafka import TopicPartition

        tps = [TopicPartition(topics.records, p)
               for p in sorted(consumer.partitions_for_topic(topics.records))]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        got, first, cpu0 = 0, None, time.process_time()
        while got < k:
            for recs in consumer.poll(timeout_ms=1000, max_records=5000).values():
                first = first or time.perf_counter()
                got += len(recs)
        out["bare_rate"] = k / (time.perf_counter() - first)
        out["bare_cpu_us"] = (time.process_time() - cpu0) / k * 1e6
        consumer.close()

        env = {**os.environ, **rt.env(), "IPDP_METRICS_PORT": "0",
               "IPDP_TOPIC_RECORDS": topics.records, "IPDP_TOPIC_MODELS": topics.models,
               "IPDP_TOPIC_DEAD_LETTER": topics.dead_letter, "IPDP_TOPIC_STUDIES": topics.studies,
               "IPDP_LOG_LEVEL": "WARNING"}
        # First with kafka-python's own record parser, then (a fresh Redis state, the same
        # topic) with the columnar fetch, which is the default and goes on to the model.
        logs = Path(rt.directory)
        agg = _aggregator(env, {"IPDP_AGGREGATOR_COLUMNAR_FETCH": "false"}, logs)
        out["lib_rate"], out["lib_cpu_us"] = _time_folds(agg, r, study, k)
        agg.terminate()
        agg.wait(timeout=60)
        r.flushall()
        state.register_study(r, study)
        # The trainer is up (its group on the rounds stream exists) before the aggregator
        # starts, so the latency below is the trainer's work, not its start-up.
        trainer = spawn([sys.executable, "-m", "ipdp.cli", "trainer", "run", "--idle-exit", "60"],
                        logs / "trainer.log", env)
        deadline = time.monotonic() + 60
        while not r.exists(state.ROUNDS_STREAM) or not r.xinfo_groups(state.ROUNDS_STREAM):
            if trainer.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the trainer did not start")
            time.sleep(0.05)
        agg = _aggregator(env, {}, logs)
        out["agg_rate"], out["agg_cpu_us"] = _time_folds(agg, r, study, k)
        last = _records(study, 1, seed=2)[0]
        t_last = time.perf_counter()
        producer.send(topics.records, value=last).get(timeout=30)
        deadline = time.monotonic() + 60
        while not r.hexists(state.StudyKeys(study.study_id).published, "1"):
            if time.monotonic() > deadline:
                raise TimeoutError("no model within 60 s")
            time.sleep(0.01)
        from ipdp.subscriber import ModelSubscriber

        out["last_record_to_model_ms"] = (time.perf_counter() - t_last) * 1000
        (model,) = list(ModelSubscriber(kafka, topics, study_id=study.study_id))
        out["close_to_publish_ms"] = model.published_ms - model.round_closed_ms
        out["agg_peak_rss_mb"] = _peak_rss_mb(agg.pid)
        agg.wait(timeout=60)
        trainer.terminate()
        trainer.wait(timeout=30)
        producer.close()  # before the broker stops under it, which its IO thread logs as errors
    rows = [
        ["produce (load generator path, 1 producer)", f"{out['produce_rate']:,.0f}", ""],
        ["bare kafka-python consumer, same topic", f"{out['bare_rate']:,.0f}",
         f"{out['bare_cpu_us']:.1f}"],
        [LIBRARY_PARSER, f"{out['lib_rate']:,.0f}", f"{out['lib_cpu_us']:.1f}"],
        ["ipdp aggregator, columnar fetch (the default)", f"{out['agg_rate']:,.0f}",
         f"{out['agg_cpu_us']:.1f}"],
        ["aggregator / bare consumer: kafka-python's parser",
         f"{out['lib_rate'] / out['bare_rate']:.0%}", ""],
        ["aggregator / bare consumer: columnar fetch",
         f"{out['agg_rate'] / out['bare_rate']:.0%}", ""],
    ]
    return rows, out


LIBRARY_PARSER = "ipdp aggregator, kafka-python's record parser (IPDP_AGGREGATOR_COLUMNAR_FETCH=false)"


def _aggregator(env: dict, extra: dict, logs: Path) -> subprocess.Popen:
    # spawn(): a child that dies with the benchmark, which may stop at any step.
    return spawn([sys.executable, "-m", "ipdp.cli", "aggregator", "run", "--idle-exit", "3"],
                 logs / "aggregator.log", {**env, **extra})


def _time_folds(agg: subprocess.Popen, r, study: Study, k: int) -> tuple[float, float]:
    """(records/s, aggregator CPU µs per record) until ``k`` records of ``study`` are folded;
    both clocks start at the first fold: start-up and the group join are not counted."""
    key = state.StudyKeys(study.study_id).counts
    first, cpu0 = None, 0.0
    while (folded := int(r.hget(key, "folded") or 0)) < k:
        if agg.poll() is not None:
            raise RuntimeError(f"the aggregator exited early with status {agg.returncode}")
        if first is None and folded > 0:
            first, cpu0 = time.perf_counter(), _cpu_seconds(agg.pid)
        time.sleep(0.005)
    return (k / (time.perf_counter() - (first or time.perf_counter())),
            (_cpu_seconds(agg.pid) - cpu0) / k * 1e6)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a live process (from /proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _peak_rss_mb(pid: int) -> float:
    """VmHWM of a live process: its peak resident set so far."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM for pid {pid}")


def solve_times() -> list[list[str]]:
    """Median time of solve_constrained on a noisy Gram matrix, both regimes."""
    rows = []
    rng = np.random.default_rng(0)
    for d in (14, 100, 1000):
        z = rng.normal(size=(4 * d, d))
        h = z.T @ z + np.eye(d)
        b = rng.normal(size=d) * 100
        times = []
        for _ in range(5 if d == 1000 else 50):
            t0 = time.perf_counter()
            solve_constrained(h, b, 1.0)
            times.append(time.perf_counter() - t0)
        rows.append([str(d), f"{np.median(times) * 1000:.3f}", f"{max(times) * 1000:.3f}"])
    return rows


def _replay_keys(r, study_id: str) -> list[str]:
    """The index and every bucket of a study's replay state."""
    keys = state.StudyKeys(study_id)
    return [keys.replay] + [keys.replay_bucket(int(e)) for e in r.hkeys(keys.replay)]


def replay_bytes(r, study_id: str) -> int:
    """MEMORY USAGE (every element counted) of a study's replay state."""
    return sum(r.memory_usage(k, samples=0) or 0 for k in _replay_keys(r, study_id))


def _replay_batch(r, replay: ReplayIds, study_id: str, ids: np.ndarray, now_ms: int) -> int:
    """One fold's worth of replay work: check under WATCH, append in MULTI; returns the hits."""
    keys = state.StudyKeys(study_id)
    with r.pipeline() as pipe:
        pipe.watch(keys.replay)
        hits = int(replay.seen(pipe, keys, ids).sum())
        pipe.multi()
        replay.add(pipe, keys, ids, now_ms)
        pipe.execute()
    return hits


def replay_set(k: int) -> list[list[str]]:
    """The replay state alone (aggregator/replay.py) against a fresh Redis, batches of 5,000:
    check + append of fresh ids, then of the same ids again (every one a hit)."""
    rows = []
    for label, extra in (("AOF appendfsync always (as deployed)", []),
                         ("AOF off", ["--appendonly", "no"])):
        with EmbeddedRedis(extra_args=extra) as srv:
            r = redis_client(srv.settings())
            replay = ReplayIds(r, replay_window_s=86_400, max_future_skew_s=300)
            ids = np.random.default_rng(0).integers(0, 256, (k, 16), dtype=np.uint8)
            now = int(time.time() * 1000)
            for op in ("check + append, ids absent", "check + append, ids present"):
                t0, cpu0, hits = time.perf_counter(), time.process_time(), 0
                for s in range(0, k, 5000):
                    hits += _replay_batch(r, replay, "bench", ids[s:s + 5000], now)
                wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
                rows.append([label, op, f"{k / wall:,.0f}", f"{k / cpu:,.0f}", f"{hits:,}"])
    return rows


def _random_ids(rng: np.random.Generator, k: int, bits: int) -> np.ndarray:
    """k random 16-byte ids whose first 8 bytes (the part kept) hold `bits` random bits."""
    ids = rng.integers(0, 256, (k, 16), dtype=np.uint8)
    ids[:, bits // 8:8] = 0
    return ids


def replay_memory(sizes: list[int], checks: int = 10**6) -> list[list[str]]:
    """Redis bytes per remembered id at each size, and false positives measured on `checks`
    fresh ids: with real ids (64 bits kept) and with ids that have only 32 random bits in the
    part that is kept, where the predicted rate N / 2³² is large enough to see."""
    rows = []
    rng = np.random.default_rng(7)
    for bits in (64, 32):
        for n in sizes if bits == 64 else sizes[:1]:
            with EmbeddedRedis(extra_args=["--appendonly", "no"]) as srv:
                r = redis_client(srv.settings())
                replay = ReplayIds(r, replay_window_s=86_400, max_future_skew_s=300)
                keys = state.StudyKeys("mem")
                now = int(time.time() * 1000)
                base = int(r.info("memory")["used_memory"])

                for s in range(0, n, 100_000):  # appends only: one MULTI per 100,000 ids
                    chunk = _random_ids(rng, min(100_000, n - s), bits)
                    with r.pipeline() as pipe:
                        for c in range(0, len(chunk), 5000):
                            replay.add(pipe, keys, chunk[c:c + 5000], now)
                        pipe.execute()
                used = int(r.info("memory")["used_memory"]) - base
                fresh = _random_ids(rng, checks, bits)
                with r.pipeline() as pipe:
                    pipe.watch(keys.replay)
                    t0 = time.perf_counter()
                    false_pos = int(replay.seen(pipe, keys, fresh).sum())
                    t_check = time.perf_counter() - t0
                    pipe.unwatch()
                per_id = replay_bytes(r, "mem")
                rows.append([str(bits), f"{n:,}", f"{per_id:,}", f"{per_id / n:.2f}",
                             f"{used:,}", f"{used / n:.2f}", f"{len(_replay_keys(r, 'mem'))}",
                             f"{false_pos:,} of {checks:,}", f"{checks * n / 2.0**bits:.3g}",
                             f"{t_check * 1000:.0f}"])
    return rows


def memory(quick: bool, figures: dict | None = None) -> list[list[str]]:
    """Redis bytes of one study's statistics and offsets after 10³ and 10⁶ records."""
    rows = []
    with EmbeddedRedis() as srv:
        r = redis_client(srv.settings())
        for k in (10**3, 10**4 if quick else 10**6):
            study = Study(study_id=f"mem-{k}", d=14, n=10**9, epsilon=1.0, delta=0.01)
            state.register_study(r, study)
            folder = Folder(r, group=f"mem{k}", topic="t", replay_window_s=86_400,
                            max_future_skew_s=300, max_message_bytes=1 << 20)
            for s in range(0, k, 100_000):
                values = _records(study, min(100_000, k - s), seed=s)
                folder.fold(_polled(values, 0, len(values), first_offset=s))
            open_key = state.StudyKeys(study.study_id).open
            stats = r.memory_usage(open_key)
            payload = sum(r.hstrlen(open_key, f) for f in ("A", "b"))
            offsets = r.memory_usage(state.offsets_key(f"mem{k}", "t"))
            seen = replay_bytes(r, study.study_id)
            rows.append([f"{k:,}", str(payload), str(stats), str(offsets), f"{seen:,}",
                         f"{seen / k:.0f}"])
            if figures is not None:
                figures["replay_bytes_per_id"] = round(seen / k, 1)
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run every section and print the tables."""
    p = argparse.ArgumentParser(allow_abbrev=False, prog="ipdp bench throughput",
                                description=__doc__)
    add_arguments(p)
    return run(p.parse_args(argv))


def gateway_e2e_records_per_second(k: int) -> float:
    """Device HTTP → gateway → Kafka → aggregator → Redis (bench/gateway_load.py)."""
    from bench import gateway_load

    return gateway_load.gateway_e2e(k)["gateway_e2e_records_per_second"]


def run(args: argparse.Namespace) -> int:
    """`ipdp bench throughput`: print the tables (and write them with --out or --write-docs)."""
    if args.scale_out_only:
        if args.out or args.write_docs or args.json:
            print("--scale-out-only prints one table: not with --out, --write-docs or --json",
                  file=sys.stderr)
            return 2
        _scale_out_table(20_000 if args.quick else args.scale_records)
        return 0
    buffer = io.StringIO()
    figures: dict = {}
    human = sys.stderr if args.json else sys.stdout
    with contextlib.redirect_stdout(_Tee(human, buffer)):
        _run(args, figures)
    if args.json:
        print(json.dumps(figures, sort_keys=True))
    if not (args.out or args.write_docs):
        return 0
    command = "ipdp bench throughput" + (" --quick" if args.quick else "") + (
        " --json" if args.json else "")
    text = f"Command: `{command}`\n\n"
    if args.json:
        text += ("The JSON line it printed on stdout (the tables below went to stderr):\n\n"
                 f"```\n{json.dumps(figures, sort_keys=True)}\n```\n\n")
    text += buffer.getvalue()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "throughput.md").write_text(text, encoding="utf-8")
        print(f"bench.throughput: wrote {args.out / 'throughput.md'}", file=sys.stderr)
    elif not replace_block(DOCS_PAGE, "bench.throughput", text):
        print(f"{DOCS_PAGE} has no bench.throughput markers; nothing written", file=sys.stderr)
        return 1
    return 0


class _Tee(io.TextIOBase):
    def __init__(self, *streams) -> None:
        self.streams = streams

    def write(self, s: str) -> int:
        for stream in self.streams:
            stream.write(s)
        return len(s)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()


def _run(args: argparse.Namespace, figures: dict) -> None:
    k = 20_000 if args.quick else args.records
    k_e2e = 20_000 if args.quick else args.e2e_records
    k_scale = 10_000 if args.quick else args.scale_records
    print(f"Machine: {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, Python {platform.python_version()}, numpy {np.__version__}\n")
    print(f"### Fold path without a broker (target {TARGETS['fold']})\n")
    _md(["d", "batch", "what", "records/s (wall)", "records/s per aggregator CPU-second"],
        fold_path(k, figures))
    print("\nThe replay state alone (aggregator/replay.py), batches of 5,000 ids, one "
          "WATCH/MULTI/EXEC each:\n")
    _md(["redis-server", "operation", "ids/s (wall)", "ids per aggregator CPU-second",
         "ids seen"], replay_set(k))
    sizes = [10**4] if args.quick else args.replay_ids
    print("\n### Replay state: Redis bytes per remembered id, and false positives (target "
          f"{TARGETS['replay']})\n")
    _md(["id bits kept", "ids remembered", "MEMORY USAGE of the keys", "bytes per id",
         "INFO used_memory growth", "bytes per id", "keys", "fresh ids found (false positives)",
         "expected: checks × N / 2^bits", "check ms"], replay_memory(sizes))
    print(f"\n### End to end on the embedded broker, {k_e2e:,} records "
          f"(target {TARGETS['e2e']})\n")
    rows, e2e = end_to_end(k_e2e)
    _md(["path", "records/s", "client CPU µs per record"], rows)
    figures["direct_e2e_records_per_second"] = round(e2e["agg_rate"])
    figures["bare_consumer_records_per_second"] = round(e2e["bare_rate"])
    figures["e2e_aggregator_over_bare_consumer"] = round(e2e["agg_rate"] / e2e["bare_rate"], 3)
    figures["e2e_library_parser_aggregator_over_bare_consumer"] = round(
        e2e["lib_rate"] / e2e["bare_rate"], 3)
    gateway = gateway_e2e_records_per_second(k_e2e)
    figures["gateway_e2e_records_per_second"] = round(gateway)
    print(f"\nThrough the HTTP gateway in batched uploads (1,000 records per POST → gateway → "
          f"Kafka → aggregator → Redis): {gateway:,.0f} records/s\n")
    _scale_out_table(k_scale)
    print(f"\n### Trainer (target {TARGETS['solve']})\n")
    print(f"n-th record produced → model on Kafka and acknowledged in Redis: "
          f"{e2e['last_record_to_model_ms']:.0f} ms; of which round closed → model published: "
          f"{e2e['close_to_publish_ms']} ms (n = {k_e2e + 1:,}, d = 14)\n")
    _md(["d", "solve median (ms)", "solve max (ms)"], solve_times())
    print(f"\n### Memory (target {TARGETS['bytes']})\n")
    _md(["records folded", "A and b bytes", "open-round hash, MEMORY USAGE", "offsets bytes",
         "replay ids bytes", "bytes per replay id"], memory(args.quick, figures))
    print(f"\naggregator peak RSS: {e2e['agg_peak_rss_mb']:.0f} MiB")


def _scale_out_table(k_scale: int) -> None:
    print(f"### Scale-out: k aggregator processes, each folding its own partition of one study or "
          f"of its own study, on one Redis and on a Redis Cluster, no broker ({k_scale:,} "
          f"records each, batches of 5,000, d = 14; every process and redis-server shares this "
          f"machine's {os.cpu_count()} cores)\n")
    _md(["Redis", "studies", "processes", "records folded", "records/s",
         "retried folds (WATCH conflicts)", "redis-server CPU (all nodes)"], scale_out(k_scale))


def _md(header: list[str], rows: list[list[str]]) -> None:
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")



if __name__ == "__main__":
    sys.exit(main())
