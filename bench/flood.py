"""Floods against a live gateway and aggregator: what an attack costs the service, and honest
devices, against what the same work costs when it is honest.

    ipdp bench flood [--attack resend|connections|both] [--records 100000] [--per-request 1000]
                     [--connections 4] [--quiet-seconds 5] [--repeat 3]
                     [--probes 30] [--device-seconds 15] [--json]

``resend`` (re-sent records, docs/security.md "Against a flood"): on the embedded runtime, an
``ipdp gateway`` and an ``ipdp aggregator run`` child process; N fresh d = 14 records are POSTed
through the gateway (``--per-request`` records per request, ``--connections`` client threads)
and folded: the *fold time* runs from the first POST to the last record folded in Redis. Then
the same N records are POSTed again, as the same requests: each is refused by the aggregator as
``replayed`` (and dead-lettered); the *refusal time* runs from the first re-sent POST to the last
refusal counted in Redis. Two honest devices run through a quiet phase (``--quiet-seconds``) and
through both floods, so the two phases carry the same load: one sends a record at a time and
waits until it is folded (its *fold latency*), the other posts one-record requests back to back
(the *honest device rate*, requests answered 202 per second). The honest devices' records name
studies of their own, so Redis's counts tell whose record was folded. The whole is repeated
``--repeat`` times with fresh records each time, and the ratio is the runs' median: every
figure is wall time on a shared machine, and the ratio compares two phases of one run.

The gateway is configured explicitly, and the table says so: the bench's client address is a
relay (``IPDP_GATEWAY_RELAY_ADDRESSES``, whose requests are not limited, with a record allowance
that covers the floods): one address stands for the many devices, or the relay, an attacker
would use, and for the honest devices too. Each request holds distinct records (the gateway
refuses a request holding one record id twice): the attacker re-sends records the service has
folded, which only the aggregator can recognise.

``connections`` (a connection flood against the shipped nginx edge in front of a gateway: silent
connections from a few addresses, and health probes from others) is bench/flood_connections.py's;
``both`` runs the two.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Self

import numpy as np

from bench import flood_connections
from bench.gateway_load import post_all, request_bodies
from bench.process_tree import cpu_seconds
from bench.runtime import register_studies, service_env
from ipdp import state
from ipdp.embedded import EmbeddedRuntime
from ipdp.embedded.children import free_port
from ipdp.redis_io import redis_client
from ipdp.study import Study
from producer.contributor import perturb_records
from producer.gateway_client import GatewayClient

__all__ = ["add_arguments", "measure_resend", "print_resend", "run"]

#: The gateway configuration of the bench: one address plays the relay every request comes from.
GATEWAY_ENV = {
    "IPDP_GATEWAY_RELAY_ADDRESSES": "127.0.0.1",
    "IPDP_GATEWAY_RELAY_RECORD_LIMIT_PER_S": "10000000",
    "IPDP_GATEWAY_RELAY_RECORD_LIMIT_BURST": "10000000",
}
#: How often the honest device's fold is looked for in Redis.
POLL_S = 0.002
#: The honest device's pause between two records.
PROBE_PAUSE_S = 0.1
WAIT_S = 600
#: Records the steady honest device has for one phase (it stops early when the phase ends).
STEADY_RECORDS = 50_000


def _study(study_id: str, n: int) -> Study:
    return Study(study_id=study_id, d=14, n=n, epsilon=1.0, delta=0.01)


def _folded(r, study: Study) -> int:
    return int(r.hget(state.StudyKeys(study.study_id).counts, "folded") or 0)


def _refused(r, study: Study, reason: str) -> int:
    return int(r.hget(state.StudyKeys(study.study_id).counts,
                      f"{state.REJECTED_FIELD}{reason}") or 0)


def _records(study: Study, k: int, seed: int) -> list[bytes]:
    """``k`` honest devices' records, one each."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(k, study.d)) / np.sqrt(study.d)
    x /= np.maximum(1.0, np.linalg.norm(x, axis=1, keepdims=True))
    return perturb_records(study, x, np.clip(x[:, 0], -1, 1), rng)[1]


def _wait(what: str, done, alive) -> float:
    """Wait until ``done()``; the time it became true (perf_counter)."""
    deadline = time.monotonic() + WAIT_S
    while not done():
        if not alive():
            raise RuntimeError(f"a service exited while waiting for {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {WAIT_S} s")
        time.sleep(POLL_S)
    return time.perf_counter()


