"""The gateway worker's Kafka producer, in a process of its own.

kafka-python's producer sends from an I/O thread beside the caller. In a gateway worker that
thread shares the GIL with an event loop that is busy with requests, and every container costs
it a wake-up to send and one for the acknowledgement, each waiting for the GIL: there it spent
far more CPU per container than the same producer spends alone, and it held back the device
requests the worker could serve (docs/architecture.md).
So each worker starts a child, ``python -m gateway.producer_process``, that owns the producer;
the worker writes each container to the child's stdin and reads the acknowledgements from its
stdout on the event loop, with no thread and no GIL of its own to share.

**The pipe.** Parent to child, first one line of JSON: the Kafka settings, the topic and the
producer options (over the pipe rather than argv, as they may hold a SASL password). Then one
frame per container, every integer little-endian::

    u32 size of the rest, u64 sequence number, u16 key size, key, u16 header count,
    per header (u16 name size, name, u32 value size, value), then the message value

Child to parent, one frame per container, in the order Kafka settles them, and one before the
first to say the producer is connected::

    u64 sequence number, u8 status (0 acknowledged, 1 refused, 2 connected),
    u16 size, what Kafka refused with (the exception's class name, UTF-8)

The child settles every frame once. When its stdin closes (the worker stops, or dies) it
flushes what it holds and exits; when the child exits, the worker refuses whatever it was still
waiting for (each request a 503) and starts another.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import struct
import sys
import threading

from ipdp.settings import KafkaSettings

__all__ = ["ProducerExited", "ProducerProcess", "ProducerRefused", "main"]

log = logging.getLogger(__name__)

_FRAME_SIZE = struct.Struct("<I")
_SEQ_KEY = struct.Struct("<QH")
_COUNT = struct.Struct("<H")
_NAME = struct.Struct("<H")
_VALUE = struct.Struct("<I")
_ACK = struct.Struct("<QBH")

ACKNOWLEDGED, REFUSED, CONNECTED = 0, 1, 2


class ProducerRefused(Exception):
    """Kafka refused a container, or did not acknowledge it in time (the child's reason)."""


class ProducerExited(ConnectionError):
    """The producer process is gone; nothing more is sent through it."""


def _frame(seq: int, key: bytes, value: bytes, headers: list[tuple[str, bytes]]) -> bytes:
    parts = [b"", _SEQ_KEY.pack(seq, len(key)), key, _COUNT.pack(len(headers))]
    for name, header in headers:
        raw = name.encode()
        parts += (_NAME.pack(len(raw)), raw, _VALUE.pack(len(header)), header)
    parts.append(value)
    parts[0] = _FRAME_SIZE.pack(sum(map(len, parts)))
    return b"".join(parts)


def _unframe(body: bytes) -> tuple[int, bytes, list[tuple[str, bytes]], bytes]:
    seq, key_size = _SEQ_KEY.unpack_from(body)
    at = _SEQ_KEY.size
    key = body[at:at + key_size]
    at += key_size
    (count,) = _COUNT.unpack_from(body, at)
    at += _COUNT.size
    headers = []
    for _ in range(count):
        (size,) = _NAME.unpack_from(body, at)
        at += _NAME.size
        name = body[at:at + size].decode()
        at += size
        (size,) = _VALUE.unpack_from(body, at)
        at += _VALUE.size
        headers.append((name, body[at:at + size]))
        at += size
    return seq, key, headers, body[at:]


class ProducerProcess(asyncio.SubprocessProtocol):
    """The worker's side of the pipe: :meth:`send` a container, get a future of its fate."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.connected: asyncio.Future = loop.create_future()
        self.exited: asyncio.Future = loop.create_future()
        self._pending: dict[int, asyncio.Future] = {}
        self._seq = 0
        self._acks = bytearray()
        self._transport: asyncio.SubprocessTransport | None = None
        self._stdin: asyncio.WriteTransport | None = None

    @classmethod
    async def start(cls, kafka: KafkaSettings, topic: str, options: dict,
                    timeout_s: float) -> ProducerProcess:
        """Start a child with a producer for ``topic`` (kafka-python ``options``) and return
        once it is connected; ProducerExited if it exits first, TimeoutError after
        ``timeout_s``."""
        loop = asyncio.get_running_loop()
        transport, process = await loop.subprocess_exec(
            lambda: cls(loop), sys.executable, "-m", "gateway.producer_process",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=None)
        settings = kafka.model_dump()
        if kafka.sasl_password is not None:
            settings["sasl_password"] = kafka.sasl_password.get_secret_value()
        process._stdin.write(json.dumps(
            {"kafka": settings, "topic": topic, "options": options}).encode() + b"\n")
        try:
            await asyncio.wait_for(asyncio.shield(process.connected), timeout_s)
        except BaseException:
            if not process.exited.done():
                transport.kill()
            raise
        return process

    def connection_made(self, transport: asyncio.SubprocessTransport) -> None:  # type: ignore[override]
        self._transport = transport
        self._stdin = transport.get_pipe_transport(0)  # type: ignore[assignment]

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        acks = self._acks
        acks += data
        at = 0
        while len(acks) - at >= _ACK.size:
            seq, status, size = _ACK.unpack_from(acks, at)
            end = at + _ACK.size + size
            if len(acks) < end:
                break
            reason = acks[at + _ACK.size:end].decode()
            at = end
            if status == CONNECTED:
                if not self.connected.done():
                    self.connected.set_result(None)
                continue
            waiter = self._pending.pop(seq, None)
            if waiter is None or waiter.done():
                continue
            if status == ACKNOWLEDGED:
                waiter.set_result(None)
            else:
                waiter.set_exception(ProducerRefused(reason))
        del acks[:at]

    def process_exited(self) -> None:
        code = self._transport.get_returncode() if self._transport else None
        gone = ProducerExited(f"the Kafka producer process exited with code {code}")
        pending, self._pending = self._pending, {}
        for waiter in pending.values():
            if not waiter.done():
                waiter.set_exception(gone)
                waiter.exception()  # retrieved: the group commit reads its own copy
        if not self.connected.done():
            self.connected.set_exception(gone)
            self.connected.exception()
        if not self.exited.done():
            self.exited.set_result(code)

    def connection_lost(self, exc: Exception | None) -> None:
        # The child has exited and its pipes are read to the end (its last acknowledgements
        # included): the transport has nothing left to carry, so it is closed, not left to the
        # collector.
        if self._transport is not None:
            self._transport.close()

    def send(self, key: bytes, value: bytes, headers: list[tuple[str, bytes]]) -> asyncio.Future:
        """Hand one message to the child: a future that is done when Kafka acknowledged it, or
        fails with ProducerRefused (or ProducerExited)."""
        if self.exited.done() or self._stdin is None or self._stdin.is_closing():
            raise ProducerExited("the Kafka producer process has exited")
        self._seq += 1
        waiter = self.loop.create_future()
        self._pending[self._seq] = waiter
        self._stdin.write(_frame(self._seq, key, value, headers))
        return waiter

    async def close(self, timeout_s: float) -> None:
        """Let the child flush what it holds and exit (killed after ``timeout_s``)."""
        if self._stdin is not None and not self._stdin.is_closing():
            self._stdin.close()
        try:
            await asyncio.wait_for(asyncio.shield(self.exited), timeout_s)
        except TimeoutError:
            log.warning("gateway: the Kafka producer process did not exit in %g s; killed",
                        timeout_s)
            if not self.exited.done():
                self._transport.kill()
            await self.exited


def _read(stream, size: int) -> bytes | None:
    data = stream.read(size)
    return data if len(data) == size else None


def main() -> int:
    """The child: read the settings line, connect, then produce frames until stdin closes."""
    from ipdp.kafka_io import kafka_producer

    stdin, out = sys.stdin.buffer, sys.stdout.buffer.fileno()
    lock = threading.Lock()

    def answer(seq: int, status: int, reason: str = "") -> None:
        raw = reason.encode()[:1000]
        frame = memoryview(_ACK.pack(seq, status, len(raw)) + raw)
        with lock:  # acknowledgements come from kafka-python's I/O thread
            while frame:
                frame = frame[os.write(out, frame):]

    config = json.loads(stdin.readline() or "null")
    if config is None:
        return 0
    kafka = KafkaSettings(**config["kafka"])
    try:
        producer = kafka_producer(kafka, **config["options"])
    except Exception as exc:  # noqa: BLE001 - the worker retries; one line, no traceback
        log.warning("gateway: cannot connect to Kafka at %s: %r", kafka.bootstrap, exc)
        return 3
    topic = config["topic"]
    answer(0, CONNECTED)
    while (head := _read(stdin, _FRAME_SIZE.size)) is not None:
        body = _read(stdin, _FRAME_SIZE.unpack(head)[0])
        if body is None:
            break
        seq, key, headers, value = _unframe(body)
        try:
            sent = producer.send(topic, key=key, value=value, headers=headers)
        except Exception as exc:  # noqa: BLE001 - any failure to hand over is a refusal
            answer(seq, REFUSED, type(exc).__name__)
            continue
        sent.add_callback(lambda _, s=seq: answer(s, ACKNOWLEDGED))
        sent.add_errback(lambda exc, s=seq: answer(s, REFUSED, type(exc).__name__))
    producer.close(10)  # sends what it holds first
    return 0


if __name__ == "__main__":
    # Ctrl-C in a terminal, or a service manager's SIGTERM to every process of the gateway,
    # reaches this child too: it ignores them and stops when the worker closes its stdin,
    # after the worker has drained its requests, or at once if the worker is gone.
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=os.environ.get("IPDP_LOG_LEVEL", "WARNING"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.exit(main())
