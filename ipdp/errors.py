"""One error root for every role: what went wrong, in words a user can act on.

Roles raise these; only the CLI (ipdp/cli) turns them into a message and an exit status, so a
library user catches :class:`IpdpError` and a command-line user sees one line, never a traceback.
"""

from __future__ import annotations


class IpdpError(Exception):
    """Root of every error ipdp raises on purpose. ``exit_code`` is what the CLI returns."""

    exit_code = 2


class ConfigurationError(IpdpError):
    """Bad parameters, settings or files: fix the input and run again."""


class CalibrationError(ConfigurationError, ValueError):
    """Parameters for which the chosen mode proves no guarantee; the message names the bound."""


class BackendUnavailable(IpdpError):
    """Kafka or Redis could not be reached or refused an operation."""


class RedisAuthError(ConfigurationError, RuntimeError):
    """Redis refused our credentials: a configuration error, never worth a retry."""


class StudyError(IpdpError):
    """Something about a study: unknown, closed, or a conflicting definition."""


class UnknownStudy(StudyError, LookupError):
    """No study with this id (or wire hash)."""


class StudyClosed(StudyError):
    """The study no longer accepts records."""


class StudyExists(StudyError, ValueError):
    """The id (or the wire hash) is taken by a study with different parameters."""


class StudyInUse(StudyError):
    """The study has folded a record or published a model, so it can no longer be deleted."""


class TooManyRecords(StudyError, ValueError):
    """A device offered more records to one round than its Contributor allows (the unit of
    privacy is one record per device per round; more cost group privacy, docs/accounting.md)."""


class ContributionError(IpdpError):
    """Records were handed to Kafka, or POSTed to the gateway, but not accepted."""


class RecordRefused(ContributionError):
    """The gateway refused a device's record: ``reason`` is its machine reason (a
    :class:`ipdp.wire.RejectReason` value, or ``unreachable`` when no answer came), ``status``
    its HTTP status (None when unreachable). A refused unknown or closed study is raised as
    :class:`UnknownStudy` or :class:`StudyClosed` instead, as the Kafka path raises them."""

    def __init__(self, message: str, reason: str, status: int | None) -> None:
        super().__init__(message)
        self.reason = reason
        self.status = status


class SignatureError(IpdpError):
    """A signed study or model whose signature is missing, not by a trusted key, or wrong."""


#: Why a topic value cannot be read: the ``reason`` of :class:`MalformedValue`, and
#: ``unexpected`` for any other exception (the ``reason`` label of
#: ipdp_topic_values_malformed_total, docs/operations.md).
MALFORMED_REASONS = ("too_large", "not_utf8", "not_json", "too_deep", "not_object", "number",
                     "invalid", "unexpected")


class MalformedValue(ConfigurationError, ValueError):
    """A studies-topic or models-topic value (or a stored envelope) that cannot be read.

    ``reason`` is one word from a short fixed list (a metric label); the message never quotes
    the value, which whoever can write the topic controls."""

    def __init__(self, reason: str, message: str) -> None:
        if reason not in MALFORMED_REASONS:
            raise ValueError(f"{reason!r} is not one of MALFORMED_REASONS")
        super().__init__(message)
        self.reason = reason
