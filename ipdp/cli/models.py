"""`ipdp models`: published models, one line each, each (study, round) once."""

from __future__ import annotations

import argparse
import math
import sys
import threading

from ipdp.cli.common import UsageError, add_kafka_flag, kafka_settings, topic_settings
from ipdp.errors import BackendUnavailable, IpdpError


class ModelsTimeout(IpdpError):
    """`--wait N` did not see N models in time."""

    exit_code = 1


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register `models` on the `ipdp` sub-parsers."""
    p = sub.add_parser(
        "models", help="Published models, one line each (each (study, round) once).",
        description="Reads the models topic from its beginning and prints each (study, round) "
        "once: its n, ‖w‖, privacy, whether the norm constraint ‖w‖ ≤ η binds, and for a schema "
        "study the model in raw units. With --study, a study whose round is still filling "
        "shows its progress (records folded of n, from Redis); an unknown study is an error.")
    add_kafka_flag(p)
    p.add_argument("--study", default=None, metavar="ID", help="Only this study.")
    p.add_argument("--trust", action="append", default=None, metavar="PREFIX.pub",
                   help="Pin the trainer's public key (.pub path or base64; repeatable): only "
                   "models it signed are shown. Default: IPDP_TRUSTED_MODEL_KEYS.")
    p.add_argument("--follow", action="store_true", help="Keep waiting for new models.")
    p.add_argument("--json", action="store_true", help="One JSON model message per line.")
    p.add_argument("--wait", type=int, default=None, metavar="N",
                   help="Wait until N models have been published, print them and exit.")
    p.add_argument("--timeout", type=float, default=300.0, metavar="S",
                   help="With --wait: give up (exit status 1) after S seconds (default 300).")
    p.add_argument("--export", default=None, metavar="PATH",
                   help="With --study: write the newest model (verified, if a trainer key is "
                   "pinned) with its schema and privacy report to PATH as JSON, in its signed "
                   "envelope when the trainer signs, for `ipdp.load_model(PATH)`; after --wait "
                   "N, the newest of those N.")
    p.set_defaults(func=cmd_models)


def model_line(m) -> str:
    """One human line for a ModelMessage; for a study with a schema, then one line per
    coefficient in raw units, named (ipdp.model)."""
    w_norm = math.sqrt(sum(v * v for v in m.weights))
    pr = m.privacy
    line = (f"{m.study_id}  round {m.round}  n={m.n}  ‖w‖={w_norm:.4f}  "
            f"ε={pr.epsilon:g}  δ={pr.delta:g}  mode={pr.mode}"
            f"{'' if pr.proven else ' (NOT proven)'}")
    if m.schema_ is None:
        return line
    return "\n".join([line, *coefficient_lines(m)])


def coefficient_lines(m) -> list[str]:
    """The model of a study with a schema in raw units: its intercept and named coefficients."""
    from ipdp.model import Model

    model = Model(m)
    unit = (f"log-odds of {model.target_name}={model.classes[1]!r}" if model.classes
            else model.target_name)
    rows = [("intercept", model.intercept_), *zip(model.feature_names, model.coef_.tolist())]
    return [f"  {unit} = {rows[0][1]:.6g}"] + [
        f"      {'+' if v >= 0 else '-'} {abs(v):.6g} × {name}" for name, v in rows[1:]]


def export_model(message, value: bytes, path: str, verified: bool) -> None:
    """Write the models-topic ``value`` of ``message`` (its signed envelope when the trainer
    signs, so `ipdp.load_model(path, trusted_keys=…)` can verify it again) as indented JSON."""
    import json
    from pathlib import Path

    from ipdp.model import Model

    Model(message)  # refuses a model without a schema, before anything is written
    try:
        Path(path).write_text(json.dumps(json.loads(value), indent=2) + "\n", encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror or exc}") from None
    print(f"exported {message.study_id} round {message.round} to {path}"
          f"{'' if verified else ' (UNVERIFIED: no trainer key pinned, --trust)'}",
          file=sys.stderr)


def cmd_models(args: argparse.Namespace) -> int:
    """`ipdp models`: print published models (all, `--follow` new ones, or `--wait N`)."""
    from kafka.errors import KafkaError

    from ipdp.subscriber import ModelSubscriber

    if args.wait is not None and args.wait < 1:
        raise UsageError(f"--wait must be ≥ 1, got {args.wait}")
    if args.export is not None and (args.study is None or args.follow):
        raise UsageError("--export writes one study's newest model: it needs --study, and "
                         "not --follow")
    newest = None
    kafka = kafka_settings(args)
    count = 0
    follow = args.follow or args.wait is not None
    try:
        with ModelSubscriber(kafka, topic_settings(), study_id=args.study, from_beginning=True,
                             follow=follow, trusted_keys=args.trust) as sub:
            timer = threading.Timer(args.timeout, sub.stop) if args.wait else None
            if timer is not None:
                timer.daemon = True
                timer.start()
            for m in sub:
                count += 1
                if newest is None or m.round > newest[0].round:
                    newest = (m, sub.last_value)
                line = m.model_dump_json() if args.json else model_line(m)
                print(line, flush=True)
                if args.wait is not None and count >= args.wait:
                    break
            if timer is not None:
                timer.cancel()
            dropped, refused = sub.duplicates_dropped, sub.refused
            verified = bool(sub.trusted)
    except (KafkaError, TimeoutError) as exc:
        raise BackendUnavailable(
            f"cannot read models from Kafka at {kafka.bootstrap}: {exc!r}") from None
    if args.wait is not None and count < args.wait:
        raise ModelsTimeout(f"saw {count} of {args.wait} model(s) within {args.timeout:g} s")
    if not args.json:
        print(f"{count} model(s); {dropped} duplicate(s) dropped", file=sys.stderr)
    if args.export is not None:
        if newest is None:
            raise UsageError(f"study {args.study!r} has no published model to export")
        export_model(*newest, args.export, verified)
    if refused:
        print(f"{refused} model message(s) refused: signature does not verify under a trusted "
              "key", file=sys.stderr)
    return 0
