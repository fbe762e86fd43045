"""What every command shares: the usage error, study flags, and backends built from flags + env.

Redis comes from RedisSettings (IPDP_REDIS_*) with a `--redis-url` override, Kafka from
KafkaSettings (IPDP_KAFKA_*) with a `--bootstrap` override, topic names from TopicSettings.
Every expected failure is an :class:`ipdp.errors.IpdpError`: one message, exit status 2, no
traceback (ipdp/cli/main.py).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ipdp.errors import BackendUnavailable, ConfigurationError, RedisAuthError

if TYPE_CHECKING:
    from pydantic import ValidationError

    from ipdp.settings import KafkaSettings, TopicSettings


class UsageError(ConfigurationError):
    """A bad flag, parameter or file: printed without a traceback, exit status 2."""


#: What to do when Kafka or Redis cannot be reached: the CLI adds it to every such error.
START_THE_RUNTIME = ("to run one here: `ipdp up --env-file ipdp.env &`, then `. ./ipdp.env` "
                     "(it sets the IPDP_* variables)")

#: How long a command waits for Kafka's first answer before it gives up.
KAFKA_CHECK_TIMEOUT_S = 10.0


def lazy(module: str, func: str) -> Callable[[argparse.Namespace], int]:
    """A command handler that imports its module only when the command runs."""

    def run(args: argparse.Namespace) -> int:
        return getattr(importlib.import_module(module), func)(args)

    return run


def check_backends(args: argparse.Namespace, needs: tuple[str, ...]) -> None:
    """Check that the backends a command ``needs`` ("redis", "kafka") answer, before it runs:
    a long-running role retries a backend that goes away, but one that is not there at the
    start is a user's mistake, said in one line (BackendUnavailable)."""
    if "redis" in needs:
        with redis_connection(args):
            pass
    if "kafka" in needs:
        check_kafka(kafka_settings(args))


def check_kafka(kafka: KafkaSettings) -> None:
    """Bootstrap from ``kafka``; BackendUnavailable, naming the address, if it does not answer
    within KAFKA_CHECK_TIMEOUT_S."""
    from kafka.errors import KafkaError

    from ipdp.kafka_io import kafka_admin

    # kafka-python logs each failed attempt; the BackendUnavailable below is the one line.
    quiet = logging.getLogger("kafka")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        admin = kafka_admin(kafka, bootstrap_timeout_ms=int(KAFKA_CHECK_TIMEOUT_S * 1000))
    except KafkaError as exc:
        raise BackendUnavailable(f"cannot reach Kafka at {kafka.bootstrap}: {exc}") from None
    finally:
        quiet.setLevel(level)
    admin.close()


