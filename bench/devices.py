"""Devices, one record per request, driven by wrk: the gateway against a bare Starlette endpoint.

    ipdp bench devices [--seconds 15] [--connections 64] [--threads 2] [--workers 1 2]
                       [--repeat 1] [--json]

wrk (a C load generator, Debian's ``wrk``) posts one 272-byte d = 14 record per request, with a
fresh random record id each time, over ``--connections`` keep-alive connections. Each repetition
measures, one after the other on the same machine: a bare Starlette app on uvicorn that reads
the body and answers 202 (:data:`bare_app`), then ``ipdp gateway`` with each worker count, then
the first worker count again with records that name another study (every request refused with
400: what a client sending bad records costs the gateway, against what a device sending good
ones costs). An ``ipdp aggregator run`` folds each run's records after wrk stops (paused while
it runs, so that on a small machine it takes no CPU from the gateway's runs that the bare
endpoint's runs would not lose too; ``--fold-while-loading`` lets it fold alongside). Afterwards
the records on the topic, the records folded in Redis and the 202s wrk counted are compared:
every record Kafka holds is folded exactly once (none dead-lettered, none twice), and every 202
is among them (a request in flight when wrk stops may be acknowledged without wrk counting its
202, so the topic may hold up to ``--connections`` more per run). No Python client is in the
measured path. The per-client request and record limits are raised out of the way (one address
plays every device; their checks still run); every other limit is at its default.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bench.process_tree import cpu_seconds
from bench.runtime import register_studies, service_env
from ipdp import state
from ipdp.embedded import EmbeddedRuntime
from ipdp.embedded.children import free_port
from ipdp.kafka_io import kafka_consumer, kafka_producer
from ipdp.redis_io import redis_client
from ipdp.study import Study
from ipdp.wire import (
    CONTAINER_VERSION,
    RECORD_ID_BYTES,
    VERSION_BYTE,
    container_count,
    study_headers,
)
from producer.contributor import perturb_records
from producer.gateway_client import GatewayClient

__all__ = ["add_arguments", "bare_app", "measure", "run"]

D = 14
STUDY_ID = "bench-devices"
#: The study whose records the refused run posts to STUDY_ID's path (refused: study_mismatch).
OTHER_STUDY_ID = "bench-devices-other"


async def _accept(request: Request) -> Response:
    await request.body()
    return Response(b'{"accepted":1}', status_code=202, media_type="application/json")


async def _up(request: Request) -> Response:
    return Response(b"ok")


#: The bare endpoint: the same route, the body read, 202; nothing checked, nothing sent.
bare_app = Starlette(routes=[Route("/studies/{study_id}/records", _accept, methods=["POST"]),
                             Route("/healthz", _up)])

# One record, its id (bytes 24..40) replaced per request by 16 bytes from LuaJIT's generator,
# seeded per thread from /dev/urandom so no two threads (or runs) draw the same ids.
_LUA = """
local prefix, suffix = "%(prefix)s", "%(suffix)s"
local char, random = string.char, math.random
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/octet-stream"
function init(args)
  local f = io.open("/dev/urandom", "rb")
  local b = f:read(6)
  f:close()
  local seed = 0
  for i = 1, 6 do seed = seed * 256 + b:byte(i) end
  math.randomseed(seed)
end
function request()
  local id = char(random(0, 255), random(0, 255), random(0, 255), random(0, 255),
                  random(0, 255), random(0, 255), random(0, 255), random(0, 255),
                  random(0, 255), random(0, 255), random(0, 255), random(0, 255),
                  random(0, 255), random(0, 255), random(0, 255), random(0, 255))
  return wrk.format(nil, nil, nil, prefix .. id .. suffix)
