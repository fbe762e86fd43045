"""`ipdp bench two-server`: what the two-server mode costs, and how accurate its models are
(docs/benchmarks.md, "Two-server mode").

    python -m bench.two_server            # or: ipdp bench two-server

Sections, each one table:

1. **Device**: one record at a time, as a device makes it (producer.contributor.perturb_records
   with the OS's CSPRNG): encode → clip → perturb → (two-server: fixed point → shares → seal the
   helper's share) → wire bytes; records per CPU-second of this process, one-server and
   two-server, and the bytes each record puts on the wire. The browser SDK's
   (producer/web, built) the same way by bench/web_device.mjs, in headless Chromium and under
   Node.
2. **Leader's fold and helper**: a two-server study's version-3 records folded by the
   aggregator's own fold (aggregator.fold.Folder, the leader's Redis) with a real `ipdp helper
   run` process (its own redis-server) answering prepare and commit over HTTP. The leader's rate
   is records per second of wall time (this process, all its HTTP calls included); the helper's
   is records per CPU-second of the helper's process (one core's worth of its work).
3. **End to end**: the embedded runtime with `ipdp aggregator run`, `ipdp trainer run` and (for
   the two-server study) `ipdp helper run` as processes: n records already made by the devices
   are produced to Kafka, and the clock stops when the round's model is on the models topic; a
   one-server study at the same n and d runs through the same services just before.
4. **Accuracy**: the accuracy benchmark's data (bench.accuracy_data) and its linear and logistic
   tasks (bench.accuracy.TASKS), one-server against two-server at the same rows, (n, ε, δ) and
   seeds. One-server: every record perturbed by the device code (ipdp.losses.perturb), summed,
   solved as the trainer does. Two-server: every record through ipdp.two_server.perturb_two_server,
   the fixed-point encoding and its shares, each server's ring sum, the trainer's combination,
   dither and checks (trainer.two_server.dithered_sum, check_sum), the same solve. The device's
   Gaussian q-noise is the same draw on both sides (common random numbers); the linear noise
   cannot be shared (a Gaussian against a Skellam on the grid). The test error is the RMSE
   (linear) or 1 − accuracy (logistic) on held-out rows.

``--quick`` runs every section small (the smoke run of tests/bench/test_two_server.py);
``--json`` prints every figure as one JSON line on stdout and the tables on stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

#: Aggregator fold batch for the leader section: the aggregator's default IPDP_AGGREGATOR_MAX_BATCH.
FOLD_BATCH = 5_000
TOKEN = "bench-two-server-token"
DELTA = 0.01
MODEL_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Sizes:
    """How much each section runs: FULL (the documented table) or QUICK (``--quick``)."""

    d: int
    device_records: int
    fold_records: int
    fold_n: int
    e2e_n: int
    warm_up_n: int
    """n of the untimed warm-up round of each mode before the end-to-end runs (0: none)."""
    accuracy_n: tuple[int, ...]
    accuracy_epsilons: tuple[float, ...]
    accuracy_seeds: int
    accuracy_sources: tuple[str, ...]
    test_rows: int


FULL = Sizes(d=14, device_records=2_000, fold_records=50_000, fold_n=10_000, e2e_n=20_000, warm_up_n=1_000,
             accuracy_n=(2**13, 2**15, 2**17), accuracy_epsilons=(0.1, 1.0), accuracy_seeds=20,
             accuracy_sources=("synthetic", "flights"), test_rows=20_000)
QUICK = Sizes(d=14, device_records=50, fold_records=2_000, fold_n=1_000, e2e_n=1_000, warm_up_n=0,
              accuracy_n=(2**12,), accuracy_epsilons=(1.0,), accuracy_seeds=2,
              accuracy_sources=("synthetic",), test_rows=2_000)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="every section small (the test suite's "
                   "smoke run)")
    p.add_argument("--json", action="store_true", help="every figure as one JSON line on stdout; "
                   "the tables on stderr")
    p.add_argument("--skip-services", action="store_true", help="device and accuracy sections "
                   "only (no Redis, helper, Kafka)")
    p.add_argument("--skip-accuracy", action="store_true", help="no accuracy section")


def markdown_table(title: str, header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    """A title line, then the rows as a markdown table."""
    lines = [f"**{title}**", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, its threads and its live descendants (/proc):
    `ipdp helper run` serves from a granian worker process it starts."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    children = [int(c) for task in Path(f"/proc/{pid}/task").iterdir()
                for c in (task / "children").read_text().split()]
    return own + sum(_cpu_s(c) for c in children)


def _studies(d: int, n: int, helper_url: str, helper_key_b64: str, suffix: str):
    from ipdp.study import Study

    one = Study(study_id=f"bench-one-{suffix}", d=d, n=n, epsilon=1.0, delta=DELTA)
    two = Study(study_id=f"bench-two-{suffix}", d=d, n=n, epsilon=1.0, delta=DELTA,
                two_server={"helper_id": "bench-helper", "helper_url": helper_url,
                            "helper_key": helper_key_b64})
    return one, two


def _rows(d: int, k: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """k simulated devices' examples (‖x‖ ≤ 1/2, |y| ≤ 1): the costs do not depend on them."""
    x = np.clip(rng.normal(0.0, 0.4, (k, d)), -0.5, 0.5) / math.sqrt(d)
    return x, np.clip(x.sum(axis=1), -1.0, 1.0)