@contextlib.contextmanager
def stop_on_signals(exit_status: int) -> Iterator[None]:
    """Inside the block, SIGTERM and SIGINT (Ctrl-C) stop the command at once: the handler stops
    every child process and runtime the command registered (ipdp.embedded.children: services
    first, then the servers, whose directory goes with them) and exits with ``exit_status``.

    Nothing is raised into the interrupted code: kafka-python at times runs its IO loop in the
    calling thread and logs and drops an exception raised there, after which the command
    would wait forever. A signal that comes while the handler stops is ignored (a second
    Ctrl-C), so the stop runs to its end; it is bounded by the children's stop timeouts."""
    from ipdp.embedded.children import stop_all_children  # never import in a signal handler

    stopping = []

    def handler(signum: int, _frame: object) -> None:
        if stopping:
            return
        stopping.append(signum)
        os.write(2, b"ipdp: stopping every process it started\n")
        try:
            stop_all_children()
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):  # the interrupted code may hold it
                    stream.flush()
            os._exit(exit_status)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def study_flags(p: argparse.ArgumentParser, *, with_id: bool) -> None:
    """The study parameters as flags (`ipdp calibrate`, `ipdp study create`)."""
    if with_id:
        p.add_argument("--study-id", dest="study_id", help="Study id (letters, digits, . _ -).")
        p.add_argument("--max-rounds", dest="max_rounds", type=int, default=None,
                       help="Close the study after this many published rounds (default: "
                       "unlimited, or what --budget-epsilon allows).")
        p.add_argument("--budget-epsilon", dest="budget_epsilon", type=float, default=None,
                       help="Total ε over the rounds (with --budget-delta): the study closes "
                       "before a round that would exceed it (docs/accounting.md).")
        p.add_argument("--budget-delta", dest="budget_delta", type=float, default=None,
                       help="Total δ of the budget.")
        p.add_argument("--require-credentials", dest="require_credentials",
                       action="store_const", const=True, default=None,
                       help="Fold only records carrying a valid device credential "
                       "(`ipdp credentials issue`, docs/security.md).")
        p.add_argument("--records-per-device", dest="records_per_device", type=int,
                       default=None, help="Records one credential may contribute (default 1; "
                       "needs --require-credentials).")
        p.add_argument("--two-server", dest="two_server", action="store_true",
                       help="A two-server study: each device splits its record between this "
                       "service and a helper (docs/wire-format.md, \"Two-server records\"); "
                       "needs --helper-key, --helper-url and --helper-id.")
        p.add_argument("--helper-key", dest="helper_key", default=None, metavar="PATH",
                       help="The helper's public key: the .pub file of `ipdp keys generate "
                       "--helper` (or its base64 line).")
        p.add_argument("--helper-url", dest="helper_url", default=None, metavar="URL",
                       help="The helper's base URL, http(s)://HOST[:PORT].")
        p.add_argument("--helper-id", dest="helper_id", default=None, metavar="NAME",
                       help="The helper's name (letters, digits, . _ -).")
    p.add_argument("--loss", choices=["squared", "logistic"], default=None,
                   help="The model's loss (default squared); it also picks the error Step 8 "
                   "minimises (docs/privacy.md).")
    p.add_argument("--epsilon", type=float, help="Central ε of each model.")
    p.add_argument("--delta", type=float, help="Central δ of each model.")
    p.add_argument("--n", type=int, help="Records per round.")
    p.add_argument("--d", type=int, help="Dimension (set by --schema when given).")
    p.add_argument("--schema", default=None, metavar="PATH",
                   help="JSON file naming the features and target with their public ranges "
                   '({"features": [{"name": …, "min": …, "max": …}, …], "target": {"name": …, '
                   '"min": …, "max": …} or {"name": …, "classes": [A, B]}, "intercept": true}); '
                   "sets d, and the encoding every device applies (docs/privacy.md).")
    p.add_argument("--x-bound", dest="x_bound", type=float, default=None,
                   help="R: devices clip ‖x‖ ≤ R; λ and P are derived per loss (instead of "
                   "--lam/--p-bound).")
    p.add_argument("--y-bound", dest="y_bound", type=float, default=None,
                   help="Y: |y| ≤ Y, squared loss only (P = R·Y).")
    p.add_argument("--lam", type=float, default=None, help="λ: bound on ‖q‖² (default 1).")
    p.add_argument("--p-bound", dest="p_bound", type=float, default=None,
                   help="P: bound on ‖p‖ (default 1).")
    p.add_argument("--eta", type=float, default=None, help="η: bound on ‖w‖ (default 1).")
    p.add_argument("--mode", choices=["rigorous", "paper"], default=None,
                   help="Calibration: rigorous (default, proven in docs/privacy.md) or paper "
                   "(the paper's, NOT proven: for reproducing it only).")
    p.add_argument("--delta-in", dest="delta_in", type=float, default=None,
                   help="Δ_in ≥ 0, the trainer's ridge (default: chosen by the calibration in "
                        "rigorous mode, 1e-6 in paper mode, which needs > 0).")


STUDY_FIELDS = ("study_id", "loss", "max_rounds", "budget_epsilon", "budget_delta", "epsilon",
                "delta", "n", "d", "x_bound", "y_bound", "lam", "p_bound", "eta", "mode",
                "delta_in", "require_credentials", "records_per_device")


