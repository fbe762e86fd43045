"""`ipdp demo`: the whole pipeline in one command on the embedded broker and Redis.

Starts the runtime, creates a study, runs `ipdp aggregator run` and `ipdp trainer run` (and with
--via-gateway `ipdp gateway`) as child processes (exactly as an operator would), simulates the
devices with the load generator, waits for the first model, and compares it with a non-private fit
on the same training rows. The simulator holds the raw rows only because it plays every device; no
service ever sees them.

With --web there is no simulator: the study is signed by a fresh owner key, the gateway also
serves the browser contributor's page (producer/web), and the command prints the page's URL, with
the study id and the pinned public key in its query string, then reports each model as it is
published until Ctrl-C.

SIGTERM, SIGINT (Ctrl-C) or a second Ctrl-C, at any step, stops every process the demo started
and removes the runtime directory, the owner's private key with it (stop_on_signals).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Self

from ipdp.cli.common import UsageError, format_validation_error, stop_on_signals
from ipdp.errors import IpdpError

if TYPE_CHECKING:
    import subprocess

    import numpy as np

    from ipdp.embedded.runtime import EmbeddedRuntime
    from ipdp.model_message import ModelMessage
    from ipdp.study import Study

MODEL_TIMEOUT_S = 300.0
#: What stopping may take: the services first, then the broker and redis-server, each
#: SIGKILLed after its share (a signal's whole stop stays within 10 s).
SERVICES_STOP_S = 4.0
SERVER_STOP_S = 2.0
#: The one address every simulated device sends from; the demo's gateway makes it a relay.
SIMULATOR_ADDRESS = "127.0.0.1"


class DemoFailed(IpdpError):
    """A service the demo started exited, or no model came in time."""

    exit_code = 1

#: What each number of the result is; printed next to it.
LEGEND = {
    "n": "records per round: the model is trained on exactly n",
    "d": "features per row: synthetic x_1 … x_d, ‖x‖ ≤ 1, from a known model w*",
    "records_sent": "records the simulated devices sent and Kafka (or the gateway) accepted",
    "records_folded": "records the aggregator folded into the round's statistics",
    "via_gateway": "whether the records went through the HTTP gateway",
    "two_server": "whether each record was split into two shares, one folded by the leader "
                  "and one by the helper, so that neither alone saw a record",
    "round": "the round the model comes from",
    "rmse_private": "root mean squared error of the published private model on the held-out "
                    "split: the 20% of the synthetic rows no device sent",
    "rmse_nonprivate": "the same for the non-private fit of the same training rows (clipped, "
                       "‖w‖ ≤ η, no noise): the best this data allows",
    "rmse_zero_model": "the same for predicting 0 for every row: a model no better than this "
                       "has learnt nothing",
    "excess_mse_predicted": "what Step 8 predicted rmse_private² − rmse_nonprivate² to be, from "
                            "the public parameters alone (docs/privacy.md)",
    "excess_mse_measured": "rmse_private² − rmse_nonprivate², measured on the held-out split",
    "accuracy_private": "fraction of the held-out split's labels the private model gets right",
    "accuracy_nonprivate": "the same for the non-private fit of the same training rows",
    "accuracy_majority_label": "the same for always answering the held-out split's most common "
                               "label: a model no better has learnt nothing",
    "epsilon": "central ε of the published model (for one record, replace-one)",
    "delta": "central δ of the published model",
    "mode": "the calibration: rigorous is proven (docs/privacy.md)",
    "loss": "squared: linear regression; logistic: classification",
    "local_epsilon": "ε of one record on its own, without the other n − 1: weak by design; "
                     "the central (ε, δ) is the guarantee to quote",
    "elapsed_s": "seconds the whole demo took, starting the broker and Redis included",
}


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register `ipdp demo`."""
    p = sub.add_parser("demo", help="Run the whole pipeline end to end on the embedded runtime.")
    p.add_argument("--n", type=int, default=None,
                   help="Records per round (default 20000; 200 with --web).")
    p.add_argument("--d", type=int, default=None, help="Dimension (default 14; 3 with --web).")
    p.add_argument("--epsilon", type=float, default=1.0, help="Central ε (default 1).")
    p.add_argument("--delta", type=float, default=0.01, help="Central δ (default 0.01).")
    p.add_argument("--devices", type=int, default=None,
                   help="Simulated devices (default n; more than n fills later rounds).")
    p.add_argument("--loss", choices=["squared", "logistic"], default="squared",
                   help="The model's loss (default squared).")
    p.add_argument("--mode", choices=["rigorous", "paper"], default="rigorous",
                   help="Calibration: rigorous (default, proven in docs/privacy.md) or paper "
                   "(the paper's, NOT proven).")
    p.add_argument("--seed", type=int, default=None, help="Seed of the synthetic data set only.")
    p.add_argument("--via-gateway", dest="via_gateway", action="store_true",
                   help="Also start `ipdp gateway` and send the devices' records over HTTP "
                   "through it instead of straight to Kafka.")
    p.add_argument("--json", action="store_true", help="Print one JSON object at the end.")
    p.add_argument("--web", action="store_true",
                   help="Contribute from a browser instead of simulated devices: start a signed "
                   "study, the gateway serving the page (build it first: cd producer/web && npm "
                   "ci && npm run build), the aggregator and the trainer; print the page's URL "
                   "and report each model until Ctrl-C.")
    p.add_argument("--port", type=int, default=None,
                   help="With --web: the gateway's port on 127.0.0.1 (default: a free one).")
    p.add_argument("--two-server", dest="two_server", action="store_true",
                   help="A two-server study: also start a helper with its own Redis and key; "
                   "each device splits its record into a leader's and a helper's share, and the "
                   "demo prints what each domain holds (docs/architecture.md, \"The helper\").")
    p.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    """Entry point of `ipdp demo`."""
    from pydantic import ValidationError

    from ipdp.study import Study

    started = time.monotonic()
    args.n = args.n or (200 if args.web else 20_000)
    args.d = args.d or (3 if args.web else 14)
    try:
        study = Study(study_id=f"demo-{int(time.time())}", loss=args.loss, d=args.d, n=args.n,
                      epsilon=args.epsilon, delta=args.delta, mode=args.mode)
    except ValidationError as exc:
        raise UsageError(format_validation_error(exc)) from None
    if args.two_server and (args.web or args.via_gateway):
        raise UsageError("--two-server runs simulated devices straight to Kafka: leave out "
                         "--web and --via-gateway")
    if args.web:
        with stop_on_signals(exit_status=0):  # Ctrl-C is how a web demo ends
            return serve_web(study, args.port)
    devices = args.devices or args.n
    if devices < args.n:
        raise UsageError(f"--devices {devices} < --n {args.n}: a round needs n records and a "
                         "model is never published from fewer")
    with stop_on_signals(exit_status=130):
        return _simulate(args, study, devices, started)