# --- 1. device -------------------------------------------------------------------------------

def device_section(sizes: Sizes, key_b64: str) -> dict:
    """Records per CPU-second, one record per call, and bytes per record on the wire."""
    from ipdp.losses import SystemNoise
    from producer.contributor import perturb_records

    one, two = _studies(sizes.d, 10_000, "http://127.0.0.1:1", key_b64, "device")
    x, y = _rows(sizes.d, sizes.device_records, np.random.default_rng(1))
    out = {}
    for name, study in (("one-server", one), ("two-server", two)):
        noise = SystemNoise()
        perturb_records(study, x[:1], y[:1], noise)  # warm-up: imports, key parsing
        sizes_seen = set()
        started = time.process_time()
        for i in range(len(y)):
            _, values = perturb_records(study, x[i:i + 1], y[i:i + 1], noise)
            sizes_seen.add(len(values[0]))
        cpu = time.process_time() - started
        (size,) = sizes_seen
        out[name] = {"records": len(y), "cpu_s": cpu, "records_per_cpu_second": len(y) / cpu,
                     "us_per_record": 1e6 * cpu / len(y), "bytes_per_record": size}
    return out


WEB_DEVICE = Path(__file__).with_name("web_device.mjs")
WEB_BUILD = Path(__file__).resolve().parent.parent / "producer" / "web" / "dist" / "src"


WEB_RUNS = {"chromium": ("in headless Chromium", ["--browser"]), "node": ("under Node", [])}
"""bench/web_device.mjs's two ways to run the browser SDK: in the browser, and in Node's V8."""


def web_device_section(records: int) -> dict[str, dict | str]:
    """The browser SDK's device step (bench/web_device.mjs) in Chromium and under Node: per
    way, its figures per mode, or why it did not run."""
    node = shutil.which("node")
    out: dict[str, dict | str] = {}
    for way, (_, flags) in WEB_RUNS.items():
        if node is None:
            out[way] = "not run: no `node` on PATH"
            continue
        if not (WEB_BUILD / "two-server.js").exists():
            out[way] = "not run: producer/web is not built (npm ci && npm run build there)"
            continue
        done = subprocess.run([node, str(WEB_DEVICE), str(records), *flags],
                              capture_output=True, text=True, timeout=600, check=False)
        if done.returncode != 0:
            out[way] = f"not run: {(done.stderr.strip().splitlines() or ['no output'])[-1]}"
            continue
        out[way] = {}
        for mode, v in json.loads(done.stdout).items():
            (size,) = v["bytes_per_record"]
            # Chromium's CPU is read in clock ticks: a short loop may show none.
            out[way][mode] = {"records": v["records"], "cpu_s": v["cpu_s"],
                              "wall_s": v["wall_s"],
                              "records_per_cpu_second": (v["records"] / v["cpu_s"]
                                                         if v["cpu_s"] > 0 else None),
                              "us_per_record": 1e6 * v["cpu_s"] / v["records"],
                              "wall_us_per_record": 1e6 * v["wall_s"] / v["records"],
                              "bytes_per_record": size}
    return out


