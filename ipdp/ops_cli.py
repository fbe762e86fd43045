"""Operator commands: `ipdp study create|show|close|list` and `ipdp models`.

Redis comes from RedisSettings (IPDP_REDIS_*) with a `--redis-url` override, Kafka from
KafkaSettings (IPDP_KAFKA_*) with a `--bootstrap` override, topic names from TopicSettings.
Every expected failure (bad parameters, unreachable or refusing backends, unknown study) is a
cli.UsageError: one message, exit status 2, no traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ipdp.cli import UsageError, _study_flags, study_from_args


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register `study` (create/show/close/list) and `models` on the `ipdp` sub-parsers."""
    redis_opts = argparse.ArgumentParser(add_help=False)
    redis_opts.add_argument("--redis-url", dest="redis_url", default=None, metavar="URL",
                            help="Redis URL (overrides IPDP_REDIS_URL).")
    kafka_opts = argparse.ArgumentParser(add_help=False)
    kafka_opts.add_argument("--bootstrap", default=None, metavar="HOST:PORT[,...]",
                            help="Kafka bootstrap servers (overrides IPDP_KAFKA_BOOTSTRAP).")

    study = sub.add_parser("study", help="Create, inspect, close and list studies.")
    ssub = study.add_subparsers(dest="study_command", required=True, metavar="ACTION")

    p = ssub.add_parser(
        "create", parents=[redis_opts, kafka_opts],
        help="Register a study in Redis and publish it on the studies topic.",
        description="Parameters come from --file (JSON, or YAML if PyYAML is installed) and/or "
        "flags; flags override the file. Creating the same study twice changes nothing; the "
        "same id with different parameters is refused.")
    _study_flags(p, with_id=True)
    p.add_argument("--file", default=None, metavar="PATH", help="Study parameters, JSON/YAML.")
    p.add_argument("--json", action="store_true", help="Print the calibration as JSON.")
    p.set_defaults(func=cmd_study_create)

    p = ssub.add_parser("show", parents=[redis_opts],
                        help="Parameters, calibration, status and progress of a study.")
    p.add_argument("study_id", metavar="ID")
    p.add_argument("--json", action="store_true", help="Print one JSON object.")
    p.set_defaults(func=cmd_study_show)

    p = ssub.add_parser("close", parents=[redis_opts, kafka_opts],
                        help="Stop a study accepting records (Redis and the studies topic).")
    p.add_argument("study_id", metavar="ID")
    p.set_defaults(func=cmd_study_close)

    p = ssub.add_parser("list", parents=[redis_opts], help="Every study, one line each.")
    p.add_argument("--json", action="store_true", help="One JSON object per line.")
    p.set_defaults(func=cmd_study_list)

    p = sub.add_parser("models", parents=[kafka_opts],
                       help="Published models, one line each (each (study, round) once).")
    p.add_argument("--study", default=None, metavar="ID", help="Only this study.")
    p.add_argument("--follow", action="store_true", help="Keep waiting for new models.")
    p.add_argument("--json", action="store_true", help="One JSON model message per line.")
    p.set_defaults(func=cmd_models)


# --------------------------------------------------------------------------- backends


def _kafka(args: argparse.Namespace):
    from ipdp.settings import KafkaSettings

    kafka = KafkaSettings()
    if getattr(args, "bootstrap", None):
        kafka = kafka.model_copy(update={"bootstrap": args.bootstrap})
    return kafka


@contextlib.contextmanager
def _redis(args: argparse.Namespace) -> Iterator[Any]:
    import redis

    from ipdp.clients import _describe, check_redis, redis_client
    from ipdp.settings import RedisSettings

    settings = RedisSettings()
    if getattr(args, "redis_url", None):
        settings = settings.model_copy(update={"url": args.redis_url})
    try:
        client = redis_client(settings)
    except ValueError as exc:  # malformed URL
        raise UsageError(f"bad Redis URL: {exc}") from None
    try:
        try:
            check_redis(client)
        except RuntimeError as exc:  # authentication failure, already readable
            raise UsageError(str(exc)) from None
        except redis.RedisError as exc:
            _user, where = _describe(client)
            raise UsageError(f"cannot reach Redis at {where}: {exc}") from None
        try:
            yield client
        except redis.RedisError as exc:
            raise UsageError(f"Redis error: {exc}") from None
    finally:
        client.close()


@contextlib.contextmanager
def _producer(args: argparse.Namespace) -> Iterator[Any]:
    from kafka.errors import KafkaError

    from ipdp.clients import kafka_producer

    kafka = _kafka(args)
    try:
        producer = kafka_producer(kafka, max_block_ms=15_000, bootstrap_timeout_ms=10_000)
    except KafkaError as exc:
        raise UsageError(f"cannot reach Kafka at {kafka.bootstrap}: {exc!r}") from None
    try:
        yield producer
    except KafkaError as exc:
        raise UsageError(f"Kafka error at {kafka.bootstrap}: {exc!r}") from None
    finally:
        producer.close(timeout=5)


def _topics():
    from ipdp.settings import TopicSettings

    return TopicSettings()


# --------------------------------------------------------------------------- study


def _load_file(path: str) -> dict:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from None
    if p.suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise UsageError(f"{path}: YAML study files need PyYAML (pip install pyyaml); "
                             "or write the study as JSON") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise UsageError(f"{path}: invalid YAML: {exc}") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{path}: invalid JSON: {exc}") from None
    if isinstance(data, dict) and isinstance(data.get("study"), dict):
        data = data["study"]  # a studies-topic message or `study show --json` output
    if not isinstance(data, dict):
        raise UsageError(f"{path}: expected an object of study parameters")
    return data