class HonestDevices:
    """Two honest devices while a phase runs: one sends a record and waits for its fold (the
    latencies), one posts one-record requests back to back (the rate)."""

    def __init__(self, url: str, redis_settings, probe: Study, steady: Study, seed: int) -> None:
        self.url, self.redis_settings = url, redis_settings
        self.probe, self.steady = probe, steady
        # Made before the phase starts, as devices make them on their own hardware.
        self.probe_records = _records(probe, 2_000, seed)
        self.steady_records = _records(steady, STEADY_RECORDS, seed + 1)
        self.stop = threading.Event()
        self.latencies: list[float] = []
        self.accepted = 0
        self.seconds = 0.0
        self._threads: list[threading.Thread] = []

    def _probe(self) -> None:
        r = redis_client(self.redis_settings)
        with GatewayClient(self.url) as c:
            for i, record in enumerate(self.probe_records):
                if i and self.stop.is_set():  # at least one record each phase
                    break
                before = _folded(r, self.probe)
                t0 = time.perf_counter()
                if c.post_records(self.probe.study_id, record).status != 202:
                    raise RuntimeError("the gateway refused the honest device's record")
                folded_at = _wait("the honest record's fold",
                                  lambda b=before: _folded(r, self.probe) > b, lambda: True)
                self.latencies.append(folded_at - t0)
                self.stop.wait(PROBE_PAUSE_S)

    def _steady(self) -> None:
        t0 = time.perf_counter()
        with GatewayClient(self.url) as c:
            for record in self.steady_records:
                if self.stop.is_set():
                    break
                if c.post_records(self.steady.study_id, record).status == 202:
                    self.accepted += 1
        self.seconds = time.perf_counter() - t0

    def __enter__(self) -> Self:
        self._threads = [threading.Thread(target=self._probe, daemon=True),
                         threading.Thread(target=self._steady, daemon=True)]
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(timeout=60)


def _merged(phases: list[HonestDevices]) -> dict:
    """The honest devices' figures over several phases of one kind."""
    lat = sorted(x for h in phases for x in h.latencies)
    seconds = sum(h.seconds for h in phases)
    return {"honest_records": len(lat),
            "fold_latency_p50_s": statistics.median(lat) if lat else None,
            "fold_latency_max_s": lat[-1] if lat else None,
            "device_requests_per_second": sum(h.accepted for h in phases) / seconds
            if seconds else None}


def measure_resend(records: int = 100_000, *, per_request: int = 1000, connections: int = 4,
                   quiet_seconds: float = 5.0, repeat: int = 3) -> dict:
    """Fold ``records`` fresh records through a live gateway and aggregator, re-send them, and
    measure both phases and the honest devices (module docstring); ``repeat`` times, each
    with records of its own, in one runtime."""
    flood, probe, steady = (_study("flood", 10 * records * repeat),
                            _study("honest-probe", 10**6), _study("honest-steady", 10**6))
    with EmbeddedRuntime() as rt:
        topics = register_studies(rt, "bench.flood", (flood, probe, steady), records_partitions=2)
        r = redis_client(rt.redis_settings())
        port = free_port()
        env = service_env(rt, topics, IPDP_GATEWAY_HOST="127.0.0.1",
                          IPDP_GATEWAY_PORT=str(port), **GATEWAY_ENV)
        gw = subprocess.Popen([sys.executable, "-m", "ipdp.cli", "gateway"], env=env)
        agg = subprocess.Popen([sys.executable, "-m", "ipdp.cli", "aggregator", "run"], env=env)

        def alive() -> bool:
            return gw.poll() is None and agg.poll() is None

        def honest(seed: int) -> HonestDevices:
            return HonestDevices(url, rt.redis_settings(), probe, steady, seed)

        def flood_phase(bodies: list[bytes], done: Callable[[], bool], what: str) -> dict:
            """POST ``bodies``; the time to the last 202 and until ``done()``."""
            agg_cpu0 = cpu_seconds(agg.pid)
            t0 = time.perf_counter()
            post_all(url, flood.study_id, bodies, connections)
            posted = time.perf_counter()
            end = _wait(what, done, alive)
            return {"seconds": end - t0, "posted_seconds": posted - t0,
                    "aggregator_cpu_s": cpu_seconds(agg.pid) - agg_cpu0}

        url = f"http://127.0.0.1:{port}"
        runs: list[dict] = []
        quiet, fresh, attacked = [], [], []
        try:
            with GatewayClient(url, timeout_s=5) as c:
                c.wait_ready(60, alive=alive)
            # The group join and first fetch are not part of any phase.
            warm = request_bodies(steady, 1, 1, seed=2)[0]
            with GatewayClient(url) as c:
                if c.post_records(steady.study_id, warm).status != 202:
                    raise RuntimeError("the gateway refused the warm-up record")
            _wait("the warm-up record's fold", lambda: _folded(r, steady) >= 1, alive)
            for k in range(repeat):
                bodies = request_bodies(flood, records, per_request, seed=100 + k)
                with honest(10 * k + 1) as h:
                    time.sleep(quiet_seconds)
                quiet.append(h)
                # Honest devices run through both floods, so both phases carry the same load.
                with honest(10 * k + 2) as h:
                    fold = flood_phase(bodies, lambda k=k: _folded(r, flood) >= (k + 1) * records,
                                       "the fresh records' fold")
                fresh.append(h)
                with honest(10 * k + 3) as h:
                    refusal = flood_phase(
                        bodies, lambda k=k: _refused(r, flood, "replayed") >= (k + 1) * records,
                        "the re-sent records' refusals")
                attacked.append(h)
                runs.append({"fold": fold, "refusal": refusal,
                             "refusal_over_fold": refusal["seconds"] / fold["seconds"],
                             "refusal_over_fold_aggregator_cpu":
                             refusal["aggregator_cpu_s"] / fold["aggregator_cpu_s"]})
            folded, replayed = _folded(r, flood), _refused(r, flood, "replayed")
        finally:
            for proc in (gw, agg):
                proc.terminate()
            for proc in (gw, agg):
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    return {"records": records, "d": flood.d, "per_request": per_request,
            "connections": connections, "repeat": repeat, "gateway_env": GATEWAY_ENV,
            "runs": runs,
            "refusal_over_fold": statistics.median(x["refusal_over_fold"] for x in runs),
            "refusal_over_fold_aggregator_cpu":
            statistics.median(x["refusal_over_fold_aggregator_cpu"] for x in runs),
            "folded": folded, "replayed": replayed,
            "quiet": _merged(quiet), "fresh": _merged(fresh), "attacked": _merged(attacked)}


