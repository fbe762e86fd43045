"""Client factories: every process builds its Redis and Kafka clients here, from settings.

All Kafka clients start from :meth:`KafkaSettings.client_kwargs`, so SASL/TLS settings pass
through unchanged; keyword overrides win over the defaults below.
"""

from __future__ import annotations

from typing import Any

import redis
from kafka import KafkaConsumer, KafkaProducer
from kafka.admin import KafkaAdminClient

from ipdp.settings import KafkaSettings, RedisSettings

__all__ = [
    "CONSUMER_DEFAULTS",
    "PRODUCER_DEFAULTS",
    "RedisAuthError",
    "check_redis",
    "kafka_admin",
    "kafka_consumer",
    "kafka_producer",
    "redis_client",
]

MiB = 1 << 20

PRODUCER_DEFAULTS: dict[str, Any] = {
    "acks": "all",
    "linger_ms": 5,
    "batch_size": 1 * MiB,
    "max_request_size": 4 * MiB,
    # Bounded by delivery_timeout_ms, like the Java client (kafka-python's default is inf).
    "retries": 2_147_483_647,
    "delivery_timeout_ms": 120_000,
    "retry_backoff_ms": 100,
    "request_timeout_ms": 30_000,
}

CONSUMER_DEFAULTS: dict[str, Any] = {
    "enable_auto_commit": False,
    "auto_offset_reset": "earliest",
    # Fast group joins: ~3 s to a first assignment instead of ~23 s with kafka-python defaults.
    "session_timeout_ms": 6_000,
    "heartbeat_interval_ms": 500,
    "max_poll_records": 5_000,
    "max_poll_interval_ms": 300_000,
    "fetch_min_bytes": 1,
    "fetch_max_wait_ms": 250,
    "fetch_max_bytes": 32 * MiB,
    "max_partition_fetch_bytes": 4 * MiB,  # at least the producer's max_request_size
}


# --------------------------------------------------------------------------- redis


class RedisAuthError(RuntimeError):
    """Redis refused our credentials: a configuration error, never worth a retry."""


def redis_client(s: RedisSettings) -> redis.Redis:
    """A ``redis.Redis`` for ``s.url``; ``s.username``/``s.password`` override the URL's.

    Bytes in, bytes out (``decode_responses=False``). Nothing is sent until the first
    command: call :func:`check_redis` to fail early with a readable message.
    """
    pool = redis.ConnectionPool.from_url(
        s.url,
        decode_responses=False,
        socket_timeout=s.socket_timeout_s,
        socket_connect_timeout=s.socket_timeout_s,
        socket_keepalive=True,
        health_check_interval=30,
    )
    # from_url lets credentials in the URL win over keyword arguments; settings win here.
    if s.username is not None:
        pool.connection_kwargs["username"] = s.username
    if s.password is not None:
        pool.connection_kwargs["password"] = s.password.get_secret_value()
    return redis.Redis(connection_pool=pool)


def _describe(client: redis.Redis) -> tuple[str, str]:
    kw = client.connection_pool.connection_kwargs
    user = kw.get("username") or "default"
    if kw.get("path"):
        where = str(kw["path"])
    else:
        where = f"{kw.get('host', 'localhost')}:{kw.get('port', 6379)}"
    return user, where


def check_redis(client: redis.Redis) -> None:
    """PING; a rejected login becomes ``RedisAuthError("Redis authentication failed ...")``.

    Connection errors (server down, wrong port) propagate unchanged as
    ``redis.ConnectionError`` so callers can retry them.
    """
    try:
        client.ping()
    except (
        redis.AuthenticationError,
        redis.exceptions.AuthenticationWrongNumberOfArgsError,
    ) as exc:
        user, where = _describe(client)
        raise RedisAuthError(
            f"Redis authentication failed for user {user} at {where}: {exc}"
        ) from exc
    except redis.ResponseError as exc:
        msg = str(exc)
        if msg.startswith(("NOAUTH", "WRONGPASS")) or "NOAUTH" in msg or "WRONGPASS" in msg:
            user, where = _describe(client)
            raise RedisAuthError(
                f"Redis authentication failed for user {user} at {where}: {msg}"
            ) from exc
        raise


# --------------------------------------------------------------------------- kafka


def kafka_producer(s: KafkaSettings, **overrides: Any) -> KafkaProducer:
    """A producer with :data:`PRODUCER_DEFAULTS` (acks=all, idempotent, 1 MiB batches)."""
    return KafkaProducer(**{**s.client_kwargs(), **PRODUCER_DEFAULTS, **overrides})


def kafka_consumer(s: KafkaSettings, *topics: str, **overrides: Any) -> KafkaConsumer:
    """A consumer with :data:`CONSUMER_DEFAULTS` (manual commits, earliest, fast group joins).

    Pass ``group_id=...`` for a consumer group; topics may be given positionally or subscribed
    later.
    """
    return KafkaConsumer(*topics, **{**s.client_kwargs(), **CONSUMER_DEFAULTS, **overrides})


def kafka_admin(s: KafkaSettings, **overrides: Any) -> KafkaAdminClient:
    """An admin client (topic creation, describe_configs, groups)."""
    return KafkaAdminClient(**{**s.client_kwargs(), "request_timeout_ms": 30_000, **overrides})
