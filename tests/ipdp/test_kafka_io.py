"""Reading a topic to its end: exact end offsets need no quiet poll, tansu's do."""

from __future__ import annotations

from ipdp.kafka_io import assign_all, kafka_consumer, kafka_producer, read_to_end


def _read_all(settings, topic: str) -> tuple[int, list[int]]:
    """(records read, records returned by each poll)."""
    consumer = kafka_consumer(settings, group_id=None)
    polls: list[int] = []
    poll = consumer.poll

    def counted(*args, **kwargs):
        got = poll(*args, **kwargs)
        polls.append(sum(len(v) for v in got.values()))
        return got

    consumer.poll = counted
    try:
        tps = assign_all(consumer, topic, 30)
        consumer.seek_to_beginning(*tps)
        return sum(1 for _ in read_to_end(consumer, tps, timeout_s=30)), polls
    finally:
        consumer.close()


def test_a_reader_stops_at_exact_end_offsets_and_waits_for_a_quiet_poll_otherwise(
        kafka_settings, topics):
    producer = kafka_producer(kafka_settings, linger_ms=0)
    for i in range(5):  # one record per request: tansu's end offsets are exact for these
        producer.send(topics.models, value=b"%d" % i).get(timeout=30)
    producer.close()
    assert not kafka_settings.end_offsets_exact  # the embedded runtime's broker
    read, polls = _read_all(kafka_settings, topics.models)
    assert read == 5 and polls[-1] == 0  # stopped after an empty (quiet) poll
    exact = kafka_settings.model_copy(update={"end_offsets_exact": True})
    read, polls = _read_all(exact, topics.models)
    assert read == 5 and polls[-1] > 0  # stopped as soon as it reached the end offsets