def study_from_args(args: argparse.Namespace, base: dict | None = None):
    """Build a Study from flags (over an optional file's fields); errors become UsageError."""
    from pydantic import ValidationError

    from ipdp.study import Study

    fields = dict(base or {})
    fields.update({k: getattr(args, k) for k in STUDY_FIELDS
                   if getattr(args, k, None) is not None})
    if getattr(args, "schema", None) is not None:
        fields["schema"] = load_json_file(args.schema, "schema")
    helper = {k: getattr(args, k, None) for k in ("helper_id", "helper_url", "helper_key")}
    if getattr(args, "two_server", False):
        missing = [f"--{k.replace('_', '-')}" for k, v in helper.items() if v is None]
        if missing:
            raise UsageError(f"--two-server needs {', '.join(missing)}")
        fields["two_server"] = helper | {"helper_key": helper_key_text(helper["helper_key"])}
    elif any(v is not None for v in helper.values()):
        raise UsageError("--helper-key, --helper-url and --helper-id go with --two-server")
    try:
        return Study(**fields)
    except ValidationError as exc:
        raise UsageError(format_validation_error(exc)) from None


def helper_key_text(value: str) -> str:
    """The helper's public key line: the file ``value`` names, or ``value`` itself when no such
    file exists (a base64 line; the study validates it)."""
    path = Path(value)
    if not path.is_file():
        return value.strip()
    try:
        return path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read helper key {value}: {exc}") from None


def format_validation_error(exc: ValidationError) -> str:
    """One line per problem: `parameter: message`, without pydantic's URLs."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "study"
        msg = err["msg"].removeprefix("Value error, ")
        lines.append(f"{loc}: {msg}")
    return "invalid study parameters:\n  " + "\n  ".join(lines)


def load_json_file(path: str, what: str) -> dict:
    """A JSON object from a file; an unreadable file or invalid JSON is a UsageError."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise UsageError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"{what} {path}: invalid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise UsageError(f"{what} {path}: expected a JSON object")
    return data


def load_study_file(path: str) -> dict:
    """Study parameters from a JSON (or YAML, with PyYAML) file."""
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


def add_redis_flag(p: argparse.ArgumentParser, help_text: str | None = None) -> None:
    """`--redis-url`, overriding IPDP_REDIS_URL."""
    p.add_argument("--redis-url", dest="redis_url", default=None, metavar="URL",
                   help=help_text or "Redis URL (overrides IPDP_REDIS_URL).")


def add_kafka_flag(p: argparse.ArgumentParser) -> None:
    """`--bootstrap`, overriding IPDP_KAFKA_BOOTSTRAP."""
    p.add_argument("--bootstrap", default=None, metavar="HOST:PORT[,...]",
                   help="Kafka bootstrap servers (overrides IPDP_KAFKA_BOOTSTRAP).")


def kafka_settings(args: argparse.Namespace) -> KafkaSettings:
    """KafkaSettings from the environment, with `--bootstrap` winning."""
    from ipdp.settings import KafkaSettings

    kafka = KafkaSettings()
    if getattr(args, "bootstrap", None):
        kafka = kafka.model_copy(update={"bootstrap": args.bootstrap})
    return kafka


def topic_settings() -> TopicSettings:
    """Topic names from the environment."""
    from ipdp.settings import TopicSettings

    return TopicSettings()


@contextlib.contextmanager
def redis_connection(args: argparse.Namespace) -> Iterator[Any]:
    """A checked Redis client from settings + `--redis-url`; every failure is an IpdpError."""
    import redis

    from ipdp.redis_io import check_redis, describe, redis_client
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
        except RedisAuthError:
            raise
        except redis.RedisError as exc:
            _user, where = describe(client)
            raise BackendUnavailable(f"cannot reach Redis at {where}: {exc}") from None
        try:
            yield client
        except redis.RedisError as exc:
            raise BackendUnavailable(f"Redis error: {exc}") from None
    finally:
        client.close()


@contextlib.contextmanager
def kafka_producer_for(args: argparse.Namespace) -> Iterator[Any]:
    """A producer from settings + `--bootstrap`; every Kafka failure is an IpdpError."""
    from kafka.errors import KafkaError

    from ipdp.kafka_io import kafka_producer

    kafka = kafka_settings(args)
    try:
        producer = kafka_producer(kafka, max_block_ms=15_000, bootstrap_timeout_ms=10_000)
    except KafkaError as exc:
        raise BackendUnavailable(f"cannot reach Kafka at {kafka.bootstrap}: {exc!r}") from None
    try:
        yield producer
    except KafkaError as exc:
        raise BackendUnavailable(f"Kafka error at {kafka.bootstrap}: {exc!r}") from None
    finally:
        producer.close(timeout=5)
