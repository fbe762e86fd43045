"""A real gateway (its own server on a free loopback port, in a thread) on the session's broker."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from gateway.app import create_app
from gateway.service import listen, new_event_loop, serve_app
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
    # One client address plays every device here: it is a relay unless a test says otherwise.
    gs = GatewaySettings(host="127.0.0.1", port=free_port(),
                         **{"relay_addresses": "127.0.0.1", **settings})
    app = create_app(gs, kafka, topics)
    sock = listen(gs)
    loop = new_event_loop()
    stop = asyncio.Event()
    served = loop.create_task(serve_app(app, gs, sock, stop))
    thread = threading.Thread(target=loop.run_until_complete, args=(served,), daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{gs.port}"
    try:
        with GatewayClient(url) as client:
            client.wait_ready(30, "/readyz" if ready else "/healthz")
        yield url
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=30)
        sock.close()
        loop.close()


@pytest.fixture
def gateway_url(kafka_settings, topics) -> Iterator[str]:
    with running_gateway(kafka_settings, topics) as url:
        yield url
