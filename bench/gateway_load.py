"""Batched uploads over HTTP, measured: uploader → gateway → Kafka → aggregator → Redis, on the embedded
broker, with every service a real child process.

    python -m bench.gateway_load [--records 200000] [--connections 8] [--per-request 1000]

:func:`gateway_e2e` returns the figures as a dict (``gateway_e2e_records_per_second`` is from
the first POST to the last record folded in Redis); :func:`hot_path` times the gateway's own
per-request work without HTTP or Kafka; :func:`print_tables` prints both as markdown. Nothing
is asserted.
"""

from __future__ import annotations

import argparse
import os
import queue
import subprocess
import sys
import threading
import time

import numpy as np

from bench.process_tree import cpu_seconds
from gateway.checks import why_refused
from ipdp import state
from ipdp.embedded import EmbeddedRuntime
from ipdp.embedded.children import free_port
from ipdp.kafka_io import ensure_topics, kafka_consumer, kafka_producer
from ipdp.redis_io import redis_client
from ipdp.settings import RecordWindowSettings, TopicSettings
from ipdp.study import Study
from ipdp.wire import container_count, container_of, record_size
from producer.contributor import perturb_records
from producer.gateway_client import GatewayClient

__all__ = ["gateway_e2e", "hot_path", "print_tables"]


def request_bodies(study: Study, records: int, per_request: int, seed: int) -> list[bytes]:
    """Request bodies of ``per_request`` perturbed records each (the devices' work, done ahead)."""
    rng = np.random.default_rng(seed)
    out = []
    for lo in range(0, records, 20_000):
        k = min(20_000, records - lo)
        x = rng.normal(size=(k, study.d)) / np.sqrt(study.d)
        x /= np.maximum(1.0, np.linalg.norm(x, axis=1, keepdims=True))
        values = perturb_records(study, x, np.clip(x[:, 0], -1, 1), rng)[1]
        out += [b"".join(values[i:i + per_request]) for i in range(0, k, per_request)]
    return out


def post_all(url: str, study_id: str, bodies: list[bytes], connections: int) -> None:
    """POST ``bodies`` to a gateway over ``connections`` keep-alive connections, one thread
    each; raises unless every one is answered 202."""
    work: queue.Queue[bytes | None] = queue.Queue()
    for b in bodies:
        work.put(b)
    for _ in range(connections):
        work.put(None)
    refused: list[int] = []

    def client() -> None:
        with GatewayClient(url) as c:
            while (body := work.get()) is not None:
                answer = c.post_records(study_id, body)
                if answer.status != 202:
                    refused.append(answer.status)

    threads = [threading.Thread(target=client) for _ in range(connections)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if refused:
        raise RuntimeError(f"the gateway refused {len(refused)} requests: {sorted(set(refused))}")


def _bare_consume(kafka, topic: str, records: int) -> float:
    """Records/s of a bare kafka-python consumer reading the same containers (no decoding)."""
    from kafka import TopicPartition

    consumer = kafka_consumer(kafka, group_id=None)
    try:
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic))]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        got, first, deadline = 0, None, time.monotonic() + 120
        while got < records and time.monotonic() < deadline:
            for msgs in consumer.poll(timeout_ms=500).values():
                first = first or time.perf_counter()
                got += sum(container_count(m.value) for m in msgs)
        return got / (time.perf_counter() - first)
    finally:
        consumer.close()