def cmd_study_create(args: argparse.Namespace) -> int:
    from ipdp.registry import StudyExists, create_study
    from ipdp.report import calibration_table

    base = _load_file(args.file) if args.file else None
    study = study_from_args(args, base)
    with _redis(args) as r, _producer(args) as producer:
        try:
            created = create_study(r, producer, _topics(), study)
        except StudyExists as exc:
            raise UsageError(str(exc)) from None
    if args.json:
        print(json.dumps({"study": study.model_dump(mode="json"), "created": created,
                          "calibration": study.calibration.model_dump(mode="json")},
                         sort_keys=True))
        return 0
    if created:
        print(f"created study {study.study_id}")
    else:
        print(f"study {study.study_id} already exists with these parameters; nothing changed")
    print(calibration_table(study.calibration))
    return 0


def _iso(ms: int | None) -> str:
    if ms is None:
        return "unknown"
    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat(timespec="seconds")


def _int(v) -> int | None:
    return None if v is None else int(v)


def _study_info(r, study_id: str) -> dict:
    from ipdp.registry import load_study, rounds_published
    from ipdp.state import open_key, study_key

    got = load_study(r, study_id)
    if got is None:
        raise UsageError(f"unknown study {study_id!r}")
    study, status = got
    created_ms = _int(r.hget(study_key(study_id), "created_ms"))
    rnd, count = r.hmget(open_key(study_id), ["round", "count"])
    return {
        "study": study,
        "status": status,
        "created_ms": created_ms,
        "rounds_published": rounds_published(r, study_id),
        "open_round": None if rnd is None else {"round": int(rnd), "count": _int(count) or 0},
    }


def cmd_study_show(args: argparse.Namespace) -> int:
    from ipdp.report import calibration_rows, fmt, table

    with _redis(args) as r:
        info = _study_info(r, args.study_id)
    study = info["study"]
    cal = study.calibration
    if args.json:
        out = {**info, "study": study.model_dump(mode="json"),
               "calibration": cal.model_dump(mode="json")}
        print(json.dumps(out, sort_keys=True))
        return 0
    o = info["open_round"]
    rows = [
        ("status", info["status"]),
        ("created", _iso(info["created_ms"])),
        ("loss", study.loss),
        ("max rounds", "unlimited" if study.max_rounds is None else str(study.max_rounds)),
        ("rounds published", str(info["rounds_published"])),
        ("open round", "none yet" if o is None else f"{o['round']}: {o['count']}/{study.n}"),
        ("Δ_in given", "mode default" if study.delta_in is None else fmt(study.delta_in)),
    ]
    print(table(rows, title=f"study {study.study_id}"))
    print()
    print(table(calibration_rows(cal), title="calibration"))
    return 0


def cmd_study_close(args: argparse.Namespace) -> int:
    from ipdp.registry import UnknownStudy, close_study

    with _redis(args) as r, _producer(args) as producer:
        try:
            close_study(r, producer, _topics(), args.study_id)
        except UnknownStudy as exc:
            raise UsageError(str(exc.args[0])) from None
    print(f"closed study {args.study_id}")
    return 0


def cmd_study_list(args: argparse.Namespace) -> int:
    from ipdp.registry import list_studies, rounds_published
    from ipdp.report import fmt

    with _redis(args) as r:
        studies = [(s, st, rounds_published(r, s.study_id)) for s, st in list_studies(r)]
    if args.json:
        for s, st, k in studies:
            print(json.dumps({"study": s.model_dump(mode="json"), "status": st,
                              "rounds_published": k}, sort_keys=True))
        return 0
    if not studies:
        print("no studies", file=sys.stderr)
        return 0
    head = ("study", "status", "loss", "d", "n", "ε", "δ", "mode", "rounds")
    rows = [head] + [
        (s.study_id, st, s.loss, str(s.d), str(s.n), fmt(s.epsilon, 4), fmt(s.delta, 4), s.mode,
         str(k)) for s, st, k in studies]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    return 0


# --------------------------------------------------------------------------- models


def model_line(m) -> str:
    """One human line for a ModelMessage."""
    import math

    w_norm = math.sqrt(sum(v * v for v in m.weights))
    pr = m.privacy
    return (f"{m.study_id}  round {m.round}  n={m.n}  ‖w‖={w_norm:.4f}  "
            f"ε={pr.epsilon:g}  δ={pr.delta:g}  mode={pr.mode}  "
            f"solve={m.solve_seconds * 1000:.2f} ms")


def cmd_models(args: argparse.Namespace) -> int:
    from kafka.errors import KafkaError

    from ipdp.subscriber import ModelSubscriber

    kafka = _kafka(args)
    count = 0
    try:
        with ModelSubscriber(kafka, _topics(), study_id=args.study, from_beginning=True,
                             follow=args.follow) as sub:
            for m in sub:
                count += 1
                line = m.model_dump_json() if args.json else model_line(m)
                print(line, flush=True)
            dropped = sub.duplicates_dropped
    except (KafkaError, TimeoutError) as exc:
        raise UsageError(f"cannot read models from Kafka at {kafka.bootstrap}: {exc!r}") from None
    if not args.json:
        print(f"{count} model(s); {dropped} duplicate(s) dropped", file=sys.stderr)
    return 0