def _s(x: float | None) -> str:
    return "—" if x is None else f"{x:.3f} s"


def _rate(x: float | None) -> str:
    return "—" if x is None else f"{x:,.0f} requests/s"


def print_resend(res: dict) -> None:
    """The re-sent records attack as markdown tables."""
    env = ", ".join(f"{k}={v}" for k, v in res["gateway_env"].items())
    print(f"### Re-sent records: {res['records']:,} records, d = {res['d']}, "
          f"{res['per_request']} records per request, {res['connections']} connections, "
          f"{res['repeat']} runs\n")
    print(f"Gateway: {env} (one address plays the relay of every request).\n")
    print("| run | fold: first POST → all folded | refusal: first re-sent POST → all counted "
          "`replayed` | refusal / fold | aggregator CPU, refusal / fold | first POST → last "
          "202, fold / refusal |")
    print("|---|---|---|---|---|---|")
    for i, x in enumerate(res["runs"], 1):
        f, r = x["fold"], x["refusal"]
        print(f"| {i} | {f['seconds']:.2f} s | {r['seconds']:.2f} s | "
              f"{x['refusal_over_fold']:.2f} × | {x['refusal_over_fold_aggregator_cpu']:.2f} × "
              f"({r['aggregator_cpu_s']:.2f} s / {f['aggregator_cpu_s']:.2f} s) | "
              f"{f['posted_seconds']:.2f} s / {r['posted_seconds']:.2f} s |")
    print("\n| what | figure | target |")
    print("|---|---|---|")
    print(f"| refusal time / fold time, median of the runs | {res['refusal_over_fold']:.2f} × "
          "| ≤ 1.5 × |")
    print(f"| aggregator CPU, refusal / fold, median of the runs | "
          f"{res['refusal_over_fold_aggregator_cpu']:.2f} × | |")
    phases = (("no flood", res["quiet"]), ("during the fresh floods", res["fresh"]),
              ("during the re-sent floods", res["attacked"]))
    for what, h in phases:
        target = "≤ 2 s" if h is res["attacked"] else ""
        print(f"| honest record's fold latency, {what} (p50 / max of {h['honest_records']}) | "
              f"{_s(h['fold_latency_p50_s'])} / {_s(h['fold_latency_max_s'])} | {target} |")
    for what, h in phases:
        print(f"| honest device rate, {what} | {_rate(h['device_requests_per_second'])} | |")
    print(f"\nRedis: {res['folded']:,} records of the flood study folded, {res['replayed']:,} "
          "refused as `replayed`.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `ipdp bench flood`."""
    p.add_argument("--attack", choices=("resend", "connections", "both"), default="resend",
                   help="Which flood: re-sent records (default), a connection flood "
                   "(bench/flood_connections.py), or both.")
    p.add_argument("--records", type=int, default=100_000,
                   help="Records folded, then re-sent (default 100000).")
    p.add_argument("--per-request", dest="per_request", type=int, default=1000,
                   help="Records per request (default 1000).")
    p.add_argument("--connections", type=int, default=4,
                   help="Client connections posting the floods (default 4).")
    p.add_argument("--quiet-seconds", dest="quiet_seconds", type=float, default=5.0,
                   help="How long the honest devices are measured without an attack "
                   "(default 5).")
    p.add_argument("--repeat", type=int, default=3,
                   help="Runs of fold then re-send, each with records of its own, or rounds of "
                   "the connection floods; the ratios are their medians (default 3).")
    p.add_argument("--json", action="store_true",
                   help="Print the table on stderr and the figures as one JSON line on stdout.")
    flood_connections.add_arguments(p)


def run(args: argparse.Namespace) -> int:
    """`ipdp bench flood`: print each attack's table."""
    status = 0
    if args.attack in ("resend", "both"):
        res = measure_resend(args.records, per_request=args.per_request,
                             connections=args.connections, quiet_seconds=args.quiet_seconds,
                             repeat=args.repeat)
        with contextlib.redirect_stdout(sys.stderr if args.json else sys.stdout):
            print_resend(res)
        if args.json:
            print(json.dumps(res, sort_keys=True))
        every = res["records"] * res["repeat"]
        status = 0 if res["folded"] == every and res["replayed"] == every else 1
    if args.attack in ("connections", "both"):
        status = flood_connections.run(args) or status
    return status