def _simulate(args: argparse.Namespace, study: Study, devices: int, started: float) -> int:
    """`ipdp demo` without --web: simulated devices, the first model, its test error."""
    from ipdp.report import table
    from producer.datasets import synthetic, train_test_split

    say = (lambda *_: None) if args.json else (lambda msg: print(msg, file=sys.stderr))
    data = synthetic(int(devices / 0.8) + 1, args.d, args.loss, seed=args.seed)
    train, test = train_test_split(data, 0.2, seed=args.seed)
    train.x, train.y = train.x[:devices], train.y[:devices]

    if args.two_server:
        from ipdp.cli import demo_two_server

        ran = demo_two_server.run(args, study, devices, train)
        study, model, sent, folded = ran["study"], ran["model"], ran["sent"], ran["folded"]
        domains = ran["domains"]
    else:
        model, sent, folded = _one_server(args, study, devices, train, say)
        domains = None
    result = _evaluate(study, model, train, test)
    result.update(n=study.n, d=study.d, records_sent=sent.sent, via_gateway=args.via_gateway,
                  two_server=args.two_server,
                  records_folded=folded, round=model.round, epsilon=model.privacy.epsilon,
                  delta=model.privacy.delta,
                  mode=study.mode, loss=study.loss, local_epsilon=study.calibration.local_epsilon,
                  elapsed_s=round(time.monotonic() - started, 2))
    coefficients = result.pop("coefficients")
    if args.json:
        extra = {"coefficients": coefficients} | ({} if domains is None else {"domains": domains})
        print(json.dumps(result | extra, sort_keys=True))
    else:
        values = {k: _fmt(v) for k, v in result.items()}
        width = max(len(v) for v in values.values())
        print(table([(k, f"{v.ljust(width)}  {LEGEND[k]}") for k, v in values.items()],
                    title="ipdp demo: result, and what each number is"))
        print()
        print(coefficient_table(coefficients))
        if domains is not None:
            from ipdp.cli.demo_two_server import domain_table

            print()
            print(domain_table(domains))
    return 0


