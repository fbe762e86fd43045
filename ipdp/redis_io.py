"""Redis clients, built from settings in one place, with a readable authentication error."""

from __future__ import annotations

import redis

from ipdp.errors import ConfigurationError, RedisAuthError
from ipdp.settings import RedisSettings

__all__ = ["check_redis", "describe", "redis_client"]


def redis_client(s: RedisSettings) -> redis.Redis:
    """A ``redis.Redis`` for ``s.url`` (a ``redis.RedisCluster`` when ``s.cluster``);
    ``s.username``/``s.password`` override the URL's.

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
    if s.url.startswith("rediss://"):
        # Certificates are always verified (redis-py's default for rediss://); these say whom
        # to trust and who we are.
        for name in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"):
            if getattr(s, name):
                pool.connection_kwargs[name] = getattr(s, name)
    elif s.ssl_ca_certs or s.ssl_certfile or s.ssl_keyfile:
        raise ConfigurationError(
            f"IPDP_REDIS_SSL_* files are set but IPDP_REDIS_URL={_without_password(s.url)} "
            "is not a rediss:// URL: nothing would be encrypted")
    # from_url lets credentials in the URL win over keyword arguments; settings win here.
    if s.username is not None:
        pool.connection_kwargs["username"] = s.username
    if s.password is not None:
        pool.connection_kwargs["password"] = s.password.get_secret_value()
    if s.cluster:
        kw = dict(pool.connection_kwargs)
        if kw.get("db", 0):
            raise ConfigurationError("a Redis Cluster has only database 0: drop the /N from "
                                     f"IPDP_REDIS_URL={_without_password(s.url)}")
        for name in ("db", "connection_class", "health_check_interval"):
            kw.pop(name, None)
        if s.url.startswith("rediss://"):
            kw["ssl"] = True
        return redis.RedisCluster(**kw)
    # The client owns its pool: closing it, or dropping the last reference to it, closes its
    # connections rather than leaving their sockets to the garbage collector.
    return redis.Redis.from_pool(pool)


def _without_password(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    return f"{scheme}{sep}{rest.rpartition('@')[2]}" if sep else url


def describe(client: redis.Redis) -> tuple[str, str]:
    """(user, where) of a client, for messages: never the password."""
    if isinstance(client, redis.RedisCluster):
        node = client.get_default_node()
        kw = node.redis_connection.connection_pool.connection_kwargs if node else {}
    else:
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
        user, where = describe(client)
        raise RedisAuthError(
            f"Redis authentication failed for user {user} at {where}: {exc}"
        ) from exc
    except redis.ResponseError as exc:
        msg = str(exc)
        if "NOAUTH" in msg or "WRONGPASS" in msg:
            user, where = describe(client)
            raise RedisAuthError(
                f"Redis authentication failed for user {user} at {where}: {msg}"
            ) from exc
        raise
