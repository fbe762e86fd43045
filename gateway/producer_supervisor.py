"""One Kafka producer process per gateway worker, started again whenever it exits."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from gateway.producer_process import ProducerExited, ProducerProcess
from gateway.settings import GatewaySettings
from ipdp.settings import KafkaSettings

log = logging.getLogger(__name__)

__all__ = ["ProducerSupervisor"]

#: How long a new producer process may take to connect before it is killed and started again.
_PRODUCER_START_S = 60.0
#: The first and the longest wait before starting another process after one failed to connect.
_BACKOFF_S = (0.5, 10.0)


class ProducerSupervisor:
    """Keeps a connected :class:`ProducerProcess` in :attr:`producer` (None while there is none).

    ``on_connected`` runs each time a process has connected; ``on_exit`` each time one exited
    (the requests waiting on it get 503, and the gateway is not ready for a while).
    """

    def __init__(self, settings: GatewaySettings, kafka: KafkaSettings, topic: str, *,
                 on_connected: Callable[[], None], on_exit: Callable[[], None]) -> None:
        self.kafka, self.topic = kafka, topic
        self.options = producer_options(settings)
        self.on_connected, self.on_exit = on_connected, on_exit
        self.producer: ProducerProcess | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Start the first process in the background."""
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        """Start no other process, and close the current one (it sends what it holds)."""
        if self._task is not None:
            self._task.cancel()
        if self.producer is not None:
            await self.producer.close(10)

    async def _run(self) -> None:
        """Start a producer process, and another whenever it exits, backing off while it cannot
        connect."""
        delay = _BACKOFF_S[0]
        while True:
            try:
                producer = await ProducerProcess.start(self.kafka, self.topic, self.options,
                                                       timeout_s=_PRODUCER_START_S)
            except (TimeoutError, ProducerExited, OSError) as exc:
                log.warning("gateway: no Kafka producer for %s yet: %s", self.kafka.bootstrap,
                            exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, _BACKOFF_S[1])
                continue
            self.producer, delay = producer, _BACKOFF_S[0]
            log.info("gateway: Kafka producer connected to %s", self.kafka.bootstrap)
            self.on_connected()
            code = await asyncio.shield(producer.exited)  # stop() cancels this task, not it
            self.producer = None
            self.on_exit()
            log.warning("gateway: the Kafka producer process exited with code %s; starting "
                        "another", code)


def producer_options(settings: GatewaySettings) -> dict:
    """The kafka-python producer options of the gateway's producer process."""
    timeout_ms = int(settings.kafka_timeout_s * 1000)
    return {
        "delivery_timeout_ms": timeout_ms,
        "request_timeout_ms": max(1000, timeout_ms - 100),
        "max_block_ms": min(timeout_ms, 2000),
        # The group commit decides when a container goes: send each one at once.
        "linger_ms": 0,
        # kafka-python's own metrics (sensors updated on every produce request and response)
        # are read by nothing here: ipdp's are Prometheus'. Off, its I/O thread spends less CPU
        # per container.
        "metrics_enabled": False,
        "max_request_size": max(settings.max_message_bytes + 1024, 1 << 20),
    }