def device_table(dev: dict, web: dict[str, dict | str], d: int) -> str:
    one_b = dev["one-server"]["bytes_per_record"]
    rows = [(f"Python SDK (producer.contributor.perturb_records), {name}",
             f"{v['records_per_cpu_second']:,.0f}", f"{v['us_per_record']:,.0f}", "—",
             f"{v['bytes_per_record']:,}", f"{v['bytes_per_record'] / one_b:.2f} ×")
            for name, v in dev.items()]
    notes = []
    for way, figures in web.items():
        where = WEB_RUNS[way][0]
        if isinstance(figures, str):
            notes.append(f"browser SDK {where}: {figures}")
            continue
        rows += [(f"browser SDK {where} (bench/web_device.mjs), {name}",
                  "—" if v["records_per_cpu_second"] is None
                  else f"{v['records_per_cpu_second']:,.0f}", f"{v['us_per_record']:,.0f}",
                  f"{v['wall_us_per_record']:,.0f}", f"{v['bytes_per_record']:,}",
                  f"{v['bytes_per_record'] / one_b:.2f} ×")
                 for name, v in figures.items()]
    table = markdown_table(
        f"Device, one record per call, d = {d} ({dev['one-server']['records']:,} records per "
        "row; noise and shares from the CSPRNG; Chromium's CPU is all its processes')",
        ("device", "records per CPU-second", "CPU µs per record", "wall µs per record",
         "bytes on the wire per record", "× one-server"), rows)
    return "\n\n".join([table, *notes])


# --- 2. leader's fold and the helper ------------------------------------------------------------

def fold_section(sizes: Sizes, work: Path) -> dict:
    """The aggregator's fold of version-3 records with a real helper process."""
    from aggregator.batch import Message
    from aggregator.fold import Folder
    from aggregator.two_server import HelperLink
    from bench.soak import Service, _inherited_env
    from ipdp import state
    from ipdp.embedded.children import free_port
    from ipdp.embedded.servers import EmbeddedRedis
    from ipdp.helper_client import HelperClient
    from ipdp.redis_io import redis_client
    from ipdp.sealing import generate_helper_key_files
    from ipdp.signing import SigningKey
    from producer.contributor import perturb_records

    key = generate_helper_key_files(work / "helper")
    owner = SigningKey(Ed25519PrivateKey.generate())
    port = free_port()
    _, study = _studies(sizes.d, sizes.fold_n, f"http://127.0.0.1:{port}", key.public_b64,
                        "fold")
    rng = np.random.default_rng(2)
    x, y = _rows(sizes.d, sizes.fold_records, rng)
    _, values = perturb_records(study, x, y, rng, grid_generator=rng, random_bytes=rng.bytes)
    with EmbeddedRedis(data_dir=work / "leader-redis") as leader_redis, \
            EmbeddedRedis(data_dir=work / "helper-redis") as helper_redis:
        r = redis_client(leader_redis.settings())
        state.register_study(r, study, owner)
        helper = Service("helper", {**_inherited_env(), "IPDP_HELPER_LEADER_TOKEN": TOKEN,
                                    "IPDP_TRUSTED_STUDY_KEYS": owner.public_b64,
                                    "IPDP_HELPER_HOST": "127.0.0.1",
                                    "IPDP_HELPER_PORT": str(port),
                                    "IPDP_HELPER_REDIS_URL": helper_redis.settings().url,
                                    "IPDP_HELPER_KEY_FILE": str(work / "helper.key")},
                         work / "helper.log")
        link = HelperLink(TOKEN)
        try:
            helper.start()
            with HelperClient(study.two_server.helper_url, TOKEN, retry_s=60) as client:
                client.request("GET", "/healthz")
            folder = Folder(r, group="bench-two", topic="t", replay_window_s=3600,
                            max_future_skew_s=60, max_message_bytes=1 << 20, helpers=link)
            # Warm-up: the first fold of a study loads it and opens the helper's connection.
            warm = FOLD_BATCH // 10
            folder.fold([Message(0, i, v) for i, v in enumerate(values[:warm])])
            helper_cpu = _cpu_s(helper.proc.pid)
            redis_cpu = _cpu_s(helper_redis.proc.pid)
            leader_redis_cpu = _cpu_s(leader_redis.proc.pid)
            folded = 0
            started, cpu_started = time.perf_counter(), time.process_time()
            for lo in range(warm, len(values), FOLD_BATCH):
                batch = values[lo:lo + FOLD_BATCH]
                result = folder.fold([Message(0, lo + i, v) for i, v in enumerate(batch)])
                folded += sum(result.folded.values())
            wall = time.perf_counter() - started
            leader_cpu = time.process_time() - cpu_started
            helper_cpu = _cpu_s(helper.proc.pid) - helper_cpu
            redis_cpu = _cpu_s(helper_redis.proc.pid) - redis_cpu
            leader_redis_cpu = _cpu_s(leader_redis.proc.pid) - leader_redis_cpu
            measured = len(values) - warm
            keys = state.StudyKeys(study.study_id)
            total_folded = int(r.hget(keys.counts, "folded") or 0)
            closed = sum(1 for _ in r.scan_iter(keys.closed("*")))
            with HelperClient(study.two_server.helper_url, TOKEN) as client:
                helper_rounds = sum(client.round_share(study.study_id, k) is not None
                                    for k in range(1, closed + 2))
        finally:
            link.close()
            helper.stop()
    return {"records": measured, "folded": folded, "folded_in_redis": total_folded,
            "sent": len(values), "n": sizes.fold_n, "batch": FOLD_BATCH,
            "closed_rounds_leader": closed, "full_rounds_helper": helper_rounds,
            "wall_s": wall, "leader_records_per_second": measured / wall,
            "leader_cpu_s": leader_cpu, "leader_records_per_cpu_second": measured / leader_cpu,
            "helper_cpu_s": helper_cpu, "helper_records_per_cpu_second": measured / helper_cpu,
            "helper_redis_cpu_s": redis_cpu, "leader_redis_cpu_s": leader_redis_cpu}


