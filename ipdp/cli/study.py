"""`ipdp calibrate` and the operator's study commands: `ipdp study create|show|close|list`."""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime

from ipdp.cli.common import (
    UsageError,
    add_kafka_flag,
    add_redis_flag,
    kafka_producer_for,
    load_study_file,
    redis_connection,
    study_flags,
    study_from_args,
    topic_settings,
)
from ipdp.errors import UnknownStudy


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register `calibrate` and `study` (create/show/close/list) on the `ipdp` sub-parsers."""
    p = sub.add_parser(
        "calibrate", help="Noise and guarantees for a set of study parameters.",
        description="Prints, for the study these flags describe, the noise every device adds "
        "(σ_u², σ_b²), the central (ε, δ) of each published model and the local privacy of one "
        "record, with the least n predicted to give a useful model. Creates nothing: "
        "`ipdp study create` takes the same flags.")
    study_flags(p, with_id=False)
    add_margin_flag(p)
    p.add_argument("--json", action="store_true", help="Print one JSON object.")
    p.set_defaults(func=cmd_calibrate)

    redis_opts = argparse.ArgumentParser(add_help=False)
    add_redis_flag(redis_opts)
    kafka_opts = argparse.ArgumentParser(add_help=False)
    add_kafka_flag(kafka_opts)

    study = sub.add_parser("study", help="Create, inspect, close and list studies.")
    ssub = study.add_subparsers(dest="study_command", required=True, metavar="ACTION")

    p = ssub.add_parser(
        "create", parents=[redis_opts, kafka_opts],
        help="Register a study in Redis and publish it on the studies topic.",
        description="Parameters come from --file (JSON, or YAML if PyYAML is installed) and/or "
        "flags; flags override the file. Creating the same study twice changes nothing; the "
        "same id with different parameters is refused.")
    study_flags(p, with_id=True)
    add_margin_flag(p)
    add_signing_flag(p)
    p.add_argument("--file", default=None, metavar="PATH", help="Study parameters, JSON/YAML.")
    p.add_argument("--check-csv", dest="check_csv", default=None, metavar="PATH",
                   help="Before creating a schema study, read this sample CSV as its devices "
                   "would and print per column what it holds (values outside the range, the "
                   "target's labels); a missing column, text in a numeric column or a label "
                   "that is not a class creates nothing (exit status 2).")
    p.add_argument("--json", action="store_true", help="Print the calibration as JSON.")
    p.add_argument("--allow-unproven-paper-calibration", dest="allow_paper", action="store_true",
                   help="Allow --mode paper for a live study: its guarantee is NOT proven "
                   "(docs/privacy.md, the erratum). For reproducing the paper only.")
    p.set_defaults(func=cmd_study_create)

    p = ssub.add_parser("show", parents=[redis_opts],
                        help="Parameters, calibration, status and progress of a study.")
    p.add_argument("study_id", metavar="ID", help="The study's id.")
    p.add_argument("--json", action="store_true", help="Print one JSON object.")
    p.set_defaults(func=cmd_study_show)

    p = ssub.add_parser("close", parents=[redis_opts, kafka_opts],
                        help="Stop a study accepting records (Redis and the studies topic).")
    p.add_argument("study_id", metavar="ID", help="The study's id.")
    add_signing_flag(p)
    p.set_defaults(func=cmd_study_close)

    p = ssub.add_parser(
        "delete", parents=[redis_opts, kafka_opts],
        help="Delete a study that never folded a record, so its id can be used again.",
        description="Removes the study from Redis and puts a tombstone on the studies topic, "
        "so devices, gateways and aggregators forget it; records still on their way are "
        "dead-lettered unknown_study. Refused once a record was folded or a model published: "
        "such a study can only be closed.")
    p.add_argument("study_id", metavar="ID", help="The study's id.")
    p.set_defaults(func=cmd_study_delete)

    p = ssub.add_parser("list", parents=[redis_opts], help="Every study, one line each.")
    p.add_argument("--json", action="store_true", help="One JSON object per line.")
    p.set_defaults(func=cmd_study_list)


def add_margin_flag(p: argparse.ArgumentParser) -> None:
    # No default here: ipdp.sample_size imports the calibration, which building the parser
    # must not (`ipdp --help` would import numpy).
    p.add_argument("--margin", type=float, default=None, metavar="M",
                   help="The promise the advised n must meet: test RMSE within τ = M·s of the "
                   "non-private model's, in quadrature (squared loss, default 0.3), or test "
                   "accuracy at most M below it (logistic, default 0.02) "
                   "(docs/privacy.md, \"The n a study needs\").")
    p.add_argument("--target-sd", dest="target_sd", type=float, default=None, metavar="S",
                   help="The target's standard deviation s in its units (squared loss): the "
                   "scale of the promise (default: the largest the target's range allows, half "
                   "of it).")


def _sample_size(study, args: argparse.Namespace):
    from ipdp.errors import CalibrationError
    from ipdp.sample_size import for_study

    try:
        return for_study(study, args.margin, args.target_sd)
    except CalibrationError as exc:
        raise UsageError(str(exc)) from None


def _advice_rows(study, size) -> list[tuple[str, str]]:
    """The n advice's lines, and how a schema study's η was chosen."""
    from ipdp.report import sample_size_rows
    from ipdp.sample_size import eta_advice

    eta = eta_advice(study)
    return sample_size_rows(size, study.n) + ([("η", eta)] if eta else [])


def add_signing_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--signing-key", dest="signing_key", default=None, metavar="PREFIX.key",
                   help="Sign the studies-topic message with this Ed25519 key (default: "
                   "IPDP_STUDY_SIGNING_KEY; neither: unsigned, which pinned readers refuse).")


def _signing_key(args: argparse.Namespace):
    from ipdp.settings import TrustSettings
    from ipdp.signing import load_signing_key

    path = args.signing_key or TrustSettings().study_signing_key
    return None if not path else load_signing_key(path)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from ipdp.report import calibration_table

    args.study_id = "calibrate"
    study = study_from_args(args)
    cal = study.calibration
    size = _sample_size(study, args)
    if args.json:
        # "delta" is the published models', the norm check's share included (docs/privacy.md).
        print(json.dumps(cal.model_dump() | {"sample_size": asdict(size)}, sort_keys=True))
    else:
        print(calibration_table(cal, _advice_rows(study, size)))
    return 0


def cmd_study_create(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from ipdp.report import calibration_table, sample_size_warning, two_server_rows
    from ipdp.state import create_study

    base = load_study_file(args.file) if args.file else None
    study = study_from_args(args, base)
    if not study.calibration.proven and not args.allow_paper:
        raise UsageError(
            f"mode {study.mode!r} has no proven guarantee (docs/privacy.md, the erratum): a live "
            "study needs the default rigorous mode, or --allow-unproven-paper-calibration to "
            "reproduce the paper knowingly")
    size = _sample_size(study, args)
    if args.check_csv is not None:
        check_sample(study, args.check_csv)
    key = _signing_key(args)
    with redis_connection(args) as r, kafka_producer_for(args) as producer:
        created = create_study(r, producer, topic_settings(), study, key)
    if args.json:
        two = study.two_server_calibration
        print(json.dumps({"study": study.model_dump(mode="json"), "created": created,
                          "calibration": study.calibration.model_dump(mode="json"),
                          "two_server_calibration": None if two is None
                          else two.model_dump(mode="json"),
                          "sample_size": asdict(size)}, sort_keys=True))
        return 0
    if created:
        print(f"created study {study.study_id}")
    else:
        print(f"study {study.study_id} already exists with these parameters; nothing changed")
    if key:  # unsigned: ipdp.state.create_study has warned, once
        print(f"signed by key {key.key_id}")
    print(calibration_table(study.calibration,
                            _advice_rows(study, size) + two_server_rows(study)))
    warning = sample_size_warning(size, study.n)
    if warning:
        print(warning, file=sys.stderr)
    return 0


def check_sample(study, path: str) -> None:
    """`--check-csv`: the sample read against the study's schema, printed; UsageError (and no
    study) if it cannot feed the study."""
    from ipdp.report import table
    from ipdp.schema_check import check_csv, check_rows

    if study.schema_ is None:
        raise UsageError("--check-csv checks a sample against the study's schema: give --schema "
                         "(or a schema in --file)")
    try:
        check = check_csv(path, study.schema_)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--check-csv {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if check.columns:
        print(table(check_rows(check, study.schema_), title=f"{path}: {check.rows} row(s)"),
              file=sys.stderr)
    if check.problems:
        raise UsageError("--check-csv: the sample does not fit the schema, so no study was "
                         "created:\n  " + "\n  ".join(check.problems))


def _iso(ms: int | None) -> str:
    if ms is None:
        return "unknown"
    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat(timespec="seconds")


def _int(v) -> int | None:
    return None if v is None else int(v)


def study_info(r, study_id: str) -> dict:
    """What `study show` prints, from Redis; UnknownStudy if there is no such study."""
    from ipdp.state import StudyKeys, envelope_signer, load_study, rounds_published

    got = load_study(r, study_id)
    if got is None:
        raise UnknownStudy(f"unknown study {study_id!r}")
    study, status = got
    keys = StudyKeys(study_id)
    created_ms, envelope = r.hmget(keys.study, ["created_ms", "envelope"])
    rnd, count = r.hmget(keys.open, ["round", "count"])
    return {
        "study": study,
        "status": status,
        "created_ms": _int(created_ms),
        "key_id": envelope_signer(envelope),
        "rounds_published": rounds_published(r, study_id),
        "open_round": None if rnd is None else {"round": int(rnd), "count": _int(count) or 0},
    }


def cmd_study_show(args: argparse.Namespace) -> int:
    from ipdp.report import calibration_rows, fmt, table, two_server_rows

    with redis_connection(args) as r:
        info = study_info(r, args.study_id)
    study = info["study"]
    cal = study.calibration
    if args.json:
        two = study.two_server_calibration
        out = {**info, "study": study.model_dump(mode="json"),
               "calibration": cal.model_dump(mode="json"),
               "two_server_calibration": None if two is None else two.model_dump(mode="json")}
        print(json.dumps(out, sort_keys=True))
        return 0
    o = info["open_round"]
    rows = [
        ("status", info["status"]),
        ("created", _iso(info["created_ms"])),
        ("loss", study.loss),
        ("max rounds", "unlimited" if study.max_rounds is None else str(study.max_rounds)),
        ("budget (ε, δ)", "none" if study.budget_epsilon is None else
         f"({fmt(study.budget_epsilon)}, {fmt(study.budget_delta)}): at most "
         f"{study.round_limit} rounds"),
        ("credentials", f"required, {study.records_per_device} record(s) per credential"
         if study.require_credentials else "not required"),
        ("rounds published", str(info["rounds_published"])),
        ("open round", "none yet" if o is None else f"{o['round']}: {o['count']}/{study.n}"),
        ("schema", "none: devices send an encoded (x, y)" if study.schema_ is None
         else schema_text(study.schema_)),
        ("Δ_in given", "mode default" if study.delta_in is None else fmt(study.delta_in)),
        ("signed by", f"key {info['key_id']}" if info["key_id"] else "nobody (unsigned)"),
        ("study hash", study.hash.hex()),
    ] + two_server_rows(study)
    print(table(rows, title=f"study {study.study_id}"))
    print()
    print(table(calibration_rows(cal), title="calibration"))
    return 0


def progress_text(info: dict) -> str:
    """The round a study is filling, as `ipdp models` shows it: `round 2: 169/2400 records
    folded`; a closed study or one without a record says so."""
    study, o = info["study"], info["open_round"]
    if info["status"] != "open":
        return f"study {study.study_id} is {info['status']}, {info['rounds_published']} " \
               "round(s) published"
    if o is None:
        return f"study {study.study_id}: round 1: 0/{study.n} records folded"
    return f"study {study.study_id}: round {o['round']}: {o['count']}/{study.n} records folded"


def schema_text(schema) -> str:
    """`age [21, 35], income [0, 1e+05] → weeks [0, 52], with an intercept`: one line."""
    from ipdp.report import fmt

    t = schema.target
    target = (f"{t.name} ({' or '.join(t.classes)})" if t.is_class
              else f"{t.name} [{fmt(t.min)}, {fmt(t.max)}]")
    features = ", ".join(f"{f.name} [{fmt(f.min)}, {fmt(f.max)}]" for f in schema.features)
    return f"{features} → {target}, {'with' if schema.intercept else 'without'} an intercept"


def cmd_study_close(args: argparse.Namespace) -> int:
    from ipdp.state import close_study

    with redis_connection(args) as r, kafka_producer_for(args) as producer:
        close_study(r, producer, topic_settings(), args.study_id, _signing_key(args))
    print(f"closed study {args.study_id}")
    return 0


def cmd_study_delete(args: argparse.Namespace) -> int:
    from ipdp.state import delete_study

    with redis_connection(args) as r, kafka_producer_for(args) as producer:
        delete_study(r, producer, topic_settings(), args.study_id)
    print(f"deleted study {args.study_id}")
    return 0


def cmd_study_list(args: argparse.Namespace) -> int:
    from ipdp.report import fmt
    from ipdp.state import list_studies, rounds_published

    with redis_connection(args) as r:
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
