"""The connection flood against the deployed pair: idle connections held from a few addresses
against the shipped nginx edge in front of a live gateway (``ipdp bench flood --attack
connections``).

The edge is compose/nginx/ipdp.conf run by Debian's nginx on loopback (bench/edge.py: only the
upstream, listen address and certificate are rewritten), one worker of 8,192 connections, in
front of one ``ipdp gateway`` worker that trusts it as its proxy. 16 source addresses × 256
connections (the edge's cap per address), every one opened and then left silent, and opened
again as soon as the edge closes it (at client_header_timeout), from loopback addresses only.
Two layouts: the 16 addresses in one /24 (127.0.5.1–16) and in 16 different /24s (127.6.x.1).
While the flood runs, a probe from another address (127.0.8.x) opens a TLS connection to the
edge once a second and asks for ``/healthz``: answered within 2 s or not. Beside the probes, wrk
posts one 272-byte record per request over 64 TLS connections through the edge (as ``ipdp bench
devices`` does straight to the gateway), so the table gives the device rate under each flood
against the unflooded rate of the same run, and the CPU the flooding process, the edge and the
gateway used (on one machine, the flood's CPU is taken from the others). The gateway's request
and record limits are raised out of the way (one address plays every device). The three rows
are run ``--repeat`` times in turn, and each flooded row is compared with its own round's
unflooded row, so a shared machine's drift weighs on both sides of a ratio alike.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import resource
import socket
import ssl
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.devices import DEVICE_LIMITS_RAISED, D, _stop, _wrk, start_server, wrk_script
from bench.edge import Edge
from bench.process_tree import cpu_seconds
from bench.runtime import register_studies, service_env
from ipdp.embedded import EmbeddedRuntime
from ipdp.study import Study

__all__ = ["LAYOUTS", "FloodResult", "add_arguments", "measure", "probe", "run", "run_flood",
           "summary"]

#: The flood's source addresses per layout.
LAYOUTS: dict[str, list[str]] = {
    "one /24": [f"127.0.5.{i}" for i in range(1, 17)],
    "16 /24s": [f"127.6.{i}.1" for i in range(1, 17)],
}
#: Connections per source address: the edge's `limit_conn ipdp_connections_per_client`, which
#: counts requests in progress (a silent connection is bounded by client_header_timeout only).
PER_SOURCE = 256
#: The edge's worker connections: the flood's 4,096, the probes, wrk's and the upstream's.
EDGE_WORKER_CONNECTIONS = 8192
#: A probe counts as answered if its whole answer came within this long.
PROBE_TIMEOUT_S = 2.0
#: How long a flood connection waits before another try when it could not connect.
_RETRY_S = 0.05
#: Openings per flood connection at most (the gateway may close one at once, every time).
_MAX_OPENINGS = 100_000


@dataclass
class FloodResult:
    layout: str
    probes: int
    answered: int
    slowest_s: float | None
    #: Connections the flood opened in all (the initial ones and the re-openings).
    opened: int
    #: CPU seconds the flooding process used (on this machine, taken from everyone else).
    flood_cpu_s: float


async def _hold(host: str, port: int, source: str, deadline: float, opened: list[int]) -> None:
    """Keep one silent connection from ``source`` open until ``deadline``, opening another
    whenever the edge closes it (at most one opening per ``_RETRY_S`` while refused)."""
    loop = asyncio.get_running_loop()
    for _ in range(_MAX_OPENINGS):
        if loop.time() >= deadline:
            return
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, port, local_addr=(source, 0)),
                max(0.01, deadline - loop.time()))
        except (OSError, TimeoutError):
            await asyncio.sleep(_RETRY_S)
            continue
        opened[0] += 1
        try:
            await asyncio.wait_for(reader.read(1), max(0.01, deadline - loop.time()))
        except (OSError, TimeoutError):
            pass
        writer.close()


async def _flood(host: str, port: int, sources: list[str], per_source: int,
                 seconds: float) -> int:
    deadline = asyncio.get_running_loop().time() + seconds
    opened = [0]
    await asyncio.gather(*(_hold(host, port, source, deadline, opened)
                           for source in sources for _ in range(per_source)))
    return opened[0]


def _flood_process(host: str, port: int, sources: list[str], per_source: int, seconds: float,
                   out: multiprocessing.Queue) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = len(sources) * per_source + 256
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))
    try:
        import uvloop
        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:
        runner = asyncio.Runner()
    with runner:
        opened = runner.run(_flood(host, port, sources, per_source, seconds))
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out.put((opened, usage.ru_utime + usage.ru_stime))


def probe(host: str, port: int, source: str, tls: ssl.SSLContext,
          timeout_s: float = PROBE_TIMEOUT_S) -> float | None:
    """Seconds a new TLS connection from ``source`` took to get ``/healthz`` answered 200; None
    if not within ``timeout_s``."""
    t0 = time.monotonic()
    try:
        with tls.wrap_socket(socket.create_connection((host, port), timeout=timeout_s,
                                                      source_address=(source, 0)),
                             server_hostname=host) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            raw = b""
            while time.monotonic() - t0 < timeout_s:
                sock.settimeout(max(0.01, timeout_s - (time.monotonic() - t0)))
                chunk = sock.recv(65536)
                if not chunk:
                    break
                raw += chunk
    except OSError:
        return None
    elapsed = time.monotonic() - t0
    return elapsed if raw.startswith(b"HTTP/1.1 200") and elapsed <= timeout_s else None


def run_flood(edge: Edge, layout: str | None, *, probes: int = 30, ramp_s: float = 5.0,
              per_source: int = PER_SOURCE, beside: Callable[[], None] | None = None
              ) -> FloodResult:
    """Flood ``edge`` with ``layout``'s connections (None: no flood, the reference); after
    ``ramp_s`` (the flood in place), send ``probes`` probes, one a second, and run ``beside``
    (the caller's device load) in a thread alongside them."""
    import threading

    host, port, tls = edge.address, edge.port, edge.tls()
    seconds = ramp_s + probes + PROBE_TIMEOUT_S + 1
    context = multiprocessing.get_context("spawn")
    results: multiprocessing.Queue = context.Queue()
    flood = None
    if layout is not None:
        flood = context.Process(target=_flood_process, args=(
            host, port, LAYOUTS[layout], per_source, seconds, results))
        flood.start()
    load = threading.Thread(target=beside) if beside is not None else None
    try:
        if flood is not None:
            time.sleep(ramp_s)
        if load is not None:
            load.start()
        times = []
        start = time.monotonic()
        for i in range(probes):
            times.append(probe(host, port, f"127.0.8.{i % 250 + 1}", tls))
            time.sleep(max(0.0, start + i + 1 - time.monotonic()))
        if load is not None:
            load.join()
        opened, flood_cpu_s = results.get(timeout=seconds + 60) if flood is not None else (0, 0.0)
    finally:
        if flood is not None:
            flood.join(timeout=seconds + 60)
            if flood.is_alive():
                flood.kill()
                flood.join()
    answered = [t for t in times if t is not None]
    return FloodResult(layout or "none", probes, len(answered),
                       max(answered) if answered else None, opened, flood_cpu_s)


STUDY_ID = "bench-flood-connections"


def measure(*, probes: int = 30, device_seconds: float = 15, connections: int = 64,
            threads: int = 2, repeat: int = 3) -> list[dict]:
    """``repeat`` rounds of one row without a flood and one per flood layout: probes
    answered, device rate (each flooded row's ratio against its round's unflooded row)."""
    rows: list[dict] = []
    with EmbeddedRuntime() as rt, tempfile.TemporaryDirectory() as tmp:
        study = Study(study_id=STUDY_ID, d=D, n=10**8, epsilon=1.0, delta=0.01)
        topics = register_studies(rt, "bench.flood", [study])
        script = Path(tmp) / "device.lua"
        script.write_text(wrk_script(study))
        env = service_env(rt, topics, IPDP_GATEWAY_TRUSTED_PROXIES="127.0.0.1",
                          **DEVICE_LIMITS_RAISED)
        gateway, url = start_server("gateway", env)
        try:
            host, port = url.removeprefix("http://").rsplit(":", 1)
            with Edge((host, int(port)), Path(tmp) / "edge",
                      worker_connections=EDGE_WORKER_CONNECTIONS) as edge:
                for run in range(1, repeat + 1):
                    for layout in (None, *LAYOUTS):
                        device: dict = {}

                        def load(device: dict = device) -> None:
                            device.update(_wrk(f"{edge.url}/studies/{STUDY_ID}/records",
                                               script, min(device_seconds, probes),
                                               connections, threads))

                        cpu = cpu_seconds(gateway.pid), cpu_seconds(edge.proc.pid)
                        t0 = time.monotonic()
                        result = run_flood(edge, layout, probes=probes, beside=load)
                        elapsed = time.monotonic() - t0
                        rows.append({
                            "attack": "connections", "run": run, "layout": result.layout,
                            "probes": result.probes, "answered": result.answered,
                            "slowest_probe_s": result.slowest_s, "opened": result.opened,
                            "flood_cpu_s": result.flood_cpu_s,
                            "gateway_cpu": (cpu_seconds(gateway.pid) - cpu[0]) / elapsed,
                            "edge_cpu": (cpu_seconds(edge.proc.pid) - cpu[1]) / elapsed,
                            "device_rps": device["accepted"] / (device["duration_us"] / 1e6),
                            "device_p99_ms": device["p99_us"] / 1000})
                        unflooded = next(r for r in rows
                                         if r["run"] == run and r["layout"] == "none")
                        rows[-1]["device_vs_unflooded"] = \
                            rows[-1]["device_rps"] / unflooded["device_rps"]
        finally:
            _stop(gateway)
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Per layout over the runs: the fewest probes answered, the slowest probe, and the
    medians of the device rate and of its ratio to the same run's unflooded rate."""
    out = []
    for layout in ("none", *LAYOUTS):
        mine = [r for r in rows if r["layout"] == layout]
        slowest = [r["slowest_probe_s"] for r in mine if r["slowest_probe_s"] is not None]
        out.append({"layout": layout, "runs": len(mine),
                    "probes": mine[0]["probes"],
                    "fewest_answered": min(r["answered"] for r in mine),
                    "slowest_probe_s": max(slowest) if slowest else None,
                    "device_rps": statistics.median(r["device_rps"] for r in mine),
                    "device_vs_unflooded": statistics.median(
                        r["device_vs_unflooded"] for r in mine)})
    return out


def print_table(rows: list[dict]) -> None:
    out = sys.stderr
    print("| run | flood from | probes answered ≤ 2 s | slowest probe | flood connections "
          "opened | flood CPU s | edge CPU (cores) | gateway CPU (cores) | device 202/s | "
          "× unflooded | device p99 |", file=out)
    print("|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|", file=out)
    for r in rows:
        print(f"| {r['run']} | {r['layout']} | {r['answered']}/{r['probes']} | "
              f"{_seconds(r['slowest_probe_s'])} | {r['opened']:,} | {r['flood_cpu_s']:.1f} | "
              f"{r['edge_cpu']:.2f} | {r['gateway_cpu']:.2f} | {r['device_rps']:,.0f} | "
              f"{r['device_vs_unflooded']:.2f} | {r['device_p99_ms']:.1f} ms |", file=out)
    print("\n| flood from | runs | fewest probes answered ≤ 2 s | slowest probe | device 202/s, "
          "median | × unflooded, median of the runs | target |", file=out)
    print("|---|--:|--:|--:|--:|--:|---|", file=out)
    for s in summary(rows):
        target = "—" if s["layout"] == "none" else "≥ 29/30 answered; ≥ 0.5 ×"
        print(f"| {s['layout']} | {s['runs']} | {s['fewest_answered']}/{s['probes']} | "
              f"{_seconds(s['slowest_probe_s'])} | {s['device_rps']:,.0f} | "
              f"{s['device_vs_unflooded']:.2f} | {target} |", file=out)


def _seconds(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f} s"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--probes", type=int, default=30,
                   help="Connection flood: health probes per layout, one a second "
                   "(default 30).")
    p.add_argument("--device-seconds", dest="device_seconds", type=float, default=15,
                   help="Connection flood: wrk's duration beside the probes (default 15; at "
                   "most --probes).")


def run(args: argparse.Namespace) -> int:
    """The connection flood's part of `ipdp bench flood`: its tables (0: the targets met, in
    every run all but at most one probe in 30 answered within 2 s, and the median device rate
    under each flood at least half the unflooded one)."""
    rows = measure(probes=args.probes, device_seconds=args.device_seconds, repeat=args.repeat)
    print_table(rows)
    if args.json:
        print(json.dumps({"runs": rows, "summary": summary(rows)}, sort_keys=True))
    met = all(r["answered"] >= r["probes"] * 29 / 30 for r in rows) and all(
        s["device_vs_unflooded"] >= 0.5 for s in summary(rows))
    return 0 if met else 1