def gateway_e2e(records: int = 200_000, *, d: int = 14, connections: int = 8,
                per_request: int = 1000, workers: int = 1, aggregators: int = 1,
                partitions: int = 4) -> dict:
    """Records/s from the first POST to the last record folded in Redis, and where time goes.

    The request bodies are built before the clock starts (devices perturb in parallel on their
    own hardware); ``connections`` client threads then POST them over keep-alive connections to
    an ``ipdp gateway`` child process, and an ``ipdp aggregator run`` child folds them.
    """
    with EmbeddedRuntime() as rt:
        kafka = rt.kafka_settings()
        topics = TopicSettings(records="bench.gw.records", models="bench.gw.models",
                               dead_letter="bench.gw.dlq", studies="bench.gw.studies",
                               records_partitions=partitions)
        ensure_topics(kafka, topics)
        study = Study(study_id="bench-gateway", d=d, n=records + 1, epsilon=1.0, delta=0.01)
        r = redis_client(rt.redis_settings())
        producer = kafka_producer(kafka)
        state.create_study(r, producer, topics, study)
        producer.close()
        bodies = request_bodies(study, records, per_request, seed=1)

        port = free_port()
        env = {**os.environ, **rt.env(), "IPDP_METRICS_PORT": "0", "IPDP_LOG_LEVEL": "WARNING",
               "IPDP_TOPIC_RECORDS": topics.records, "IPDP_TOPIC_MODELS": topics.models,
               "IPDP_TOPIC_DEAD_LETTER": topics.dead_letter, "IPDP_TOPIC_STUDIES": topics.studies,
               "IPDP_GATEWAY_HOST": "127.0.0.1", "IPDP_GATEWAY_PORT": str(port),
               "IPDP_GATEWAY_WORKERS": str(workers),
               # The load generator uploads batches from this one address: a relay.
               "IPDP_GATEWAY_RELAY_ADDRESSES": "127.0.0.1",
               "IPDP_GATEWAY_RELAY_RECORD_LIMIT_PER_S": "1e9",
               "IPDP_GATEWAY_RELAY_RECORD_LIMIT_BURST": "1000000000"}
        gw = subprocess.Popen([sys.executable, "-m", "ipdp.cli", "gateway"], env=env)
        aggs = [subprocess.Popen([sys.executable, "-m", "ipdp.cli", "aggregator", "run"], env=env)
                for _ in range(aggregators)]
        try:
            url = f"http://127.0.0.1:{port}"
            with GatewayClient(url, timeout_s=5) as c:
                c.wait_ready(60, alive=lambda: gw.poll() is None)
            # One warm-up request: the aggregator's group join and first fetch are not ingest.
            # Every worker must be ready: post until one is accepted by each (keep-alive
            # connections spread over the workers).
            warm = request_bodies(study, 1, 1, seed=2)[0]
            deadline = time.monotonic() + 60
            while True:
                with GatewayClient(url) as c:
                    if c.post_records(study.study_id, warm).status == 202:
                        break
                if time.monotonic() > deadline:
                    raise TimeoutError("the gateway accepted nothing within 60 s")
                time.sleep(0.2)
            time.sleep(3 if workers > 1 else 0)
            key = state.StudyKeys(study.study_id).counts
            deadline = time.monotonic() + 60
            while int(r.hget(key, "folded") or 0) < 1:
                if time.monotonic() > deadline:
                    raise TimeoutError("the aggregator folded nothing within 60 s")
                time.sleep(0.01)

            pids = {"gateway": [gw.pid], "aggregator": [a.pid for a in aggs],
                    "broker": [rt.broker.pid], "redis": [rt.redis.pid]}
            cpu0 = {name: sum(map(cpu_seconds, p)) for name, p in pids.items()}
            client_cpu0 = time.process_time()
            t0 = time.perf_counter()
            post_all(url, study.study_id, bodies, connections)
            t_http = time.perf_counter() - t0
            deadline = time.monotonic() + 300
            while int(r.hget(key, "folded") or 0) < records + 1:
                if any(a.poll() is not None for a in aggs):
                    raise RuntimeError("an aggregator exited early")
                if time.monotonic() > deadline:
                    raise TimeoutError("the aggregator did not fold every record within 300 s")
                time.sleep(0.002)
            t_total = time.perf_counter() - t0
            cpu = {name: sum(map(cpu_seconds, p)) - cpu0[name] for name, p in pids.items()}
            cpu["clients"] = time.process_time() - client_cpu0
            bare = _bare_consume(kafka, topics.records, records + 1)
        finally:
            for proc in (gw, *aggs):
                proc.terminate()
            for proc in (gw, *aggs):
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    return {
        "records": records,
        "d": d,
        "connections": connections,
        "per_request": per_request,
        "gateway_workers": workers,
        "aggregators": aggregators,
        "gateway_e2e_records_per_second": records / t_total,
        "gateway_accept_records_per_second": records / t_http,
        "cpu_us_per_record": {name: c / records * 1e6 for name, c in cpu.items()},
        "cores_busy": sum(cpu.values()) / t_total,
        "bare_consumer_records_per_second": bare,
        "seconds": t_total,
    }


