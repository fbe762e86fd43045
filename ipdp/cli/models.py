"""`ipdp models`: published models, one line each, each (study, round) once."""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import threading
from collections.abc import Callable
from typing import Self

from ipdp.cli.common import (
    UsageError,
    add_kafka_flag,
    add_redis_flag,
    kafka_settings,
    redis_connection,
    topic_settings,
)
from ipdp.errors import BackendUnavailable, IpdpError

#: How often `--wait` redraws its progress line on a terminal, and writes one otherwise.
PROGRESS_TTY_EVERY_S = 1.0
PROGRESS_LOG_EVERY_S = 30.0


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
    add_redis_flag(p, "With --study: the Redis that holds the study and its open round's "
                   "progress (overrides IPDP_REDIS_URL).")
    p.add_argument("--study", default=None, metavar="ID",
                   help="Only this study, which must exist (checked in Redis); its filling "
                   "round's progress is printed too.")
    p.add_argument("--trust", action="append", default=None, metavar="PREFIX.pub",
                   help="Pin the trainer's public key (.pub path or base64; repeatable): only "
                   "models it signed are shown. Default: IPDP_TRUSTED_MODEL_KEYS.")
    p.add_argument("--follow", action="store_true", help="Keep waiting for new models.")
    p.add_argument("--json", action="store_true", help="One JSON model message per line.")
    p.add_argument("--wait", type=int, default=None, metavar="N",
                   help="Wait until N models have been published, print them and exit; with "
                   "--study, the filling round's progress is shown while it waits (a live "
                   "line on a terminal, a line every 30 s otherwise).")
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
            f"{'' if pr.proven else ' (NOT proven)'}"
            f"{'  servers=two-server' if pr.servers == 'two-server' else ''}")
    lines = [line] if m.schema_ is None else [line, *coefficient_lines(m)]
    if m.constraint_active:
        lines.append(constraint_note(m))
    return "\n".join(lines)


def constraint_note(m) -> str:
    """What a binding norm constraint means for the user, and what to do about it."""
    eta = m.privacy.eta
    return (f"  norm constraint binds: ‖w‖ = η = {eta:g}, so the fit stopped at the bound. A "
            f"new study with a larger --eta may fit better, at more noise per record: `ipdp "
            f"calibrate --eta {2 * eta:g} …` shows its noise and the n it needs "
            "(docs/operations.md, \"A binding norm constraint\")")


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
    # Unverified: the subscriber has warned, once for the command, that no trainer key is pinned.
    print(f"exported {message.study_id} round {message.round} to {path}"
          f"{' (signature verified)' if verified else ''}", file=sys.stderr)
    if message.constraint_active:
        print(constraint_note(message).strip(), file=sys.stderr)


class ProgressLine:
    """The filling round's progress on stderr while `--wait` waits: redrawn in place every
    PROGRESS_TTY_EVERY_S on a terminal, else written as a line every PROGRESS_LOG_EVERY_S
    (the first at once). :meth:`clear` makes room for a model line."""

    def __init__(self, describe: Callable[[], str], stream=None) -> None:
        self.describe = describe
        self.stream = stream or sys.stderr
        self.live = self.stream.isatty()
        self.every = PROGRESS_TTY_EVERY_S if self.live else PROGRESS_LOG_EVERY_S
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="ipdp-models-progress",
                                       daemon=True)

    def __enter__(self) -> Self:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        self.thread.join(timeout=5)
        self.clear()

    def _run(self) -> None:
        while not self.stopped.is_set():
            try:
                text = f"waiting: {self.describe()}"
            except Exception:  # noqa: BLE001 - Redis away for a moment: skip this update
                text = None
            if text is not None:
                with self.lock:
                    if self.live:
                        self.stream.write(f"\r\x1b[K{text}")
                    else:
                        self.stream.write(f"{text}\n")
                    self.stream.flush()
            self.stopped.wait(self.every)

    def clear(self) -> None:
        if self.live:
            with self.lock:
                self.stream.write("\r\x1b[K")
                self.stream.flush()


def cmd_models(args: argparse.Namespace) -> int:
    """`ipdp models`: print published models (all, `--follow` new ones, or `--wait N`); with
    `--study`, the study must exist and its filling round's progress is printed."""
    from ipdp.cli.study import progress_text, study_info

    if args.wait is not None and args.wait < 1:
        raise UsageError(f"--wait must be ≥ 1, got {args.wait}")
    if args.export is not None and (args.study is None or args.follow):
        raise UsageError("--export writes one study's newest model: it needs --study, and "
                         "not --follow")
    with contextlib.ExitStack() as stack:
        progress = None
        if args.study is not None:
            r = stack.enter_context(redis_connection(args))
            study_info(r, args.study)  # UnknownStudy before anything is read from Kafka

            def progress() -> str:
                return progress_text(study_info(r, args.study))

        count, newest, dropped, refused, verified = _print_models(args, progress)
        if args.wait is not None and count < args.wait:
            raise ModelsTimeout(f"saw {count} of {args.wait} model(s) within {args.timeout:g} s"
                                + ("" if progress is None else f"; {progress()}"))
        if not args.json:
            print(f"{count} model(s); {dropped} duplicate(s) dropped", file=sys.stderr)
        if progress is not None and args.wait is None:
            print(progress(), file=sys.stderr)
    if args.export is not None:
        if newest is None:
            raise UsageError(f"study {args.study!r} has no published model to export")
        export_model(*newest, args.export, verified)
    if refused:
        print(f"{refused} model message(s) refused: signature does not verify under a trusted "
              "key", file=sys.stderr)
    return 0


def _print_models(args: argparse.Namespace, progress: Callable[[], str] | None):
    """Print the models `args` asks for; (count, (newest message, its value) or None,
    duplicates dropped, refused, whether a trainer key was pinned)."""
    from kafka.errors import KafkaError

    from ipdp.subscriber import ModelSubscriber

    kafka = kafka_settings(args)
    newest = None
    count = 0
    follow = args.follow or args.wait is not None
    try:
        with ModelSubscriber(kafka, topic_settings(), study_id=args.study, from_beginning=True,
                             follow=follow, trusted_keys=args.trust) as sub, \
                contextlib.ExitStack() as shown:
            line = (shown.enter_context(ProgressLine(progress))
                    if args.wait is not None and progress is not None else None)
            timer = threading.Timer(args.timeout, sub.stop) if args.wait else None
            if timer is not None:
                timer.daemon = True
                timer.start()
            for m in sub:
                count += 1
                if newest is None or m.round > newest[0].round:
                    newest = (m, sub.last_value)
                if line is not None:
                    line.clear()
                print(m.model_dump_json() if args.json else model_line(m), flush=True)
                if args.wait is not None and count >= args.wait:
                    break
            if timer is not None:
                timer.cancel()
            return count, newest, sub.duplicates_dropped, sub.refused, bool(sub.trusted)
    except (KafkaError, TimeoutError) as exc:
        raise BackendUnavailable(
            f"cannot read models from Kafka at {kafka.bootstrap}: {exc!r}") from None
