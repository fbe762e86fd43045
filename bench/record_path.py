"""Which of ipdp's files and functions one round's records pass through, from the device's
``submit`` to the published model: the embedded runtime, one study of n records, the
aggregator and the trainer in this process, every call into the project's code recorded
(sys.setprofile on every thread). Prints the files and the distinct functions per file.

    python -m bench.record_path

Only the per-record path is traced: the study, the clients and the services are set up
first. The count is of distinct functions (comprehensions not counted), not of calls (a loop
calls one function many times).
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np

from aggregator.service import Aggregator
from aggregator.settings import AggregatorSettings
from ipdp import state
from ipdp.embedded import EmbeddedRuntime
from ipdp.kafka_io import ensure_topics, kafka_producer
from ipdp.redis_io import redis_client
from ipdp.settings import TopicSettings
from ipdp.study import Study
from producer.contributor import Contributor
from trainer.service import Trainer
from trainer.settings import TrainerSettings

ROOT = Path(__file__).resolve().parent.parent
ROLES = ("producer", "aggregator", "trainer", "ipdp")
SKIP = ("ipdp/embedded/", "ipdp/cli/", "bench/")
COMPREHENSIONS = ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>")


def _where(code) -> str | None:
    path = Path(code.co_filename)
    try:
        rel = path.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        # the same layout under another checkout (PYTHONPATH=... for a before/after count);
        # installed packages are not the project, even where a folder is named like a room
        # (kafka-python's kafka/producer/)
        parts = path.parts
        if "site-packages" in parts or "dist-packages" in parts:
            return None
        hits = [i for i, p in enumerate(parts) if p in ROLES]
        if not hits:
            return None
        rel = "/".join(parts[hits[-1]:])
    if not rel.startswith(tuple(f"{r}/" for r in ROLES)) or rel.startswith(SKIP):
        return None
    return rel


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--list", action="store_true", help="Also name every function, per file.")
    args = ap.parse_args()
    seen: dict[str, set[str]] = collections.defaultdict(set)

    def profile(frame, event, _arg):
        if event == "call":
            where = _where(frame.f_code)
            # Comprehensions are code objects of their own, not functions a reader follows.
            if where is not None and not frame.f_code.co_name.endswith(COMPREHENSIONS):
                seen[where].add(frame.f_code.co_qualname)

    with tempfile.TemporaryDirectory() as tmp, EmbeddedRuntime(Path(tmp)) as rt:
        kafka, rs = rt.kafka_settings(), rt.redis_settings()
        topics = TopicSettings(records="path.records", models="path.models",
                               dead_letter="path.dlq", studies="path.studies")
        ensure_topics(kafka, topics)
        study = Study(study_id="path", d=4, n=300, epsilon=1.0, delta=0.01, delta_in=0.5)
        producer = kafka_producer(kafka)
        state.create_study(redis_client(rs), producer, topics, study)
        device = Contributor(study, producer, topics.records, records_per_device=study.n)
        aggregator = Aggregator(kafka, rs, topics, AggregatorSettings(group="path"))
        trainer = Trainer(kafka, rs, topics, TrainerSettings(group="path", block_ms=200))
        rng = np.random.default_rng(1)
        x = rng.normal(size=(study.n, study.d)) / 4
        threading.setprofile(profile)
        sys.setprofile(profile)
        try:
            for row in x:
                device.submit(row, float(np.clip(row[0], -1, 1)))
            device.flush()
            aggregator.run(idle_exit_s=3.0)
            published = trainer.run(idle_exit_s=3.0)
        finally:
            sys.setprofile(None)
            threading.setprofile(None)
        producer.close()
    assert published == 1, f"{published} models published"
    print("| file | distinct functions |\n|---|---|")
    for where in sorted(seen):
        print(f"| {where} | {len(seen[where])} |")
    print(f"\n{len(seen)} files, {sum(len(v) for v in seen.values())} distinct functions")
    if args.list:
        for where in sorted(seen):
            print(f"\n{where}: {', '.join(sorted(seen[where]))}")


if __name__ == "__main__":
    main()