def fold_table(f: dict, d: int) -> str:
    rows = [
        ("leader: records/s (wall; its fold, Redis transaction and HTTP calls to the helper)",
         f"{f['leader_records_per_second']:,.0f}", ""),
        ("leader: records per CPU-second of the leader's process",
         f"{f['leader_records_per_cpu_second']:,.0f}", ""),
        ("helper: records per CPU-second of `ipdp helper run` (prepare + commit over HTTP)",
         f"{f['helper_records_per_cpu_second']:,.0f}", "≥ 10,000"),
        ("helper's redis-server CPU µs per record",
         f"{1e6 * f['helper_redis_cpu_s'] / f['records']:.1f}", ""),
        ("leader's redis-server CPU µs per record",
         f"{1e6 * f['leader_redis_cpu_s'] / f['records']:.1f}", ""),
        ("records folded (measured / all, leader's count in Redis)",
         f"{f['folded']:,} / {f['folded_in_redis']:,} of {f['sent']:,}", ""),
        ("full rounds: leader closed / helper holds",
         f"{f['closed_rounds_leader']} / {f['full_rounds_helper']}", ""),
    ]
    return markdown_table(
        f"Leader's fold with a real helper, d = {d}, n = {f['n']:,}, folds of {f['batch']:,} "
        f"records ({f['records']:,} records timed after a warm-up fold)",
        ("what", "figure", "target"), rows)


# --- 3. end to end ---------------------------------------------------------------------------