def _one_server(args: argparse.Namespace, study: Study, devices: int, train, say):
    """The one-server demo's services, devices and first model: (model, sent, folded)."""
    from ipdp import state
    from ipdp.embedded.children import free_port
    from ipdp.embedded.runtime import EmbeddedRuntime
    from ipdp.redis_io import redis_client
    from ipdp.report import calibration_rows, table
    from producer.loadgen import row_batches, run_loadgen, run_loadgen_http

    with EmbeddedRuntime(stop_timeout_s=SERVER_STOP_S) as rt:
        say(f"runtime: kafka {rt.broker.bootstrap}, redis {rt.redis.url} (in {rt.directory})")
        kafka, topics = rt.kafka_settings(), rt.topics
        _create_study(rt, study)
        say(table(calibration_rows(study.calibration), title=f"study {study.study_id}"))
        roles = ("aggregator", "trainer", "gateway") if args.via_gateway else (
            "aggregator", "trainer")
        gateway_port = free_port() if args.via_gateway else None
        with Services(rt, roles, gateway_port) as services:
            if args.via_gateway:
                url = f"http://127.0.0.1:{gateway_port}"
                services.wait_for_gateway(url)
                say(f"simulating {devices} devices through the gateway at {url} (every one "
                    f"sends from {SIMULATOR_ADDRESS}, which the demo's gateway lists in "
                    "IPDP_GATEWAY_RELAY_ADDRESSES, so the per-address limit meant for one "
                    "device does not apply) …")
                sent = run_loadgen_http(study, url, row_batches(train.x, train.y, 2000),
                                        total=devices, progress=not args.json)
            else:
                say(f"simulating {devices} devices …")
                sent = run_loadgen(study, kafka, topics, train.x, train.y,
                                   progress=not args.json)
            say(f"sent {sent.sent} records in {sent.seconds:.1f} s ({sent.rate:,.0f} records/s); "
                "waiting for the model …")
            model = _first_model(kafka, topics, study.study_id, services)
            folded = int(redis_client(rt.redis_settings()).hget(
                state.StudyKeys(study.study_id).counts, "folded") or 0)
    return model, sent, folded


def coefficient_table(coefficients: dict[str, list]) -> str:
    """The model's weights by feature, next to the non-private fit's and the generating w*."""
    head = ("feature", "private w", "non-private w", "generating w*")
    rows = [head] + [(name, *(f"{v:+.4f}" for v in values)) for name, *values in zip(
        coefficients["features"], coefficients["private"], coefficients["nonprivate"],
        coefficients["generating"], strict=True)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["coefficients (w_j multiplies feature x_j; the data come from w*)"]
    lines += ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in
                        enumerate(zip(r, widths, strict=True))) for r in rows]
    return "\n".join(lines)


def _fmt(v) -> str:
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def _create_study(rt: EmbeddedRuntime, study: Study, owner=None) -> None:
    from ipdp import state
    from ipdp.kafka_io import kafka_producer
    from ipdp.redis_io import redis_client

    producer = kafka_producer(rt.kafka_settings())
    try:
        state.create_study(redis_client(rt.redis_settings()), producer, rt.topics, study, owner)
    finally:
        producer.close()


