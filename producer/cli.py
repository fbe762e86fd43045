"""`ipdp loadgen`: the device simulator's command line (wired into ipdp.cli by add_commands)."""

from __future__ import annotations

import argparse


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register `loadgen` on the `ipdp` sub-command parser."""
    from ipdp.cli import _lazy
    from ipdp.settings import LoadgenSettings

    p = sub.add_parser(
        "loadgen",
        help="Simulate many devices contributing perturbed records to a study.",
        description="Each simulated device encodes, clips and perturbs its own example and "
        "publishes one record to the records topic. Kafka and topic names come from the "
        "IPDP_KAFKA_* / IPDP_TOPIC_* environment; the study is read from the studies topic.",
    )
    p.add_argument("--study", required=True, metavar="ID", help="Study id.")
    p.add_argument("--devices", required=True, type=int, metavar="N",
                   help="Number of devices (records) to simulate.")
    p.add_argument("--rate", type=float, default=None, metavar="R",
                   help="Records per second (default: as fast as the broker accepts).")
    p.add_argument("--dataset", default="synthetic", metavar="synthetic|csv:PATH",
                   help="Where device data comes from (default: synthetic).")
    p.add_argument("--target", default=None, metavar="COL",
                   help="Target column of a CSV dataset.")
    p.add_argument("--seed", type=int, default=None, metavar="S",
                   help="Seed of the simulated dataset (the privacy noise is always OS-seeded).")
    p.add_argument("--batch", type=int, default=LoadgenSettings().batch, metavar="B",
                   help="Devices simulated per vectorised step (IPDP_LOADGEN_BATCH).")
    p.add_argument("--no-progress", dest="no_progress", action="store_true",
                   help="No progress bar.")
    p.add_argument("--bootstrap", default=None, metavar="HOST:PORT[,...]",
                   help="Kafka bootstrap servers (overrides IPDP_KAFKA_BOOTSTRAP).")
    p.add_argument("--redis-url", dest="redis_url", default=None, metavar="URL",
                   help="Also look the study up in this Redis if the studies topic lacks it.")
    p.set_defaults(func=_lazy("producer.loadgen", "cmd_loadgen"))