end
function done(summary, latency, requests)
  io.write(string.format(
    "WRK-JSON {\\"requests\\": %%d, \\"status_errors\\": %%d, \\"socket_errors\\": %%d, " ..
    "\\"duration_us\\": %%d, \\"p50_us\\": %%d, \\"p99_us\\": %%d}\\n",
    summary.requests, summary.errors.status,
    summary.errors.connect + summary.errors.read + summary.errors.write
      + summary.errors.timeout,
    summary.duration, latency:percentile(50), latency:percentile(99)))
end
"""


def _lua_bytes(raw: bytes) -> str:
    return "".join(f"\\{b}" for b in raw)


#: One address plays every device: its limits are raised out of the way, not turned off, so
#: their cost per request stays in the measurement.
DEVICE_LIMITS_RAISED = {
    "IPDP_GATEWAY_RATE_LIMIT_PER_S": "1e9", "IPDP_GATEWAY_RATE_LIMIT_BURST": "1000000000",
    "IPDP_GATEWAY_RECORD_LIMIT_PER_S": "1e9", "IPDP_GATEWAY_RECORD_LIMIT_BURST": "1000000000"}


def wrk_script(study: Study, seed: int = 0) -> str:
    """The Lua script: one perturbed record of ``study``, a fresh random id per request."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(1, study.d)) / np.sqrt(study.d)
    record = perturb_records(study, x, np.clip(x[:, 0], -1, 1), rng)[1][0]
    return _LUA % {"prefix": _lua_bytes(record[:RECORD_ID_BYTES.start]),
                   "suffix": _lua_bytes(record[RECORD_ID_BYTES.stop:])}


def _wrk(url: str, script: Path, seconds: float, connections: int, threads: int) -> dict:
    """Run wrk once; its figures from the script's done()."""
    out = subprocess.run(
        ["wrk", f"-t{threads}", f"-c{connections}", f"-d{seconds:g}s", "--timeout", "30s",
         "-s", str(script), url], capture_output=True, text=True, timeout=seconds + 120,
        check=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("WRK-JSON "))
    figures = json.loads(line.removeprefix("WRK-JSON "))
    figures["accepted"] = figures["requests"] - figures["status_errors"]
    figures["requests_per_second"] = figures["requests"] / (figures["duration_us"] / 1e6)
    return figures


