"""`ipdp helper run`: the helper's ASGI app (helper.app) on granian, one worker.

Before it listens it checks what it cannot run without: the helper's key file, the leader's
token, at least one pinned study-owner key (it refuses unsigned studies) and its own Redis, which
must not be a leader's.
SIGTERM or SIGINT stops accepting, lets the requests in progress be answered and exits 0.
TLS is the edge's, as for the gateway (docs/operations.md, "The helper").
"""

from __future__ import annotations

import logging

from helper.settings import HelperSettings
from helper.store import HelperStore
from ipdp import state
from ipdp.errors import ConfigurationError
from ipdp.redis_io import check_redis, describe, redis_client
from ipdp.sealing import HelperKey, load_helper_key
from ipdp.settings import RedisSettings, TrustSettings
from ipdp.signing import TrustedKeys

log = logging.getLogger(__name__)

__all__ = ["cmd_run", "load_service", "serve"]

APP_FACTORY = "helper.app:service_app"


def load_service(settings: HelperSettings) -> tuple[HelperSettings, HelperStore, HelperKey,
                                                     TrustedKeys, TrustedKeys]:
    """The settings, store, key, trusted study keys and trusted credential issuer keys
    (IPDP_TRUSTED_CREDENTIAL_KEYS) the app runs on; ConfigurationError names what is
    missing."""
    if not settings.key_file:
        raise ConfigurationError("IPDP_HELPER_KEY_FILE is required: the helper's PREFIX.key "
                                 "(`ipdp keys generate --helper --out PREFIX`)")
    if settings.leader_token is None or not settings.leader_token.get_secret_value():
        raise ConfigurationError("IPDP_HELPER_LEADER_TOKEN (or _FILE) is required: the bearer "
                                 "token the leader's aggregator presents")
    trust = TrustSettings()
    trusted = trust.study_keys()
    if not trusted:
        raise ConfigurationError("IPDP_TRUSTED_STUDY_KEYS is required: the helper folds only "
                                 "for studies signed by an owner key it pins")
    key = load_helper_key(settings.key_file)
    # Built from the helper's own settings only (model_construct reads no environment): the
    # leader's IPDP_REDIS_* name another domain's Redis.
    client = redis_client(RedisSettings.model_construct(url=settings.redis_url,
                                                        password=settings.redis_password))
    check_redis(client)
    if client.exists(state.STUDY_HASHES, state.ROUNDS_STREAM):
        # One Redis for both servers would put both shares of every record in one domain.
        raise ConfigurationError(f"IPDP_HELPER_REDIS_URL points at a leader's Redis (it holds "
                                 f"{state.STUDY_HASHES}): the helper needs its own")
    window = settings.window()
    store = HelperStore(client, job_ttl_s=settings.replay_window_s + settings.max_future_skew_s,
                        forget_after_ms=window.replay_window_ms + window.max_future_skew_ms)
    return settings, store, key, trusted, trust.credential_keys()


def serve(settings: HelperSettings) -> None:
    """Check the configuration, then serve in the foreground until SIGINT/SIGTERM."""
    from granian import Granian
    from granian.constants import HTTPModes, Interfaces, Loops
    from granian.log import LogLevels

    _, store, key, trusted, credential_keys = load_service(settings)
    user, where = describe(store.r)
    store.r.close()
    log.info("helper: http://%s:%d, Redis %s as %s, public key %s, %d trusted study key(s), "
             "%d trusted credential issuer key(s)", settings.host, settings.port, where, user,
             key.public_b64, len(trusted), len(credential_keys))
    Granian(APP_FACTORY, factory=True, address=settings.host, port=settings.port,
            interface=Interfaces.ASGI, workers=1, loop=Loops.uvloop, http=HTTPModes.http1,
            websockets=False, log_level=LogLevels.warning, log_access=False).serve()


def cmd_run(args) -> int:
    """Entry point of `ipdp helper run` (flags override IPDP_HELPER_HOST and _PORT)."""
    overrides = {k: getattr(args, k) for k in ("host", "port") if getattr(args, k, None)
                 is not None}
    serve(HelperSettings(**overrides))
    return 0
