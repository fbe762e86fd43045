"""Reading values that whoever can write the studies or models topic controls.

A reader (a device, the gateway, a model subscriber; the aggregator and the trainer reading a
stored envelope) must survive any value. :func:`load_json_object` is the one door such bytes go
through before anything looks inside: the size is capped before parsing, the bytes must be
strict UTF-8 JSON whose top level is an object, nesting deeper than the interpreter can parse is
refused (``json`` raises RecursionError there), and so is any number that is not finite
(``NaN``, ``Infinity``, or ``1e999``, which ``float`` reads as infinity). Each failure is a
:class:`~ipdp.errors.MalformedValue` with a one-word reason.

:func:`skip_malformed` is what every reader does with a value it cannot use: count it
(``ipdp_topic_values_malformed_total``), log it once with its topic, partition and offset (never
its content) and go on.
"""

from __future__ import annotations

import json
import logging
import math

from pydantic import ValidationError

from ipdp.errors import MalformedValue

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_MAX_VALUE_BYTES", "invalid_fields", "load_json_object", "skip_malformed"]

#: The default of ``IPDP_TOPIC_MAX_VALUE_BYTES``: a study is a few hundred bytes, a model of
#: d = 4096 about 100 KiB.
DEFAULT_MAX_VALUE_BYTES = 1 << 20


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise MalformedValue("number", "a number is not finite in double precision")
    return value


def _no_constant(name: str) -> float:
    raise MalformedValue("number", f"{name} is not a number JSON allows")


def load_json_object(value: bytes | str, what: str,
                     max_bytes: int = DEFAULT_MAX_VALUE_BYTES) -> dict:
    """The JSON object in ``value``; raises :class:`MalformedValue` for anything else."""
    if isinstance(value, str):
        raw = value.encode("utf-8", "surrogatepass")
    elif isinstance(value, bytes | bytearray | memoryview):
        raw = bytes(value)
    else:
        raise MalformedValue("not_json", f"{what} is a {type(value).__name__}, not bytes")
    if len(raw) > max_bytes:
        raise MalformedValue("too_large", f"{what} has {len(raw)} bytes, more than the "
                             f"{max_bytes} a reader parses (IPDP_TOPIC_MAX_VALUE_BYTES)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MalformedValue("not_utf8", f"{what} is not UTF-8 (byte {exc.start})") from None
    try:
        obj = json.loads(text, parse_float=_finite_float, parse_constant=_no_constant)
    except RecursionError:
        raise MalformedValue("too_deep", f"{what} is nested too deeply to parse") from None
    except MalformedValue as exc:
        raise MalformedValue(exc.reason, f"{what}: {exc}") from None
    except ValueError as exc:  # JSONDecodeError, or an integer of more than 4300 digits
        where = f" at line {exc.lineno} column {exc.colno}" if hasattr(exc, "lineno") else ""
        raise MalformedValue("not_json", f"{what} is not JSON{where}") from None
    if not isinstance(obj, dict):
        raise MalformedValue("not_object", f"{what} is a JSON {type(obj).__name__}, not an "
                             "object")
    return obj


def invalid_fields(what: str, exc: ValidationError) -> MalformedValue:
    """A pydantic error as a MalformedValue naming the fields and error types, not the input.

    A ``value_error`` keeps its message (cut at 200 characters): those come from the study's own
    validators, say why ("not proven at these parameters") and quote parameters, not the value."""
    fields = "; ".join(f"{'.'.join(map(str, e['loc'])) or '(value)'}: {e['type']}"
                       + (f" ({e['msg'][:200]})" if e["type"] == "value_error" else "")
                       for e in exc.errors(include_url=False, include_context=False,
                                           include_input=False)[:5])
    return MalformedValue("invalid", f"{what} has invalid fields ({fields})")


def skip_malformed(topic: str, reader: str, message, exc: BaseException) -> None:
    """Count and log (with topic, partition and offset) a value the reader skips."""
    reason = exc.reason if isinstance(exc, MalformedValue) else "unexpected"
    # Imported here: ipdp.study parses with this module, and `ipdp calibrate` needs no metrics.
    from ipdp.metrics import TOPIC_VALUES_MALFORMED

    TOPIC_VALUES_MALFORMED.labels(topic, reader, reason).inc()
    detail = str(exc) if isinstance(exc, MalformedValue) else type(exc).__name__
    log.warning("%s: skipping malformed value of %s[%s] at offset %s: %s", reader,
                message.topic, message.partition, message.offset, detail)