def start_server(server: str, env: dict, workers: int = 1) -> tuple[subprocess.Popen, str]:
    """A ``bare`` Starlette endpoint or an ``ipdp gateway`` of ``workers`` workers on a free
    loopback port, ready to serve: the process and its base URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    if server == "bare":
        cmd = [sys.executable, "-m", "uvicorn", "bench.devices:bare_app", "--host", "127.0.0.1",
               "--port", str(port), "--no-access-log", "--log-level", "warning",
               "--no-server-header"]
    else:
        cmd = [sys.executable, "-m", "ipdp.cli", "gateway", "--host", "127.0.0.1", "--port",
               str(port), "--workers", str(workers)]
    proc = subprocess.Popen(cmd, env=env)
    try:
        _wait_http(url, proc, "/healthz" if server == "bare" else "/readyz")
    except BaseException:
        _stop(proc)
        raise
    return proc, url


def _wait_http(url: str, proc: subprocess.Popen, ready: str) -> None:
    with GatewayClient(url, timeout_s=5) as c:
        c.wait_ready(60, ready, alive=lambda: proc.poll() is None)


def _stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _on_topic(kafka, topic: str, at_least: int, quiet_s: float = 5.0) -> int:
    """Records on the topic (the sum of its containers' counts), read by count until
    ``at_least`` arrived or nothing more came for 5 s (tansu's end offsets can stop short of
    the last record, so they are not the stop)."""
    from kafka import TopicPartition

    consumer = kafka_consumer(kafka, group_id=None)
    try:
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic))]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        got, quiet_since = 0, time.monotonic()
        while time.monotonic() - quiet_since < quiet_s and got < at_least:
            for msgs in consumer.poll(timeout_ms=500).values():
                got += sum(_count(m.value) for m in msgs)
                quiet_since = time.monotonic()
        # Anything beyond at_least (a record folded twice would hide behind one missing).
        for msgs in consumer.poll(timeout_ms=1000).values():
            got += sum(_count(m.value) for m in msgs)
        return got
    finally:
        consumer.close()


def _count(value: bytes) -> int:
    """Records in a message: a container's count, else one (a single record, a dead letter)."""
    return container_count(value) if value and value[VERSION_BYTE] == CONTAINER_VERSION else 1


def _settled(read: Callable[[], int], at_least: int, quiet_s: float = 3.0,
             timeout_s: float = 120.0) -> int:
    """``read()`` once it reached ``at_least`` and stopped changing for ``quiet_s``."""
    deadline = time.monotonic() + timeout_s
    last, since = read(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = read()
        if now != last:
            last, since = now, time.monotonic()
        elif now >= at_least and time.monotonic() - since >= quiet_s:
            break
    return last


def measure(*, seconds: float = 15, connections: int = 64, threads: int = 2,
            workers: tuple[int, ...] = (1, 2), repeat: int = 1, warmup_s: float = 1.0,
            fold_while_loading: bool = False) -> dict:
    """Run every repetition on one embedded runtime; the figures of each run and the check.

    The aggregator is paused (SIGSTOP) while wrk runs, unless ``fold_while_loading``, and folds
    the backlog after each run: on a small machine its CPU would otherwise go to the gateway's
    runs only, never to the bare endpoint's. Its CPU per record is measured on that backlog.
    """
    runs: list[dict] = []
    with EmbeddedRuntime() as rt, tempfile.TemporaryDirectory() as tmp:
        kafka = rt.kafka_settings()
        study = Study(study_id=STUDY_ID, d=D, n=10**8, epsilon=1.0, delta=0.01)
        topics = register_studies(rt, "bench.dev", [study])
        r = redis_client(rt.redis_settings())
        script = Path(tmp) / "device.lua"
        script.write_text(wrk_script(study))
        refused_script = Path(tmp) / "refused.lua"
        refused_script.write_text(wrk_script(Study(study_id=OTHER_STUDY_ID, d=D, n=10**8,
                                                   epsilon=1.0, delta=0.01)))
        env = service_env(rt, topics, **DEVICE_LIMITS_RAISED)
        aggregator = subprocess.Popen([sys.executable, "-m", "ipdp.cli", "aggregator", "run"],
                                      env=env)
        key = state.StudyKeys(STUDY_ID).counts

        def folded_now() -> int:
            return int(r.hget(key, "folded") or 0)

        try:
            # One record straight to Kafka, folded before anything is measured: the aggregator
            # has joined its group and read the study before it is ever paused.
            producer = kafka_producer(kafka)
            primer = perturb_records(study, np.zeros((1, D)), np.zeros(1),
                                     np.random.default_rng())[1][0]
            producer.send(topics.records, value=primer,
                          headers=study_headers(STUDY_ID)).get(timeout=30)
            producer.close()
            accepted_total = 1
            _settled(folded_now, 1, quiet_s=0)
            for rep in range(repeat):
                for server, n_workers, refused in [("bare", 1, False),
                                                   *(("gateway", w, False) for w in workers),
                                                   ("gateway", workers[0], True)]:
                    load = refused_script if refused else script
                    proc, url = start_server(server, env, n_workers)
                    try:
                        post = f"{url}/studies/{STUDY_ID}/records"
                        if not fold_while_loading:
                            os.kill(aggregator.pid, signal.SIGSTOP)
                        if warmup_s > 0:
                            accepted_total += _wrk(post, load, warmup_s, connections,
                                                   threads)["accepted"] * (server == "gateway")
                        cpu0 = cpu_seconds(proc.pid)
                        agg0, folded0 = cpu_seconds(aggregator.pid), folded_now()
                        figures = _wrk(post, load, seconds, connections, threads)
                        cpu = cpu_seconds(proc.pid) - cpu0
                    finally:
                        _stop(proc)
                        os.kill(aggregator.pid, signal.SIGCONT)
                    figures.update(repetition=rep + 1, server=server, workers=n_workers,
                                   refused=refused,
                                   server_cpu_us_per_request=cpu / max(1, figures["requests"])
                                   * 1e6)
                    if server == "gateway":  # (a refused run's: 0 unless one was not refused)
                        accepted_total += figures["accepted"]
                    if server == "gateway" and not refused:
                        folded = _settled(folded_now, accepted_total)
                        figures["aggregator_cpu_us_per_record"] = (
                            (cpu_seconds(aggregator.pid) - agg0) / max(1, folded - folded0)
                            * 1e6)
                    runs.append(figures)
            on_topic = _on_topic(kafka, topics.records, accepted_total)
            folded = _settled(folded_now, on_topic)
            if aggregator.poll() is not None:
                raise RuntimeError("the aggregator exited early")
            dead_letters = _on_topic(kafka, topics.dead_letter, 0, quiet_s=1)
        finally:
            _stop(aggregator)
    return {"runs": runs, "accepted": accepted_total, "on_topic": on_topic, "folded": folded,
            "dead_letters": dead_letters,
            "connections": connections, "threads": threads, "seconds": seconds,
            "repeat": repeat, "workers": list(workers), "fold_while_loading": fold_while_loading,
            "exactly_once": folded == on_topic and dead_letters == 0 and accepted_total <= on_topic
            <= accepted_total + connections * (2 if warmup_s > 0 else 1)
            * sum(r["server"] == "gateway" and not r["refused"] for r in runs),
            "all_refused": all(r["status_errors"] == r["requests"] > 0 and not r["socket_errors"]
                               for r in runs if r["refused"])}


def summary(result: dict) -> dict:
    """The headline figures: medians over the repetitions (one worker for the device figures)."""
    runs = result["runs"]

    def med(server: str, workers: int, key: str, refused: bool = False) -> float:
        return statistics.median(r[key] for r in runs if r["server"] == server
                                 and r["workers"] == workers and r["refused"] == refused)

    ratios = []
    for rep in {r["repetition"] for r in runs}:
        bare = next(r for r in runs if r["repetition"] == rep and r["server"] == "bare")
        gw = next(r for r in runs if r["repetition"] == rep and r["server"] == "gateway"
                  and r["workers"] == result["workers"][0] and not r["refused"])
        ratios.append(gw["requests_per_second"] / bare["requests_per_second"])
    first = result["workers"][0]
    out = {
        "device_requests_per_second": med("gateway", first, "requests_per_second"),
        "device_over_bare_starlette": statistics.median(ratios),
        "device_over_bare_starlette_runs": ratios,
        "device_p50_ms": med("gateway", first, "p50_us") / 1000,
        "device_p99_ms": med("gateway", first, "p99_us") / 1000,
        "device_gateway_workers": first,
        "bare_starlette_requests_per_second": med("bare", 1, "requests_per_second"),
        "gateway_cpu_us_per_request": med("gateway", first, "server_cpu_us_per_request"),
        "aggregator_cpu_us_per_record": med("gateway", first, "aggregator_cpu_us_per_record"),
        "accepted": result["accepted"], "on_topic": result["on_topic"],
        "folded": result["folded"], "dead_letters": result["dead_letters"],
        "exactly_once": result["exactly_once"],
        "refused_requests_per_second": med("gateway", first, "requests_per_second", True),
        "gateway_cpu_us_per_refused_request": med("gateway", first, "server_cpu_us_per_request",
                                                  True),
        "all_refused": result["all_refused"],
    }
    for w in result["workers"][1:]:
        out[f"device_requests_per_second_{w}_workers"] = med("gateway", w, "requests_per_second")
        out[f"device_p99_ms_{w}_workers"] = med("gateway", w, "p99_us") / 1000
    return out


def print_table(result: dict) -> None:
    """The markdown table of every run, then the exactly-once check and whether every request
    of the runs of another study's records was refused."""
    print(f"### Devices: one 272-byte d = {D} record per request, wrk -t{result['threads']} "
          f"-c{result['connections']} -d{result['seconds']:g}s, {os.cpu_count()} cores, "
          f"aggregator {'folding alongside' if result['fold_while_loading'] else 'folding after each run'}\n")
    print("| run | server | workers | requests/s | × bare | p50 ms | p99 ms | server CPU µs "
          "per request | aggregator CPU µs per record | non-202 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    bare = {}
    for r in result["runs"]:
        if r["server"] == "bare":
            bare[r["repetition"]] = r["requests_per_second"]
        name = ("bare Starlette + uvicorn" if r["server"] == "bare" else
                "`ipdp gateway`, every record another study's" if r["refused"] else
                "`ipdp gateway`")
        agg = r.get("aggregator_cpu_us_per_record")
        print(f"| {r['repetition']} | {name} | {r['workers']} | {r['requests_per_second']:,.0f} "
              f"| {r['requests_per_second'] / bare[r['repetition']]:.2f} "
              f"| {r['p50_us'] / 1000:.2f} | {r['p99_us'] / 1000:.2f} "
              f"| {r['server_cpu_us_per_request']:.0f} "
              f"| {'—' if agg is None else f'{agg:.1f}'} "
              f"| {r['status_errors'] + r['socket_errors']} |")
    print(f"\nRecords: {result['accepted']:,} acknowledged (the 202s wrk counted, warm-ups "
          f"included, and one record produced directly to start the aggregator), "
          f"{result['on_topic']:,} on the records topic, {result['folded']:,} folded in Redis, "
          f"{result['dead_letters']:,} dead-lettered: "
          f"{'every record on the topic folded exactly once' if result['exactly_once'] else 'MISMATCH'}.")
    print(f"Records of another study: "
          f"{'every request refused' if result['all_refused'] else 'NOT ALL REFUSED'} "
          f"(wrk counts an answer of status 400 or above).")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `ipdp bench devices`."""
    p.add_argument("--seconds", type=float, default=15, help="wrk's duration per server "
                   "(default 15).")
    p.add_argument("--connections", type=int, default=64, help="wrk's connections (default 64).")
    p.add_argument("--threads", type=int, default=2, help="wrk's threads (default 2).")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2],
                   help="Gateway worker counts to measure (default 1 2); the first one gives "
                        "the device_* figures.")
    p.add_argument("--repeat", type=int, default=1,
                   help="Repetitions of the whole set, to show the spread (default 1).")
    p.add_argument("--fold-while-loading", dest="fold_while_loading", action="store_true",
                   help="Let the aggregator fold while wrk runs (by default it is paused then "
                        "and folds each run's records afterwards).")
    p.add_argument("--quick", action="store_true",
                   help="A smoke run: 1 s per server, no warm-up, one worker.")
    p.add_argument("--json", action="store_true",
                   help="Print the headline figures as one JSON line on stdout (the table goes "
                        "to stderr).")


def run(args: argparse.Namespace) -> int:
    """`ipdp bench devices`: print the table (and the JSON line with --json)."""
    if args.quick:
        args.seconds, args.workers = 1, args.workers[:1]
    result = measure(seconds=args.seconds, connections=args.connections, threads=args.threads,
                     workers=tuple(args.workers), repeat=args.repeat,
                     warmup_s=0 if args.quick else 1.0,
                     fold_while_loading=args.fold_while_loading)
    with contextlib.redirect_stdout(sys.stderr if args.json else sys.stdout):
        print_table(result)
    if args.json:
        print(json.dumps(summary(result), sort_keys=True))
    return 0 if result["exactly_once"] and result["all_refused"] else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m bench.devices",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
