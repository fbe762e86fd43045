"""The path of a record, both ways a device sends it: straight to Kafka, and through the ingest
gateway. For each way, which of ipdp's files and functions one round's records pass through,
from the device's ``submit`` to the published model, and how long each stage takes a record.

    python -m bench.record_path [--records K] [--list]

Functions: the embedded runtime, one study of n records per way, the device, the aggregator and
the trainer in this process, every call into the project's code recorded (sys.setprofile on
every thread); the gateway is an `ipdp gateway` process of its own, so its functions are not
counted. Only the per-record path is traced: the study, the clients and the services are set
up first. The count is of distinct functions (comprehensions not counted), not of calls.

Times (a second pass, nothing traced): K records, one at a time, each device's
``Contributor.submit`` then ``flush``, with `ipdp gateway` and `ipdp aggregator run` as
processes. Per record: *device* (encode, clip, perturb: ``submit`` less what its transport
took), *delivery* (until Kafka acknowledged: the producer's send and flush, or the POST until
its 202, through the gateway's checks and its produce) and *fold* (acknowledged → the
aggregator's fold seen in Redis, polled each millisecond).
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from aggregator.service import Aggregator
from aggregator.settings import AggregatorSettings
from bench.runtime import register_studies, service_env
from ipdp import state
from ipdp.embedded import EmbeddedRuntime
from ipdp.embedded.children import free_port
from ipdp.redis_io import redis_client
from ipdp.settings import TopicSettings
from ipdp.study import Study
from producer.contributor import Contributor
from producer.gateway_client import GatewayClient
from producer.transport import Transport
from trainer.service import Trainer
from trainer.settings import TrainerSettings

ROOT = Path(__file__).resolve().parent.parent
ROLES = ("producer", "aggregator", "trainer", "ipdp")
SKIP = ("ipdp/embedded/", "ipdp/cli/", "bench/")
COMPREHENSIONS = ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>")
D, N = 4, 300
WAYS = ("Kafka", "HTTP")
STAGES = ("device", "delivery", "fold")


def _where(code) -> str | None:
    path = Path(code.co_filename)
    try:
        rel = path.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        # the same layout under another checkout (PYTHONPATH=... for a before/after count);
        # installed packages are not the project, even where a folder is named like a room
        # (kafka-python's kafka/producer/)
        parts = path.parts
        if "site-packages" in parts or "dist-packages" in parts:
            return None
        hits = [i for i, p in enumerate(parts) if p in ROLES]
        if not hits:
            return None
        rel = "/".join(parts[hits[-1]:])
    if not rel.startswith(tuple(f"{r}/" for r in ROLES)) or rel.startswith(SKIP):
        return None
    return rel


class Gateway:
    """`ipdp gateway` on a free loopback port for ``topics``; the bench's one address is a
    relay (it plays every device, one after the other)."""

    def __init__(self, rt: EmbeddedRuntime, topics: TopicSettings, log: Path) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        env = service_env(rt, topics, IPDP_GATEWAY_HOST="127.0.0.1", IPDP_GATEWAY_PORT=str(port),
                          IPDP_GATEWAY_RELAY_ADDRESSES="127.0.0.1")
        with log.open("wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "ipdp.cli", "gateway"], env=env,
                                         stdout=out, stderr=subprocess.STDOUT)

    def wait_for(self, study_id: str) -> None:
        """Until the gateway is ready and serves ``study_id``."""
        with GatewayClient(self.url, timeout_s=5) as client:
            client.wait_ready(60, alive=lambda: self.proc.poll() is None)
            deadline = time.monotonic() + 30
            while client.study(study_id) is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the gateway did not serve study {study_id} within 30 s")
                time.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def _device(way: str, study: Study, rt: EmbeddedRuntime, topics: TopicSettings, url: str,
            records: int) -> Contributor:
    """One Contributor playing ``records`` devices (a simulator), sending ``way``."""
    if way == "HTTP":
        return Contributor.connect(study.study_id, via=url, records_per_device=records)
    return Contributor.connect(study.study_id, rt.kafka_settings(), topics,
                               records_per_device=records)


def _rows(k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    x = np.random.default_rng(seed).normal(size=(k, D)) / 4
    return x, np.clip(x[:, 0], -1, 1)


def trace(rt: EmbeddedRuntime, directory: Path) -> dict[str, dict[str, set[str]]]:
    """Distinct functions per file, for one round of each way (module docstring)."""
    studies = {way: Study(study_id=f"path-{way.lower()}", d=D, n=N, epsilon=1.0, delta=0.01,
                          delta_in=0.5) for way in WAYS}
    topics = register_studies(rt, "path", studies.values())
    gateway = Gateway(rt, topics, directory / "gateway-traced.log")
    seen: dict[str, dict[str, set[str]]] = {way: collections.defaultdict(set) for way in WAYS}
    try:
        gateway.wait_for(studies["HTTP"].study_id)
        for way, study in studies.items():
            into = seen[way]

            def profile(frame, event, _arg, into=into):
                if event == "call":
                    where = _where(frame.f_code)
                    # Comprehensions are code objects of their own, not functions a reader
                    # follows.
                    if where is not None and not frame.f_code.co_name.endswith(COMPREHENSIONS):
                        into[where].add(frame.f_code.co_qualname)

            device = _device(way, study, rt, topics, gateway.url, study.n)
            aggregator = Aggregator(rt.kafka_settings(), rt.redis_settings(), topics,
                                    AggregatorSettings(group="path"))
            trainer = Trainer(rt.kafka_settings(), rt.redis_settings(), topics,
                              TrainerSettings(group="path", block_ms=200))
            x, y = _rows(study.n, 1)
            threading.setprofile(profile)
            sys.setprofile(profile)
            try:
                for row, target in zip(x, y):
                    device.submit(row, float(target))
                device.flush()
                aggregator.run(idle_exit_s=3.0)
                published = trainer.run(idle_exit_s=3.0)
            finally:
                sys.setprofile(None)
                threading.setprofile(None)
            device.close()
            if published != 1:
                raise RuntimeError(f"{way}: {published} models published, not 1")
    finally:
        gateway.stop()
    return seen


class TimedTransport:
    """A transport that also keeps how long each send and flush took."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.delivery = inner.delivery
        self.seconds = 0.0

    def send(self, *args) -> None:
        t0 = time.perf_counter()
        self.inner.send(*args)
        self.seconds += time.perf_counter() - t0

    def flush(self, timeout_s: float | None = None) -> None:
        t0 = time.perf_counter()
        self.inner.flush(timeout_s)
        self.seconds += time.perf_counter() - t0

    def close(self) -> None:
        self.inner.close()