def serve_web(study: Study, port: int | None) -> int:
    """`ipdp demo --web`: everything a browser contributor needs, until Ctrl-C."""
    from urllib.parse import quote

    from gateway.web import DEMO_PATH, web_directory
    from ipdp.embedded.children import free_port
    from ipdp.embedded.runtime import EmbeddedRuntime
    from ipdp.report import calibration_rows, table
    from ipdp.signing import generate_key_files

    web_dir = web_directory(os.environ.get("IPDP_GATEWAY_WEB_DIR"))
    if web_dir is None:
        raise UsageError("no page to serve: build it first (cd producer/web && npm ci && npm run "
                         "build), or point IPDP_GATEWAY_WEB_DIR at a built copy")
    say = (lambda msg: print(msg, file=sys.stderr))
    # The owner's private key is written into the runtime directory, which stopping removes.
    with EmbeddedRuntime(stop_timeout_s=SERVER_STOP_S) as rt:
        directory = Path(rt.directory)
        owner = generate_key_files(directory / "study-owner")
        _create_study(rt, study, owner)
        say(table(calibration_rows(study.calibration), title=f"study {study.study_id}"))
        port = port or free_port()
        with Services(rt, ("aggregator", "trainer", "gateway"), port,
                      IPDP_TRUSTED_STUDY_KEYS=owner.public_b64,
                      IPDP_GATEWAY_WEB_DIR=str(web_dir)) as services:
            url = f"http://127.0.0.1:{port}"
            services.wait_for_gateway(url)
            say(f"study {study.study_id}: n={study.n}, d={study.d}, signed by key "
                f"{owner.key_id} ({directory / 'study-owner.pub'}); logs in {directory}")
            say("open this page (the study id and the owner's public key are in its query "
                "string); Ctrl-C stops everything and removes that directory:")
            print(f"{url}{DEMO_PATH}?study={quote(study.study_id, safe='')}"
                  f"&key={quote(owner.public_b64, safe='')}", flush=True)
            _report_models(rt.kafka_settings(), rt.topics, study.study_id, services, say)
    return 0


def _report_models(kafka, topics, study_id: str, services: Services, say) -> None:
    """Say each model of the study as it is published; return only when a service exits."""
    from ipdp.subscriber import ModelSubscriber

    # One subscriber, read again each second: it yields each (study, round) once.
    with ModelSubscriber(kafka, topics, study_id=study_id) as models:
        while True:
            services.check_alive()
            for model in models:
                weights = ", ".join(f"{w:.4g}" for w in model.weights)
                say(f"model of round {model.round} published from {model.n} records: "
                    f"w = [{weights}]")
            time.sleep(1.0)


class Services:
    """The role processes of a demo (`ipdp aggregator run`, `ipdp trainer run`, `ipdp gateway`),
    as an operator would start them, logging into the runtime directory.

    Each runs in its own session (a Ctrl-C reaches the demo only, which stops them in order)
    and dies with the demo even if it is SIGKILLed (ipdp.embedded.children). Leaving the
    ``with`` block stops them all; so does a signal (ipdp.cli.common.stop_on_signals), before
    the runtime they use."""

    stop_first = True

    def __init__(self, rt: EmbeddedRuntime, roles: tuple[str, ...], gateway_port: int | None,
                 **extra_env: str) -> None:
        self.directory = Path(rt.directory)
        self.env = {**rt.env(), "IPDP_METRICS_PORT": "0", **extra_env}
        if gateway_port is not None:
            # One loopback address plays every device: a relay, with the relay allowance.
            self.env.update(IPDP_GATEWAY_HOST="127.0.0.1", IPDP_GATEWAY_PORT=str(gateway_port),
                            IPDP_GATEWAY_RELAY_ADDRESSES=SIMULATOR_ADDRESS)
        self.roles = roles
        self.procs: dict[str, subprocess.Popen] = {}

    def __enter__(self) -> Self:
        from ipdp.embedded.children import register, spawn

        register(self)
        for role in self.roles:
            command = ["gateway"] if role == "gateway" else [role, "run"]
            self.procs[role] = spawn([sys.executable, "-m", "ipdp.cli", *command],
                                     self.directory / f"{role}.log", self.env)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """SIGTERM every service, SIGKILL what is left after SERVICES_STOP_S. Idempotent."""
        from ipdp.embedded.children import terminate_all, unregister

        terminate_all({f"ipdp {role}": proc for role, proc in self.procs.items()},
                      SERVICES_STOP_S)
        unregister(self)

    def check_alive(self) -> None:
        """Raise DemoFailed, with the end of its log, if a service has exited."""
        from ipdp.embedded.children import tail

        for role, proc in self.procs.items():
            if proc.poll() is not None:
                raise DemoFailed(f"the {role} exited with status {proc.returncode}; the end of "
                                 f"its log:\n{tail(self.directory / f'{role}.log', 15)}")

    def wait_for_gateway(self, url: str) -> None:
        from producer.gateway_client import GatewayClient

        with GatewayClient(url, timeout_s=5) as client:
            try:
                client.wait_ready(60, alive=lambda: self.procs["gateway"].poll() is None)
            except (RuntimeError, TimeoutError):
                self.check_alive()
                raise