def e2e_section(sizes: Sizes, work: Path) -> dict:
    """devices → Kafka → aggregator (+ helper) → trainer → model, one-server then two-server."""
    from bench.soak import Service, _inherited_env
    from ipdp import state
    from ipdp.embedded.children import free_port
    from ipdp.embedded.runtime import EmbeddedRuntime
    from ipdp.embedded.servers import EmbeddedRedis
    from ipdp.helper_client import HelperClient
    from ipdp.kafka_io import kafka_producer
    from ipdp.redis_io import redis_client
    from ipdp.sealing import generate_helper_key_files
    from ipdp.signing import SigningKey
    from ipdp.subscriber import ModelSubscriber
    from ipdp.wire import study_headers
    from producer.contributor import perturb_records
    from producer.transport import split_ids

    key = generate_helper_key_files(work / "e2e-helper")
    owner = SigningKey(Ed25519PrivateKey.generate())
    port = free_port()
    # A warm-up round of each mode first, untimed: the aggregator's group join, the trainer's
    # first study and the helper's first job are start-up, not throughput.
    url = f"http://127.0.0.1:{port}"
    warm = _studies(sizes.d, sizes.warm_up_n, url, key.public_b64, "warm") \
        if sizes.warm_up_n else ()
    timed = _studies(sizes.d, sizes.e2e_n, url, key.public_b64, "e2e")
    studies = (*warm, *timed)
    rng = np.random.default_rng(3)
    made = []
    for s in studies:
        x, y = _rows(sizes.d, s.n, rng)
        made.append(perturb_records(s, x, y, rng, grid_generator=rng, random_bytes=rng.bytes))
    out = {}
    with EmbeddedRuntime(work / "runtime") as rt, \
            EmbeddedRedis(data_dir=work / "e2e-helper-redis") as helper_redis, ExitStack() as stack:
        kafka, topics = rt.kafka_settings(), rt.topics
        producer = kafka_producer(kafka)
        stack.callback(producer.close)
        for s in studies:
            state.create_study(redis_client(rt.redis_settings()), producer, topics, s, owner)
        base = {**_inherited_env(), **rt.env(), "IPDP_HELPER_LEADER_TOKEN": TOKEN,
                "IPDP_TRUSTED_STUDY_KEYS": owner.public_b64, "IPDP_METRICS_PORT": "0"}
        services = [
            Service("helper", {**base, "IPDP_HELPER_HOST": "127.0.0.1",
                               "IPDP_HELPER_PORT": str(port),
                               "IPDP_HELPER_REDIS_URL": helper_redis.settings().url,
                               "IPDP_HELPER_KEY_FILE": str(work / "e2e-helper.key")},
                    work / "e2e-helper.log"),
            Service("aggregator", base, work / "e2e-aggregator.log"),
            Service("trainer", base, work / "e2e-trainer.log")]
        for service in services:
            service.start()
            stack.callback(service.stop)
        with HelperClient(timed[1].two_server.helper_url, TOKEN, retry_s=60) as client:
            client.request("GET", "/healthz")
        timing_flags = (False,) * len(warm) + (True,) * len(timed)
        for timing, study, (ids, values) in zip(timing_flags, studies, made, strict=True):
            mode = "two-server" if study.two_server else "one-server"
            keys, headers = split_ids(ids), study_headers(study.study_id)
            with ModelSubscriber(kafka, topics, study_id=study.study_id) as models:
                started = time.perf_counter()
                for k, v in zip(keys, values, strict=True):
                    producer.send(topics.records, key=k, value=v, headers=headers)
                producer.flush()
                produced = time.perf_counter() - started
                model = None
                while model is None:
                    if time.perf_counter() - started > MODEL_TIMEOUT_S:
                        raise TimeoutError(f"no {mode} model within {MODEL_TIMEOUT_S:.0f} s; "
                                           f"logs in {work}")
                    for service in services:
                        if service.proc.poll() is not None:
                            raise RuntimeError(f"{service.role} exited; its log: "
                                               f"{service.log_path}")
                    model = next(iter(models), None)
                    if model is None:
                        time.sleep(0.05)
                elapsed = time.perf_counter() - started
            if not timing:
                continue
            out[mode] = {"n": study.n, "produce_s": produced, "to_model_s": elapsed,
                         "records_per_second": study.n / elapsed,
                         "bytes_per_record": len(values[0]), "round": model.round}
    return out


def e2e_table(e: dict, d: int) -> str:
    one = e["one-server"]["records_per_second"]
    rows = [(mode, f"{v['n']:,}", f"{v['produce_s']:.2f}", f"{v['to_model_s']:.2f}",
             f"{v['records_per_second']:,.0f}", f"{v['records_per_second'] / one:.2f}")
            for mode, v in e.items()]
    return markdown_table(
        f"End to end on the embedded runtime, d = {d}: first record produced → the round's "
        "model on the models topic (records made beforehand; aggregator, trainer and helper as "
        "`ipdp … run` processes)",
        ("mode", "n", "produce s", "to model s", "records/s", "× one-server"), rows)


# --- 4. accuracy ------------------------------------------------------------------------------

class _Streams:
    """A NoiseSource whose draws alternate between two generators: ipdp.losses.perturb draws u
    then r, ipdp.two_server.perturb_two_server draws u only, so both sides' u come from the q
    stream in the same order (common random numbers)."""

    def __init__(self, q_stream: np.random.Generator, p_stream: np.random.Generator | None):
        self.streams = (q_stream, p_stream)
        self.calls = 0

    def normal(self, loc=0.0, scale=1.0, size=None):
        stream = self.streams[self.calls % 2 if self.streams[1] is not None else 0]
        self.calls += 1
        return stream.normal(loc, scale, size)


ACCURACY_CHUNK = 2**15


