"""A user's mistakes at the `ipdp` command line: one line, a non-zero exit, never a traceback;
and what `ipdp --help` costs (the modules it must not import)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from ipdp.embedded.children import free_port

#: What `ipdp --help` must not import: each costs start-up time and none is needed for usage.
HEAVY = ("scipy", "kafka", "starlette", "uvicorn", "dp_accounting", "matplotlib")


def ipdp(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ipdp.cli", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def modules_imported_by(*argv: str, env: dict[str, str] | None = None) -> set[str]:
    """Top-level packages in sys.modules after `ipdp ARGV` ran in a fresh interpreter."""
    code = ("import json, sys\n"
            "from ipdp.cli.main import main\n"
            "try:\n"
            f"    main({list(argv)!r})\n"
            "except SystemExit:\n"
            "    pass\n"
            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})), file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False, env=env)
    return set(json.loads(done.stderr.strip().splitlines()[-1]))


def test_help_imports_no_role_dependency():
    imported = modules_imported_by("--help")
    assert "ipdp" in imported  # the probe saw the command run
    # Nor numpy, pydantic or redis: building the parser needs none of them.
    leaves_out = {*HEAVY, "numpy", "pydantic", "redis"}
    assert not imported & leaves_out, imported & leaves_out


@pytest.mark.parametrize(("argv", "leaves_out"), [
    (["study", "--help"], HEAVY),
    (["calibrate", "--epsilon", "1", "--delta", "0.01", "--n", "10000", "--d", "14"],
     (*HEAVY, "redis", "prometheus_client")),
    (["bench", "throughput", "--help"], ("matplotlib", "dp_accounting")),
])
def test_a_command_imports_only_what_it_uses(argv, leaves_out):
    imported = modules_imported_by(*argv)
    assert "numpy" in imported or argv[-1] == "--help"  # the probe saw the command run
    assert not imported & set(leaves_out), imported & set(leaves_out)


@pytest.mark.integration
def test_study_list_imports_no_kafka_client(runtime):
    env = {k: v for k, v in os.environ.items() if not k.startswith("IPDP_")}
    imported = modules_imported_by("study", "list", env={**env, **runtime.env()})
    assert "redis" in imported  # it did talk to Redis
    assert not imported & {*HEAVY, "prometheus_client"}, imported & {*HEAVY, "prometheus_client"}


@pytest.mark.parametrize(("argv", "usage", "message"), [
    (["demo", "--epsilion", "1"], "usage: ipdp demo ", "unrecognized arguments: --epsilion 1"),
    # An abbreviation is refused, not taken for --devices.
    (["demo", "--device", "10"], "usage: ipdp demo ", "unrecognized arguments: --device 10"),
    (["aggregator", "run", "--idle", "3"], "usage: ipdp aggregator run ",
     "unrecognized arguments: --idle 3"),
    (["study", "list", "--redis", "redis://x"], "usage: ipdp study list ",
     "unrecognized arguments: --redis"),
])
def test_a_flag_typo_shows_the_usage_of_the_command_it_was_given_to(argv, usage, message):
    proc = ipdp(*argv)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert err.startswith(usage), err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize(("argv", "backend"), [
    (["aggregator", "run"], "Redis"),
    (["trainer", "run"], "Redis"),
    (["aggregator", "resume", "--partition", "0", "--from-beginning"], "Redis"),
    (["study", "list"], "Redis"),
    (["credentials", "issue", "s1", "--key", "owner.key"], "Redis"),
    (["gateway"], "Kafka"),
    (["models"], "Kafka"),
    (["dead-letters"], "Kafka"),
    (["loadgen", "--study", "s1", "--devices", "10"], "Kafka"),
])
def test_an_unreachable_backend_is_one_line_naming_it_and_how_to_start_one(argv, backend):
    # Nothing listens on these ports: connections are refused, as without `ipdp up`.
    redis_port, kafka_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("IPDP_")}
    env.update(IPDP_REDIS_URL=f"redis://127.0.0.1:{redis_port}/0",
               IPDP_KAFKA_BOOTSTRAP=f"127.0.0.1:{kafka_port}")
    proc = ipdp(*argv, env=env)
    out, err = proc.communicate(timeout=60)
    port = redis_port if backend == "Redis" else kafka_port
    assert proc.returncode != 0
    assert err.count("\n") == 1, err  # one line
    assert err.startswith(f"ipdp {argv[0]}: cannot reach {backend} at 127.0.0.1:{port}"), err
    assert "`ipdp up --env-file ipdp.env &`, then `. ./ipdp.env`" in err
    assert "Traceback" not in err and out == ""


@pytest.mark.integration
@pytest.mark.parametrize("role", ["aggregator", "trainer"])
def test_a_taken_metrics_port_is_one_line(runtime, role):
    env = {k: v for k, v in os.environ.items() if not k.startswith("IPDP_")}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env.update(runtime.env(), IPDP_METRICS_PORT=str(port))
        proc = ipdp(role, "run", env=env)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert err == (f"ipdp {role}: cannot serve metrics on IPDP_METRICS_PORT 127.0.0.1:{port}: "
                   "Address already in use; set it to a free port, or 0 to turn the endpoint "
                   "off\n")
    assert out == ""


def test_a_taken_default_metrics_port_is_one_warning_and_no_endpoint(monkeypatch, caplog):
    from ipdp import metrics
    from ipdp.settings import MetricsSettings

    monkeypatch.delenv("IPDP_METRICS_PORT", raising=False)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setitem(metrics.DEFAULT_PORTS, "loadgen", taken.getsockname()[1])
        assert metrics.serve(MetricsSettings(), "loadgen") is None
    [record] = caplog.records
    assert "the loadgen's default metrics port" in record.getMessage()
    assert "set IPDP_METRICS_PORT to a free port, or 0" in record.getMessage()


def test_each_role_has_its_own_default_metrics_port():
    from ipdp.metrics import DEFAULT_PORTS

    assert len(set(DEFAULT_PORTS.values())) == len(DEFAULT_PORTS) == 3
