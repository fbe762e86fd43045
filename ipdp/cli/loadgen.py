"""`ipdp loadgen`: the device simulator's command line (producer/loadgen.py does the work)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ipdp.cli.common import UsageError, add_kafka_flag, add_redis_flag, kafka_settings, lazy

if TYPE_CHECKING:
    from ipdp.settings import TopicSettings
    from ipdp.study import Study, StudyStatus

log = logging.getLogger(__name__)


def add_commands(sub: argparse._SubParsersAction, with_flags: bool = True) -> None:
    """Register `loadgen` on the `ipdp` sub-command parser; its flags' defaults come from
    producer/, imported only ``with_flags``."""
    p = sub.add_parser(
        "loadgen",
        help="Simulate many devices contributing perturbed records to a study.",
        description="Each simulated device encodes, clips and perturbs its own example and "
        "publishes one record to the records topic. Kafka and topic names come from the "
        "IPDP_KAFKA_* / IPDP_TOPIC_* environment; the study is read from the studies topic.",
    )
    if not with_flags:
        return
    from producer.loadgen import LoadgenSettings

    p.add_argument("--study", required=True, metavar="ID", help="Study id.")
    p.add_argument("--devices", required=True, type=int, metavar="N",
                   help="Number of devices (records) to simulate.")
    p.add_argument("--rate", type=float, default=None, metavar="R",
                   help="Records per second (default: as fast as the broker accepts).")
    p.add_argument("--dataset", default="synthetic", metavar="synthetic|csv:PATH",
                   help="Where device data comes from (default: synthetic, rows drawn already "
                   "encoded, ‖x‖ ≤ 1). csv:PATH with a header row: one device per row, the "
                   "rows in a random order seeded by --seed, so fewer devices than rows send a "
                   "random subset of them. A study with a schema reads its columns by name and "
                   "encodes each row through their public ranges, printing the values clipped "
                   "per column among the rows sent; a study without one needs --target and is "
                   "scaled by the file's own statistics, which it prints.")
    p.add_argument("--target", default=None, metavar="COL",
                   help="Target column of a CSV dataset for a study without a schema (a "
                   "study with one names its columns itself).")
    p.add_argument("--reuse-rows", dest="reuse_rows", action="store_true",
                   help="Allow more devices than the CSV has rows: rows are sent again, so "
                   "one row counts as several devices' records (a simulation only).")
    p.add_argument("--seed", type=int, default=None, metavar="S",
                   help="Seed of the simulated dataset, and of which CSV rows are sent in which "
                   "order (default: a fresh one each run; the simulated noise is always "
                   "OS-seeded).")
    p.add_argument("--batch", type=int, default=LoadgenSettings().batch, metavar="B",
                   help="Devices simulated per vectorised step (IPDP_LOADGEN_BATCH).")
    p.add_argument("--via", default=None, metavar="URL",
                   help="Send through the HTTP gateway at URL (http://HOST:PORT) instead of "
                   "Kafka; the study is then read from the gateway too.")
    p.add_argument("--connections", type=int, default=LoadgenSettings().connections, metavar="C",
                   help="With --via: concurrent keep-alive connections, i.e. requests in "
                   "flight (IPDP_LOADGEN_CONNECTIONS). The gateway's per-client limits apply to "
                   "this one address: a 429 or 503 is sent again after its Retry-After and "
                   "slows every connection down to the gateway's rate; for a load test list "
                   "this address in IPDP_GATEWAY_RELAY_ADDRESSES on the gateway.")
    p.add_argument("--per-request", dest="per_request", type=int,
                   default=LoadgenSettings().per_request, metavar="K",
                   help="With --via: records per POST (IPDP_LOADGEN_PER_REQUEST); 1, a device "
                   "sending its own record, by default; more for a batch uploader.")
    p.add_argument("--no-progress", dest="no_progress", action="store_true",
                   help="No progress bar.")
    p.add_argument("--trust", action="append", default=None, metavar="PREFIX.pub",
                   help="Pin a study owner's public key (.pub path or base64; repeatable). The "
                   "study is used only if its signature verifies. Default: "
                   "IPDP_TRUSTED_STUDY_KEYS; with no key the study is unverified.")
    p.add_argument("--credentials", default=None, metavar="FILE",
                   help="Device credentials, one line per simulated device as `ipdp credentials "
                   "issue` prints them, for a study that requires them (straight to Kafka only; "
                   "each device sends its slot 0).")
    add_kafka_flag(p)
    add_redis_flag(p, "Also look the study up in this Redis if the studies topic lacks it.")
    p.set_defaults(func=lazy("ipdp.cli.loadgen", "cmd_loadgen"))


def _find_study(args: argparse.Namespace, kafka, topics: TopicSettings) -> Study:
    """The study from the studies topic, falling back to Redis when --redis-url is given."""
    from kafka.errors import KafkaError

    from ipdp.errors import BackendUnavailable, UnknownStudy
    from ipdp.state import load_study
    from producer.contributor import trusted_study_keys
    from producer.studies import find_study

    trusted = trusted_study_keys(getattr(args, "trust", None))
    found = None
    try:
        found = find_study(args.study, kafka, topics, timeout_s=10, trusted=trusted)
    except UnknownStudy:
        pass
    except (KafkaError, TimeoutError) as exc:
        if not getattr(args, "redis_url", None):
            raise BackendUnavailable(f"cannot read studies topic {topics.studies!r} at "
                                     f"{kafka.bootstrap}: {exc}") from None
    if found is None and getattr(args, "redis_url", None):
        from ipdp.cli.common import redis_connection

        with redis_connection(args) as client:
            found = load_study(client, args.study, trusted)
    return _open_study(found, args.study,
                       f"unknown study {args.study!r} (create it with `ipdp study create`)")


def _open_study(found: tuple[Study, StudyStatus] | None, study_id: str, missing: str) -> Study:
    """The study of a (study, status) lookup, or a UsageError saying it is missing or closed."""
    from ipdp.study import StudyStatus

    if found is None:
        raise UsageError(missing)
    study, status = found
    if status is StudyStatus.CLOSED:
        raise UsageError(f"study {study_id!r} is closed and accepts no more records")
    return study


def _study_via_gateway(args: argparse.Namespace) -> Study:
    """The study as the gateway serves it (what a device over HTTP sees)."""
    from ipdp.errors import StudyError
    from producer.contributor import trusted_study_keys
    from producer.transport import GatewayTransport

    trusted = trusted_study_keys(getattr(args, "trust", None))
    try:
        return GatewayTransport(args.via).study(args.study, trusted)
    except ValueError as exc:
        raise UsageError(f"--via {args.via}: {exc}") from None
    except StudyError as exc:
        raise UsageError(str(exc)) from None


def _credentials(args: argparse.Namespace, study: Study) -> list[bytes] | None:
    """The devices' credentials from --credentials FILE (one line of `ipdp credentials issue`
    per device), or None."""
    from ipdp.credentials import CredentialRefused, token_from_text

    if args.credentials is None:
        if study.require_credentials:
            log.warning("study %s requires credentials and none were given (--credentials): "
                        "every record will be dead-lettered credential_missing", study.study_id)
        return None
    if args.via:
        raise UsageError("--credentials sends straight to Kafka: over HTTP each request carries "
                         "one device's credential (Contributor.connect(study, via=URL, "
                         "credential=…))")
    try:
        lines = Path(args.credentials).read_text(encoding="ascii").split()
        tokens = [token_from_text(line) for line in lines]
    except (OSError, UnicodeDecodeError, CredentialRefused) as exc:
        raise UsageError(f"--credentials {args.credentials}: {exc}") from None
    if len(tokens) < args.devices:
        raise UsageError(f"--credentials {args.credentials} holds {len(tokens)} credential(s) "
                         f"for {args.devices} devices: one per device")
    return tokens


def _csv_dataset(args: argparse.Namespace, study: Study):
    """The rows of --dataset csv:PATH that the devices send, encoded for the study, in the order
    they are sent (a seeded permutation, repeated only with --reuse-rows); says what was done to
    them."""
    import numpy as np

    from producer.datasets import from_csv, from_csv_schema

    path = args.dataset[4:]
    schema = study.schema_
    try:
        if schema is not None:
            if args.target is not None and args.target != schema.target.name:
                raise UsageError(f"--target {args.target}: study {study.study_id!r} has a "
                                 f"schema whose target is {schema.target.name!r}; leave "
                                 "--target out")
            ds = from_csv_schema(path, schema)
        elif not args.target:
            raise UsageError("--dataset csv:PATH needs --target COLUMN for a study without a "
                             "schema (or create the study with --schema)")
        else:
            ds = from_csv(path, args.target, study.loss)
    except (OSError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    if ds.d != study.d:
        raise UsageError(f"{path} has {ds.d} feature columns, study {study.study_id!r} has "
                         f"d={study.d}")
    if len(ds) < args.devices and not args.reuse_rows:
        raise UsageError(f"{path} has {len(ds)} usable rows for {args.devices} devices: give "
                         "--devices ≤ rows, or --reuse-rows to send rows again")
    if len(ds) < args.devices:
        print(f"WARNING: {args.devices} devices from {len(ds)} rows: rows are reused, so the "
              "round holds repeated records (a simulation, not a study of distinct people)",
              file=sys.stderr)
    # One device per row, in random order; rows are reused only when asked to.
    sent = np.resize(np.random.default_rng(args.seed).permutation(len(ds)), args.devices)
    if schema is None:
        scaled = (f"rows divided by the file's largest row norm {ds.meta['x_scale']:.6g}; "
                  + (f"{args.target} mapped from the file's [{ds.meta['y_min']:.6g}, "
                     f"{ds.meta['y_max']:.6g}] onto [-1, 1]" if study.loss == "squared" else
                     f"{args.target} is +1 above the file's median {ds.meta['y_threshold']:.6g}"))
        print(f"WARNING: study {study.study_id!r} has no schema, so {path} is scaled by "
              f"statistics of the whole file, which no real device knows: {scaled}. Declare "
              "the columns' public ranges with `ipdp study create --schema`.", file=sys.stderr)
    else:
        print(f"rows read     {len(ds)} ({ds.meta['rows_skipped']} skipped: a missing or "
              f"unusable value); {args.devices} sent")
        clipped = ", ".join(f"{name} {int(outside[sent].sum())}"
                            for name, outside in ds.meta["outside"].items())
        print(f"clipped       {clipped} (values outside their schema range among the rows "
              "sent, per column)")
    outside = {name: rows[sent] for name, rows in ds.meta.get("outside", {}).items()}
    return ds.x[sent], ds.y[sent], outside


def _counting_clipped(study_id: str, x, y, outside: dict, batch: int):
    """The rows in batches; each batch, when taken to be sent, adds its values outside their
    range to ipdp_loadgen_values_clipped_total."""
    from ipdp.metrics import LOADGEN_VALUES_CLIPPED, start_at_zero

    start_at_zero(LOADGEN_VALUES_CLIPPED, *((study_id, name) for name in outside))
    for i in range(0, len(x), batch):
        for name, rows in outside.items():
            LOADGEN_VALUES_CLIPPED.labels(study_id, name).inc(int(rows[i:i + batch].sum()))
        yield x[i:i + batch], y[i:i + batch]


def cmd_loadgen(args: argparse.Namespace) -> int:
    """`ipdp loadgen`: simulate --devices devices contributing to --study."""

    from ipdp.metrics import serve, start_studies_reader_at_zero
    from ipdp.settings import MetricsSettings, TopicSettings
    from producer.datasets import synthetic_batches
    from producer.loadgen import run_loadgen_batches, run_loadgen_http

    if args.devices < 1:
        raise UsageError(f"--devices must be ≥ 1, got {args.devices}")
    if args.batch < 1:
        raise UsageError(f"--batch must be ≥ 1, got {args.batch}")
    if args.rate is not None and not args.rate > 0:
        raise UsageError(f"--rate must be > 0, got {args.rate}")
    if args.connections < 1 or args.per_request < 1:
        raise UsageError("--connections and --per-request must be ≥ 1")
    if args.via:
        study = _study_via_gateway(args)
    else:
        kafka = kafka_settings(args)
        topics = TopicSettings()
        study = _find_study(args, kafka, topics)
    serve(MetricsSettings(), "loadgen")
    start_studies_reader_at_zero("device")
    if args.dataset == "synthetic":
        _, batches = synthetic_batches(args.devices, study.d, study.loss, args.batch,
                                       seed=args.seed)
    elif args.dataset.startswith("csv:"):
        x, y, outside = _csv_dataset(args, study)
        batches = _counting_clipped(study.study_id, x, y, outside, args.batch)
    else:
        raise UsageError(f"--dataset must be 'synthetic' or 'csv:PATH', got {args.dataset!r}")
    common = {"rate": args.rate, "progress": not args.no_progress, "total": args.devices}
    credentials = _credentials(args, study)
    if args.via:
        result = run_loadgen_http(study, args.via, batches, connections=args.connections,
                                  per_request=args.per_request, **common)
    else:
        result = run_loadgen_batches(study, kafka, topics, batches, batch=args.batch,
                                     credentials=credentials, **common)
    print(f"records sent  {result.sent}")
    print(f"errors        {result.errors}")
    for reason, k in result.refused.items():
        print(f"  {k:>10}  {reason}")
    if args.via:
        print(f"retried       {result.retried} request(s) sent again after a 429, a 503 or a "
              "lost connection")
        if result.rate_limited:
            print(f"rate limited  {result.rate_limited} answer(s) 429 rate_limited: the "
                  "gateway's per-address limit set the pace (IPDP_GATEWAY_RELAY_ADDRESSES "
                  "on the gateway lifts it for this address)")
    print(f"elapsed       {result.seconds:.2f} s")
    print(f"records/s     {result.rate:.0f}")
    if result.interrupted:
        print("interrupted   yes")
        return 130
    return 0 if result.errors == 0 else 1