def _one_server_model(q, p, cal, task, seed):
    from ipdp.losses import perturb
    from trainer.solver import solve_constrained

    d = q.shape[1]
    noise = _Streams(np.random.default_rng([seed, 1]), np.random.default_rng([seed, 2]))
    a, b = np.zeros((d, d)), np.zeros(d)
    for lo in range(0, len(q), ACCURACY_CHUNK):
        qt, pt = perturb(q[lo:lo + ACCURACY_CHUNK], p[lo:lo + ACCURACY_CHUNK], cal, noise)
        a += qt.T @ qt
        b += pt.sum(axis=0)
    return solve_constrained(a + cal.delta_in * np.eye(d), b, task.eta).w


def _two_server_model(q, p, two, task, seed):
    from ipdp.fixed_point import combine, encode, fold, split
    from ipdp.two_server import perturb_two_server
    from trainer.solver import solve_constrained
    from trainer.two_server import check_sum, dithered_sum, sum_bounds

    noise = _Streams(np.random.default_rng([seed, 1]), None)
    grid, shares = np.random.default_rng([seed, 3]), np.random.default_rng([seed, 4])
    leader_sum = helper_sum = None
    for lo in range(0, len(q), ACCURACY_CHUNK):
        qt, ph = perturb_two_server(q[lo:lo + ACCURACY_CHUNK], p[lo:lo + ACCURACY_CHUNK], two,
                                    noise, grid)
        values, _ = encode(qt, ph, two.encoding)
        leader, helper = split(values, shares.bytes)
        parts = (fold(leader), fold(helper))
        if leader_sum is None:
            leader_sum, helper_sum = parts
        else:
            leader_sum, helper_sum = fold(np.stack([leader_sum, parts[0]])), \
                fold(np.stack([helper_sum, parts[1]]))
    a, b = dithered_sum(combine(leader_sum, helper_sum), two, np.random.default_rng([seed, 5]))
    check_sum(a, b, sum_bounds(two), "bench")
    return solve_constrained(a + two.delta_in * np.eye(len(b)), b, task.eta).w


def _source(name: str):
    from bench.accuracy_data import Flights, Synthetic

    return Synthetic() if name == "synthetic" else Flights.load(split_seed=0)


def accuracy_section(sizes: Sizes) -> tuple[list[dict], list[str]]:
    from bench.accuracy import TASKS
    from bench.accuracy_data import DataUnavailable
    from ipdp.calibration import CalibrationError, calibrate
    from ipdp.losses import clip, encode
    from ipdp.two_server import calibrate_two_server

    tasks = [t for t in TASKS if t.domain == "ball"]
    cells, notes = [], []
    for source_name in sizes.accuracy_sources:
        try:
            source = _source(source_name)
        except DataUnavailable as exc:
            notes.append(f"{source_name}: not run: {exc}")
            continue
        d = source.d
        x_test, y_test = source.test_rows(np.random.default_rng([7, 0]), sizes.test_rows)
        for task in tasks:
            t_test = task.targets(y_test)
            for epsilon in sizes.accuracy_epsilons:
                for n in sizes.accuracy_n:
                    if n > source.n_train_pool:
                        continue
                    kw = {"epsilon": epsilon, "delta": DELTA, "n": n, "d": d,
                          "lam": task.lam, "p_bound": task.p_bound, "eta": task.eta,
                          "loss": task.loss, "delta_in": None}
                    try:
                        cal = calibrate(mode="rigorous", **kw)
                        two = calibrate_two_server(**kw)
                    except CalibrationError as exc:
                        notes.append(f"{source_name} {task.name} ε={epsilon:g} n={n}: "
                                     f"refused: {exc}")
                        continue
                    errors = np.zeros((sizes.accuracy_seeds, 2))
                    for seed in range(sizes.accuracy_seeds):
                        (xs, ys), = source.train_chunks(np.random.default_rng([seed, 0]), [n])
                        q, p = clip(*encode(task.loss, xs, task.targets(ys)), task.lam,
                                    task.p_bound)
                        for j, w in enumerate((_one_server_model(q, p, cal, task, seed),
                                               _two_server_model(q, p, two, task, seed))):
                            score = float(task.score((x_test @ w)[:, None], t_test)[0])
                            errors[seed, j] = score if task.lower_is_better else 1.0 - score
                    one, two_err = errors.mean(axis=0)
                    paired = errors[:, 1] - errors[:, 0]
                    se = (paired.std(ddof=1) / math.sqrt(len(paired))
                          if len(paired) > 1 else float("nan"))
                    cells.append({
                        "source": source_name, "task": task.name, "metric": (
                            "RMSE" if task.lower_is_better else "1 − accuracy"),
                        "epsilon": epsilon, "n": n, "seeds": sizes.accuracy_seeds,
                        "one_server": float(one), "two_server": float(two_err),
                        "relative_difference": float(two_err / one - 1.0),
                        "relative_se": float(se / one),
                        "sigma_b2_ratio": two.sigma_b2 / cal.sigma_b2})
    return cells, notes