def _until(done: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout_s:.0f} s")
        time.sleep(0.001)


def time_stages(rt: EmbeddedRuntime, directory: Path, records: int) -> dict[str, np.ndarray]:
    """Seconds per record and stage, (records, 3), for each way (module docstring)."""
    studies = {way: Study(study_id=f"timed-{way.lower()}", d=D, n=10**6, epsilon=1.0,
                          delta=0.01) for way in WAYS}
    topics = register_studies(rt, "path-timed", studies.values())
    gateway = Gateway(rt, topics, directory / "gateway-timed.log")
    with (directory / "aggregator-timed.log").open("wb") as out:
        aggregator = subprocess.Popen(
            [sys.executable, "-m", "ipdp.cli", "aggregator", "run"],
            env=service_env(rt, topics), stdout=out, stderr=subprocess.STDOUT)
    r = redis_client(rt.redis_settings())
    times: dict[str, np.ndarray] = {}
    try:
        gateway.wait_for(studies["HTTP"].study_id)
        for way, study in studies.items():
            counts = state.StudyKeys(study.study_id).counts

            def folded(counts=counts) -> int:
                return int(r.hget(counts, "folded") or 0)

            # One record more than timed: the first pays the group join and first fetch.
            device = _device(way, study, rt, topics, gateway.url, records + 1)
            transport = device.transport = TimedTransport(device.transport)
            x, y = _rows(records + 1, 2)
            out = np.empty((records + 1, len(STAGES)))
            for i in range(records + 1):
                before = transport.seconds
                t0 = time.perf_counter()
                device.submit(x[i], float(y[i]))
                submitted, sending = time.perf_counter(), transport.seconds - before
                device.flush()
                acknowledged = time.perf_counter()
                _until(lambda i=i: folded() > i, f"{way} record {i}'s fold")
                out[i] = (submitted - t0 - sending, transport.seconds - before,
                          time.perf_counter() - acknowledged)
            device.close()
            times[way] = out[1:]
    finally:
        aggregator.terminate()
        aggregator.wait(timeout=30)
        gateway.stop()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=200, metavar="K",
                    help="Records timed per way, one at a time (default 200).")
    ap.add_argument("--list", action="store_true", help="Also name every function, per file.")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRuntime(Path(tmp) / "runtime") as rt:
        seen = trace(rt, Path(tmp))
        times = time_stages(rt, Path(tmp), args.records)
    for way, files in seen.items():
        leg = "device → Kafka" if way == "Kafka" else "device → `ipdp gateway` (not counted) → Kafka"
        print(f"\n{way}: {leg} → fold → model, one round of n = {N}\n")
        print("| file | distinct functions |\n|---|---|")
        for where in sorted(files):
            print(f"| {where} | {len(files[where])} |")
        print(f"\n{len(files)} files, {sum(len(v) for v in files.values())} distinct functions")
        if args.list:
            for where in sorted(files):
                print(f"\n{where}: {', '.join(sorted(files[where]))}")
    print(f"\nper record, ms ({args.records} records per way, one at a time)\n")
    print("| way | stage | median | p90 | p99 |\n|---|---|---|---|---|")
    for way, seconds in times.items():
        for j, stage in enumerate((*STAGES, "total")):
            column = seconds.sum(axis=1) if stage == "total" else seconds[:, j]
            p50, p90, p99 = np.percentile(column * 1000, [50, 90, 99])
            print(f"| {way} | {stage} | {p50:.2f} | {p90:.2f} | {p99:.2f} |")


if __name__ == "__main__":
    main()