def _first_model(kafka, topics, study_id: str, services: Services) -> ModelMessage:
    from ipdp.subscriber import ModelSubscriber

    deadline = time.monotonic() + MODEL_TIMEOUT_S
    # One subscriber, read again each half second: closing a consumer each time would cancel
    # its metadata requests in flight, which kafka-python logs as errors.
    with ModelSubscriber(kafka, topics, study_id=study_id) as models:
        while time.monotonic() < deadline:
            services.check_alive()
            for model in models:
                return model
            time.sleep(0.5)
    raise DemoFailed(f"no model for {study_id} within {MODEL_TIMEOUT_S:.0f} s; the services' "
                     "logs were in the runtime directory")


def _evaluate(study: Study, model: ModelMessage, train, test) -> dict:
    """Test error of the private model next to the non-private fit of the same rows, and the
    excess squared error Step 8 predicted for its split next to the one measured; and the
    coefficients of both next to the generating model's."""
    import numpy as np

    from ipdp.losses import clip, encode
    from trainer.solver import solve_constrained

    q, p = clip(*encode(study.loss, train.x, train.y), study.lam, study.p_bound)
    nonprivate = solve_constrained(q.T @ q + 1e-9 * np.eye(study.d), p.sum(axis=0), study.eta).w
    w = np.asarray(model.weights)
    coefficients = {"features": [f"x{j + 1}" for j in range(study.d)], "private": w.tolist(),
                    "nonprivate": nonprivate.tolist(), "generating": train.w_true.tolist()}
    return {**_errors(study, w, nonprivate, test), "coefficients": coefficients}


def _errors(study: Study, w: np.ndarray, nonprivate: np.ndarray, test) -> dict:
    """The private model's, the non-private fit's and a constant's error on the test rows."""
    import numpy as np

    if study.loss == "squared":
        def rmse(v):
            return float(np.sqrt(np.mean((test.x @ v - test.y) ** 2)))
        measured = {"rmse_private": rmse(w), "rmse_nonprivate": rmse(nonprivate),
                    "rmse_zero_model": rmse(np.zeros(study.d))}
        if study.calibration.predicted_error is None:
            return measured
        # Step 8 chose the split minimising R, its prediction of RMSE² − RMSE²(non-private)
        # for isotropic data: the two side by side show what the choice bought on these rows.
        return {**measured, "excess_mse_predicted": study.calibration.predicted_error,
                "excess_mse_measured": measured["rmse_private"] ** 2
                - measured["rmse_nonprivate"] ** 2}

    def accuracy(v):
        return float(np.mean(np.where(test.x @ v >= 0, 1.0, -1.0) == test.y))
    majority = max(float(np.mean(test.y == 1.0)), float(np.mean(test.y == -1.0)))
    return {"accuracy_private": accuracy(w), "accuracy_nonprivate": accuracy(nonprivate),
            "accuracy_majority_label": majority}
