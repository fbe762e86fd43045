"""Floods against a live gateway on the embedded runtime: what an attack leaves honest devices.

    ipdp bench flood [--attack connections] [--probes 30] [--device-seconds 15] [--json]

``connections`` (bench/flood_connections.py): 16 addresses × 256 silent connections, re-opened
as the gateway closes them, from one /24 and from 16 /24s. For no flood and each layout, the
table gives the health probes from other addresses (one a second) answered within 2 s, the
slowest, and the device rate wrk measures alongside (one 272-byte record per request, 64
connections, as ``ipdp bench devices``) against the unflooded rate of the same run. One
``ipdp gateway`` worker at its default limits (the per-client rate limit raised out of the way,
as one address plays every device); everything on loopback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from bench.devices import D, _stop, _wrk, start_server, wrk_script
from bench.flood_connections import LAYOUTS, run_flood
from bench.gateway_load import _cpu_seconds
from ipdp import state
from ipdp.embedded import EmbeddedRuntime
from ipdp.kafka_io import ensure_topics, kafka_producer
from ipdp.redis_io import redis_client
from ipdp.settings import TopicSettings
from ipdp.study import Study

__all__ = ["add_arguments", "measure_connections", "run"]

STUDY_ID = "bench-flood"


def measure_connections(*, probes: int = 30, device_seconds: float = 15,
                        connections: int = 64, threads: int = 2) -> list[dict]:
    """One row per flood layout (and one without a flood): probes answered, device rate."""
    rows: list[dict] = []
    with EmbeddedRuntime() as rt, tempfile.TemporaryDirectory() as tmp:
        kafka = rt.kafka_settings()
        topics = TopicSettings(records="bench.flood.records", models="bench.flood.models",
                               dead_letter="bench.flood.dlq", studies="bench.flood.studies")
        ensure_topics(kafka, topics)
        study = Study(study_id=STUDY_ID, d=D, n=10**8, epsilon=1.0, delta=0.01)
        producer = kafka_producer(kafka)
        state.create_study(redis_client(rt.redis_settings()), producer, topics, study)
        producer.close()
        script = Path(tmp) / "device.lua"
        script.write_text(wrk_script(study))
        env = {**os.environ, **rt.env(), "IPDP_METRICS_PORT": "0", "IPDP_LOG_LEVEL": "WARNING",
               "IPDP_TOPIC_RECORDS": topics.records, "IPDP_TOPIC_MODELS": topics.models,
               "IPDP_TOPIC_DEAD_LETTER": topics.dead_letter,
               "IPDP_TOPIC_STUDIES": topics.studies, "IPDP_GATEWAY_RATE_LIMIT_PER_S": "1e9",
               "IPDP_GATEWAY_RATE_LIMIT_BURST": "1000000000"}
        gateway, url = start_server("gateway", env)
        try:
            for layout in (None, *LAYOUTS):
                device: dict = {}

                def load(device: dict = device) -> None:
                    device.update(_wrk(f"{url}/studies/{STUDY_ID}/records", script,
                                       min(device_seconds, probes), connections, threads))

                cpu, t0 = _cpu_seconds(gateway.pid), time.monotonic()
                result = run_flood(url, layout, probes=probes, beside=load)
                gateway_cpu = (_cpu_seconds(gateway.pid) - cpu) / (time.monotonic() - t0)
                rows.append({"attack": "connections", "layout": result.layout,
                             "probes": result.probes, "answered": result.answered,
                             "slowest_probe_s": result.slowest_s,
                             "opened": result.opened,
                             "flood_cpu_s": result.flood_cpu_s, "gateway_cpu": gateway_cpu,
                             "device_rps": device["accepted"] / (device["duration_us"] / 1e6),
                             "device_p99_ms": device["p99_us"] / 1000})
        finally:
            _stop(gateway)
    for row in rows:
        row["device_vs_unflooded"] = row["device_rps"] / rows[0]["device_rps"]
    return rows


def print_table(rows: list[dict]) -> None:
    out = sys.stderr
    print("| attack | flood from | probes answered ≤ 2 s | slowest probe | flood connections "
          "opened | flood CPU s | gateway CPU (cores) | device 202/s | × unflooded | "
          "device p99 |", file=out)
    print("|---|---|--:|--:|--:|--:|--:|--:|--:|--:|", file=out)
    for r in rows:
        slowest = "—" if r["slowest_probe_s"] is None else f"{r['slowest_probe_s']:.2f} s"
        print(f"| {r['attack']} | {r['layout']} | {r['answered']}/{r['probes']} | {slowest} | "
              f"{r['opened']:,} | {r['flood_cpu_s']:.1f} | {r['gateway_cpu']:.2f} | "
              f"{r['device_rps']:,.0f} | {r['device_vs_unflooded']:.2f} | "
              f"{r['device_p99_ms']:.1f} ms |", file=out)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--attack", choices=["connections"], default="connections",
                   help="Which flood: connections (silent connections from a few addresses).")
    p.add_argument("--probes", type=int, default=30,
                   help="Health probes per layout, one a second (default 30).")
    p.add_argument("--device-seconds", dest="device_seconds", type=float, default=15,
                   help="wrk's duration beside the probes (default 15; at most --probes).")
    p.add_argument("--json", action="store_true", help="Also print the rows as JSON on stdout.")


def run(args: argparse.Namespace) -> int:
    rows = measure_connections(probes=args.probes, device_seconds=args.device_seconds)
    print_table(rows)
    if args.json:
        print(json.dumps(rows, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.flood", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
