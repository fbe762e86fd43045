"""`ipdp demo`: the whole pipeline in one command on the embedded broker and Redis.

Starts the runtime, creates a study, runs `ipdp aggregator run` and `ipdp trainer run` (and with
--via-gateway `ipdp gateway`) as child processes (exactly as an operator would), simulates the devices with the load generator, waits
for the first model, and compares it with a non-private fit on the same training rows. The
simulator holds the raw rows only because it plays every device; no service ever sees them.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from ipdp import registry, state
from ipdp.cli.common import UsageError, format_validation_error
from ipdp.embedded.children import free_port
from ipdp.embedded.runtime import EmbeddedRuntime
from ipdp.kafka_io import kafka_producer
from ipdp.losses import clip, encode
from ipdp.model_message import ModelMessage
from ipdp.redis_io import redis_client
from ipdp.report import calibration_rows, table
from ipdp.study import Study
from ipdp.subscriber import ModelSubscriber
from producer.datasets import synthetic, train_test_split
from producer.gateway_client import GatewayClient
from producer.loadgen import run_loadgen, run_loadgen_http
from trainer.solver import solve_constrained

log = logging.getLogger(__name__)

MODEL_TIMEOUT_S = 300.0


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register `ipdp demo`."""
    p = sub.add_parser("demo", help="Run the whole pipeline end to end on the embedded runtime.")
    p.add_argument("--n", type=int, default=20_000, help="Records per round (default 20000).")
    p.add_argument("--d", type=int, default=14, help="Dimension (default 14).")
    p.add_argument("--epsilon", type=float, default=1.0, help="Central ε (default 1).")
    p.add_argument("--delta", type=float, default=0.01, help="Central δ (default 0.01).")
    p.add_argument("--devices", type=int, default=None,
                   help="Simulated devices (default n; more than n fills later rounds).")
    p.add_argument("--loss", choices=["squared", "logistic"], default="squared")
    p.add_argument("--mode", choices=["rigorous", "paper"], default="rigorous")
    p.add_argument("--seed", type=int, default=None, help="Seed of the synthetic data set only.")
    p.add_argument("--via-gateway", dest="via_gateway", action="store_true",
                   help="Also start `ipdp gateway` and send the devices' records over HTTP "
                   "through it instead of straight to Kafka.")
    p.add_argument("--json", action="store_true", help="Print one JSON object at the end.")
    p.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    """Entry point of `ipdp demo`."""
    from pydantic import ValidationError

    started = time.monotonic()
    devices = args.devices or args.n
    if devices < args.n:
        raise UsageError(f"--devices {devices} < --n {args.n}: a round needs n records and a "
                         "model is never published from fewer")
    try:
        study = Study(study_id=f"demo-{int(time.time())}", loss=args.loss, d=args.d, n=args.n,
                      epsilon=args.epsilon, delta=args.delta, mode=args.mode)
    except ValidationError as exc:
        raise UsageError(format_validation_error(exc)) from None
    say = (lambda *_: None) if args.json else (lambda msg: print(msg, file=sys.stderr))
    data = synthetic(int(devices / 0.8) + 1, args.d, args.loss, seed=args.seed)
    train, test = train_test_split(data, 0.2, seed=args.seed)
    train.x, train.y = train.x[:devices], train.y[:devices]

    with EmbeddedRuntime() as rt:
        say(f"runtime: kafka {rt.broker.bootstrap}, redis {rt.redis.url} (in {rt.directory})")
        kafka, topics = rt.kafka_settings(), rt.topics
        producer = kafka_producer(kafka)
        registry.create_study(redis_client(rt.redis_settings()), producer, topics, study)
        producer.close()
        say(table(calibration_rows(study.calibration), title=f"study {study.study_id}"))
        roles = ("aggregator", "trainer", "gateway") if args.via_gateway else (
            "aggregator", "trainer")
        gateway_port = free_port() if args.via_gateway else None
        children = _start_services(rt, Path(rt.directory), roles, gateway_port)
        try:
            if args.via_gateway:
                url = f"http://127.0.0.1:{gateway_port}"
                with GatewayClient(url, timeout_s=5) as client:
                    client.wait_ready(60, alive=lambda: children["gateway"].poll() is None)
                say(f"simulating {devices} devices through the gateway at {url} …")
                sent = run_loadgen_http(study, url, _batches(train.x, train.y, 2000),
                                        total=devices, progress=not args.json)
            else:
                say(f"simulating {devices} devices …")
                sent = run_loadgen(study, kafka, topics, train.x, train.y,
                                   progress=not args.json)
            say(f"sent {sent.sent} records in {sent.seconds:.1f} s ({sent.rate:,.0f} records/s); "
                "waiting for the model …")
            model = _first_model(kafka, topics, study.study_id, children)
            folded = int(redis_client(rt.redis_settings()).hget(
                state.counts_key(study.study_id), "folded") or 0)
        finally:
            _stop_services(children)
    result = _evaluate(study, model, train, test)
    result.update(n=study.n, d=study.d, records_sent=sent.sent, via_gateway=args.via_gateway, records_folded=folded,
                  round=model.round, epsilon=study.epsilon, delta=study.delta,
                  mode=study.mode, loss=study.loss, local_epsilon=study.calibration.local_epsilon,
                  elapsed_s=round(time.monotonic() - started, 2))
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        print(table([(k, _fmt(v)) for k, v in result.items()], title="ipdp demo: result"))
    return 0


