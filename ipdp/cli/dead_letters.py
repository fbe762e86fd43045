"""`ipdp dead-letters`: the records the aggregators refused, one line each, with the reason."""

from __future__ import annotations

import argparse
import base64
import json
import sys

from ipdp.cli.common import add_kafka_flag, kafka_settings, topic_settings
from ipdp.errors import BackendUnavailable

#: How long the dead-letter topic may take to show its partitions.
TOPIC_TIMEOUT_S = 10.0


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register `dead-letters` on the `ipdp` sub-parsers."""
    p = sub.add_parser(
        "dead-letters", help="The records the aggregators refused, with their reasons "
        "(IPDP_TOPIC_DEAD_LETTER, read from its beginning to its end).")
    add_kafka_flag(p)
    p.add_argument("--reason", action="append", default=None, metavar="REASON",
                   help="Only refusals for this reason (repeatable), e.g. replayed.")
    p.add_argument("--json", action="store_true",
                   help="One JSON object per refused record, its bytes in base64.")
    p.set_defaults(func=cmd_dead_letters)


def cmd_dead_letters(args: argparse.Namespace) -> int:
    """`ipdp dead-letters`: print every refused record of the dead-letter topic; the counts by
    reason on stderr. A record dead-lettered twice (an aggregator that died between delivering
    its dead letters and its commit) is printed twice: the exact counts are Redis's."""
    from kafka.errors import KafkaError

    from ipdp.dead_letters import read_dead_letters
    from ipdp.kafka_io import assign_all, kafka_consumer, read_to_end

    kafka, topic = kafka_settings(args), topic_settings().dead_letter
    wanted = set(args.reason or ())
    counts: dict[str, int] = {}
    messages = 0
    try:
        consumer = kafka_consumer(kafka, group_id=None)
        try:
            tps = assign_all(consumer, topic, TOPIC_TIMEOUT_S, "dead-letter topic")
            consumer.seek_to_beginning(*tps)
            for m in read_to_end(consumer, tps):
                messages += 1
                for x in read_dead_letters(m.value, m.headers):
                    if wanted and x.reason not in wanted:
                        continue
                    counts[x.reason] = counts.get(x.reason, 0) + 1
                    print(_line(x, args.json), flush=True)
        finally:
            consumer.close()
    except (KafkaError, TimeoutError) as exc:
        raise BackendUnavailable(
            f"cannot read {topic} from Kafka at {kafka.bootstrap}: {exc!r}") from None
    by_reason = ", ".join(f"{reason} {k}" for reason, k in sorted(counts.items())) or "none"
    print(f"{sum(counts.values())} refused record(s) in {messages} message(s): {by_reason}",
          file=sys.stderr)
    return 0


def _line(x, as_json: bool) -> str:
    if as_json:
        return json.dumps({"topic": x.topic, "partition": x.partition, "offset": x.offset,
                           "index": x.index, "reason": x.reason, "detail": x.detail,
                           "value": base64.b64encode(x.value).decode()})
    return f"{x.topic}:{x.source}  {x.reason}  {x.detail}  ({len(x.value)} bytes)"
