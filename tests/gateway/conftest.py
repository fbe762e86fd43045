"""A real gateway (uvicorn on a free loopback port, in a thread) on the session's broker."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from gateway.app import create_app
from gateway.service import uvicorn_options
from gateway.settings import GatewaySettings
from ipdp.embedded.children import free_port
from ipdp.settings import KafkaSettings, TopicSettings
from producer.gateway_client import GatewayClient


@contextmanager
def running_gateway(kafka: KafkaSettings, topics: TopicSettings, ready: bool = True,
                    **settings) -> Iterator[str]:
    """Serve the gateway on 127.0.0.1 until the block ends; yields its base URL.

    Waits for /readyz (Kafka connected, studies topic read) unless ``ready`` is False.
    """
    import uvicorn

    # One client address plays every device here: it is a relay unless a test says otherwise.
    gs = GatewaySettings(host="127.0.0.1", port=free_port(),
                         **{"relay_addresses": "127.0.0.1", **settings})
    app = create_app(gs, kafka, topics)
    server = uvicorn.Server(uvicorn.Config(app, **uvicorn_options(gs)))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{gs.port}"
    try:
        with GatewayClient(url) as client:
            client.wait_ready(30, "/readyz" if ready else "/healthz")
    except BaseException:
        server.should_exit = True
        thread.join(timeout=30)
        raise
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture
def gateway_url(kafka_settings, topics) -> Iterator[str]:
    with running_gateway(kafka_settings, topics) as url:
        yield url
