"""A real gateway (its app on granian's embeddable server, on a free loopback port, in a
thread) on the session's broker; tests/gateway/test_process.py runs `ipdp gateway` itself."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from gateway.app import create_app
from gateway.service import http1_settings
from gateway.settings import GatewaySettings
from ipdp.embedded.children import free_port
from ipdp.settings import KafkaSettings, TopicSettings
from producer.gateway_client import GatewayClient
from tests.granian_thread import served


@contextmanager
def running_gateway(kafka: KafkaSettings, topics: TopicSettings, ready: bool = True,
                    **settings) -> Iterator[str]:
    """Serve the gateway on 127.0.0.1 until the block ends; yields its base URL.

    Waits for /readyz (Kafka connected, studies topic read) unless ``ready`` is False.
    """
    # One client address plays every device here: it is a relay unless a test says otherwise.
    gs = GatewaySettings(host="127.0.0.1", port=free_port(),
                         **{"relay_addresses": "127.0.0.1", **settings})
    with served(create_app(gs, kafka, topics), gs.host, gs.port, http1_settings(gs)) as url:
        with GatewayClient(url) as client:
            client.wait_ready(30, "/readyz" if ready else "/healthz")
        yield url


@pytest.fixture
def gateway_url(kafka_settings, topics) -> Iterator[str]:
    with running_gateway(kafka_settings, topics) as url:
        yield url


@pytest.fixture
def connect() -> Iterator[Callable[..., socket.socket]]:
    """``connect(url, source="127.0.0.1")`` opens a raw TCP connection to a server's base URL
    from the address ``source``; every connection the test opened is closed after it."""
    opened: list[socket.socket] = []

    def open_connection(url: str, source: str = "127.0.0.1") -> socket.socket:
        host, port = url.removeprefix("http://").split(":")
        opened.append(socket.create_connection((host, int(port)), timeout=10,
                                               source_address=(source, 0)))
        return opened[-1]

    yield open_connection
    for sock in opened:
        sock.close()