def hot_path(per_request: int = 1000, d: int = 14, repeat: int = 200) -> dict:
    """The gateway's per-request work without HTTP or Kafka: checks, then one container."""
    study = Study(study_id="bench-hot", d=d, n=10_000, epsilon=1.0, delta=0.01)
    body = request_bodies(study, per_request, per_request, seed=3)[0]
    window, now_ms = RecordWindowSettings().window(), time.time_ns() // 1_000_000
    assert why_refused(body, study, window, now_ms) is None
    k = len(body) // record_size(d)
    t0 = time.perf_counter()
    for _ in range(repeat):
        why_refused(body, study, window, now_ms)
        container_of(body, k)
    per = (time.perf_counter() - t0) / repeat
    return {"per_request": per_request, "d": d, "us_per_request": per * 1e6,
            "us_per_record": per / per_request * 1e6,
            "records_per_second": per_request / per}


def print_tables(e2e: dict, hot: list[dict]) -> None:
    """Markdown tables of :func:`gateway_e2e` and :func:`hot_path` results."""
    print(f"### Batched uploads over HTTP: gateway end to end, {e2e['records']:,} records, d = "
          f"{e2e['d']}, {e2e['per_request']} records per POST, {e2e['connections']} connections, "
          f"{e2e['gateway_workers']} gateway worker(s), {e2e['aggregators']} aggregator(s)\n")
    print("| what | figure |")
    print("|---|---|")
    print(f"| first POST → last record folded in Redis | "
          f"{e2e['gateway_e2e_records_per_second']:,.0f} records/s |")
    print(f"| first POST → last 202 (Kafka acknowledged) | "
          f"{e2e['gateway_accept_records_per_second']:,.0f} records/s |")
    for name, us in e2e["cpu_us_per_record"].items():
        print(f"| {name} CPU per record | {us:.2f} µs |")
    print(f"| bare consumer of the same containers, afterwards | "
          f"{e2e['bare_consumer_records_per_second']:,.0f} records/s |")
    print(f"| cores busy on average (all of the above) | {e2e['cores_busy']:.2f} of "
          f"{os.cpu_count()} |")
    print("\nThe gateway's own work per request (checks + container, no HTTP, no Kafka):\n")
    print("| records per request | µs per request | µs per record | records/s on one core |")
    print("|---|---|---|---|")
    for h in hot:
        print(f"| {h['per_request']} | {h['us_per_request']:.0f} | {h['us_per_record']:.2f} | "
              f"{h['records_per_second']:,.0f} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m bench.gateway_load",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=200_000)
    p.add_argument("--connections", type=int, default=8)
    p.add_argument("--per-request", dest="per_request", type=int, default=1000)
    p.add_argument("--workers", type=int, default=1, help="gateway worker processes")
    p.add_argument("--aggregators", type=int, default=1, help="aggregator processes")
    args = p.parse_args(argv)
    hot = [hot_path(k) for k in (1, 100, 1000, 3000)]
    e2e = gateway_e2e(args.records, connections=args.connections, per_request=args.per_request,
                      workers=args.workers, aggregators=args.aggregators)
    print_tables(e2e, hot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