def _fmt(v) -> str:
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def _start_services(rt: EmbeddedRuntime, directory: Path, roles: tuple[str, ...],
                    gateway_port: int | None) -> dict[str, subprocess.Popen]:
    env = {**os.environ, **rt.env(), "IPDP_METRICS_PORT": "0"}
    if gateway_port is not None:
        env.update(IPDP_GATEWAY_HOST="127.0.0.1", IPDP_GATEWAY_PORT=str(gateway_port))
    children = {}
    for role in roles:
        logfile = open(directory / f"{role}.log", "ab")  # noqa: SIM115 - child owns it
        command = ["gateway"] if role == "gateway" else [role, "run"]
        children[role] = subprocess.Popen(
            [sys.executable, "-m", "ipdp.cli", *command], env=env, stdout=logfile,
            stderr=subprocess.STDOUT)
    return children


def _batches(x: np.ndarray, y: np.ndarray, size: int):
    return ((x[i:i + size], y[i:i + size]) for i in range(0, x.shape[0], size))


def _stop_services(children: dict[str, subprocess.Popen]) -> None:
    for proc in children.values():
        if proc.poll() is None:
            proc.terminate()
    for proc in children.values():
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def _first_model(kafka, topics, study_id: str, children) -> ModelMessage:
    deadline = time.monotonic() + MODEL_TIMEOUT_S
    while time.monotonic() < deadline:
        for role, proc in children.items():
            if proc.poll() is not None:
                raise RuntimeError(f"the {role} exited with status {proc.returncode}; "
                                   "see its log in the runtime directory")
        for model in ModelSubscriber(kafka, topics, study_id=study_id):
            return model
        time.sleep(0.5)
    raise TimeoutError(f"no model for {study_id} within {MODEL_TIMEOUT_S:.0f} s")


def _evaluate(study: Study, model: ModelMessage, train, test) -> dict:
    """Test error of the private model next to the non-private fit of the same rows."""
    q, p = clip(*encode(study.loss, train.x, train.y), study.lam, study.p_bound)
    nonprivate = solve_constrained(q.T @ q + 1e-9 * np.eye(study.d), p.sum(axis=0), study.eta).w
    w = np.asarray(model.weights)
    if study.loss == "squared":
        def rmse(v):
            return float(np.sqrt(np.mean((test.x @ v - test.y) ** 2)))
        return {"rmse_private": rmse(w), "rmse_nonprivate": rmse(nonprivate),
                "rmse_zero_model": rmse(np.zeros(study.d))}

    def accuracy(v):
        return float(np.mean(np.where(test.x @ v >= 0, 1.0, -1.0) == test.y))
    return {"accuracy_private": accuracy(w), "accuracy_nonprivate": accuracy(nonprivate)}
