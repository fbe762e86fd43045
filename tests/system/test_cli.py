"""The `ipdp` console script as a user runs it: real subprocesses, exit codes, output."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

CALIBRATE = ["calibrate", "--epsilon", "1", "--delta", "0.01", "--n", "10000", "--d", "14",
             "--lam", "1", "--p-bound", "1", "--eta", "1"]


def ipdp(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ipdp.cli", *args], check=False,
                          capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize(("mode", "sigma_u2"), [("rigorous", 8.291), ("paper", 2.537)])
def test_calibrate_json_has_the_documented_keys(mode, sigma_u2):
    out = ipdp(*CALIBRATE, "--mode", mode, "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert {"sigma_u2", "sigma_b2", "delta_in", "mode", "local_epsilon", "neighbouring",
            "linear_sensitivity", "epsilon_split", "delta_split", "proven", "mechanism_delta",
            "norm_check_delta"} <= result.keys()
    # The published models' δ is the one asked: the noise's and the norm check's shares of it.
    assert result["delta"] == 0.01
    assert result["mechanism_delta"] + result["norm_check_delta"] <= result["delta"]
    assert sum(result["delta_split"].values()) <= result["delta"] * (1 + 1e-12)  # rounding
    assert sum(result["delta_split"].values()) == pytest.approx(result["delta"])
    assert result["neighbouring"] == "replace-one"
    assert result["proven"] == (mode == "rigorous")
    assert sum(result["epsilon_split"].values()) == pytest.approx(1.0)
    assert result["mode"] == mode
    assert result["sigma_u2"] == pytest.approx(sigma_u2, rel=1e-3)
    if mode == "rigorous":
        assert result["lambda_prime"] > 1.0
        assert result["zeta_prime"] == pytest.approx(result["lambda_prime"] + 1.0)
        assert result["linear_sensitivity"] == pytest.approx(result["lambda_prime"] + 2.0)


def test_calibrate_prints_a_readable_table():
    out = ipdp(*CALIBRATE)
    assert out.returncode == 0, out.stderr
    assert "σ_u²" in out.stdout and "8.29269" in out.stdout
    assert "replace-one" in out.stdout and "ε split" in out.stdout
    assert "local (ε, δ) of one record" in out.stdout


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [("--epsilon", "0", "epsilon=0.0 must be a finite number > 0"),
     ("--delta", "1.5", "delta=1.5 must lie in the open interval (0, 1)"),
     ("--n", "20", "too small for rigorous mode")],
)
def test_bad_calibration_parameters_exit_2_with_the_message_and_no_traceback(flag, value, message):
    args = list(CALIBRATE)
    args[args.index(flag) + 1] = value
    out = ipdp(*args)
    assert out.returncode == 2
    assert message in out.stderr
    assert "Traceback" not in out.stderr


def test_every_documented_command_has_help():
    for command in (["up"], ["study", "create"], ["aggregator", "run"], ["trainer", "run"],
                    ["loadgen"], ["models"], ["demo"], ["keys", "generate"], ["bench", "accuracy"],
                    ["bench", "throughput"], ["soak"]):
        out = ipdp(*command, "--help")
        assert out.returncode == 0, (command, out.stderr)
        assert "usage: ipdp" in out.stdout


def test_keys_generate_writes_a_private_key_and_a_pub_line_and_never_overwrites(tmp_path):
    import base64
    import os
    import stat

    out = ipdp("keys", "generate", "--out", str(tmp_path / "owner"))
    assert out.returncode == 0, out.stderr
    assert stat.S_IMODE(os.stat(tmp_path / "owner.key").st_mode) == 0o600
    pub = (tmp_path / "owner.pub").read_text().strip()
    assert len(base64.b64decode(pub, validate=True)) == 32 and pub in out.stdout
    again = ipdp("keys", "generate", "--out", str(tmp_path / "owner"))
    assert again.returncode == 2 and "refusing to overwrite" in again.stderr