def accuracy_table(cells: list[dict]) -> str:
    rows = [(c["source"], c["task"], c["metric"], f"{c['epsilon']:g}",
             f"2^{int(math.log2(c['n']))}", f"{c['one_server']:.4f}", f"{c['two_server']:.4f}",
             f"{100 * c['relative_difference']:+.2f} %",
             f"{100 * c['relative_se']:.2f} %", f"{c['sigma_b2_ratio']:.4f}")
            for c in cells]
    seeds = cells[0]["seeds"] if cells else 0
    return markdown_table(
        f"Accuracy, two-server against one-server, same rows and seeds (mean test error over "
        f"{seeds} seeds; δ = {DELTA})",
        ("data", "task", "test error", "ε", "n", "one-server", "two-server", "relative difference",
         "its standard error", "σ_b² two / one"), rows)


def accuracy_verdict(cells: list[dict]) -> dict:
    """The largest |relative difference|, and the cells beyond 1 % with those of them whose
    difference is within two standard errors of zero (the linear noise's independent draws)."""
    beyond = [c for c in cells if abs(c["relative_difference"]) > 0.01]
    return {"accuracy_largest_relative_difference": max(abs(c["relative_difference"])
                                                        for c in cells),
            "accuracy_cells": len(cells), "accuracy_cells_beyond_1_percent": len(beyond),
            "accuracy_beyond_within_two_standard_errors": sum(
                abs(c["relative_difference"]) <= 2 * c["relative_se"] for c in beyond)}


def accuracy_verdict_text(v: dict) -> str:
    return (f"largest |relative difference|: {100 * v['accuracy_largest_relative_difference']:.2f} "
            f"% (target ≤ 1 %); cells beyond 1 %: {v['accuracy_cells_beyond_1_percent']} of "
            f"{v['accuracy_cells']}, of which within two standard errors of 0: "
            f"{v['accuracy_beyond_within_two_standard_errors']}")


# --- command ------------------------------------------------------------------------------------

def run(args: argparse.Namespace) -> int:
    from ipdp.sealing import generate_helper_key_files

    sizes = QUICK if args.quick else FULL
    out = sys.stderr if args.json else sys.stdout
    cores = os.cpu_count()
    load = os.getloadavg()
    header = (f"Machine: {cores} cores, load average {load[0]:.1f} at the start "
              "(other work shares the cores)")
    print(header + "\n", file=out)
    result: dict = {"d": sizes.d, "quick": args.quick, "cores": cores, "load_start": load[0]}
    with tempfile.TemporaryDirectory(prefix="ipdp-bench-two-server-") as tmp:
        work = Path(tmp)
        key = generate_helper_key_files(work / "device-helper")
        result["device"] = device_section(sizes, key.public_b64)
        result["web_device"] = web_device_section(sizes.device_records)
        print(device_table(result["device"], result["web_device"], sizes.d) + "\n", file=out,
              flush=True)
        if not args.skip_services:
            result["fold"] = fold_section(sizes, work)
            print(fold_table(result["fold"], sizes.d) + "\n", file=out, flush=True)
            result["end_to_end"] = e2e_section(sizes, work)
            print(e2e_table(result["end_to_end"], sizes.d) + "\n", file=out, flush=True)
    if not args.skip_accuracy:
        cells, notes = accuracy_section(sizes)
        result["accuracy"], result["accuracy_notes"] = cells, notes
        print(accuracy_table(cells), file=out)
        if cells:
            result.update(accuracy_verdict(cells))
            print("\n" + accuracy_verdict_text(result), file=out)
        for note in notes:
            print(note, file=out)
    result["load_end"] = os.getloadavg()[0]
    if args.json:
        print(json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.two_server", allow_abbrev=False,
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
