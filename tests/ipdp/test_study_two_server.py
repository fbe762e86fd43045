"""A two-server study names its helper (ipdp.study.TwoServer): in its signed text only when set,
with calibrate_two_server's encoding; malformed keys and encodings whose round sum could wrap
are refused at the boundary; `ipdp study create --two-server` makes one and `study show` says
the mode."""

from __future__ import annotations

import json

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from pydantic import ValidationError

from ipdp.cli.common import UsageError
from ipdp.errors import CalibrationError
from ipdp.redis_io import redis_client
from ipdp.sealing import HelperKey, generate_helper_key_files
from ipdp.signing import SigningKey, parse_trusted_keys
from ipdp.state import load_study
from ipdp.study import Study, parse_study_message, study_message
from ipdp.two_server import calibrate_two_server

HELPER = HelperKey(X25519PrivateKey.from_private_bytes(bytes(range(1, 33))))
BASE = {"study_id": "two", "d": 14, "n": 2000, "epsilon": 1.0, "delta": 0.01}
HELPER_FIELDS = {"helper_id": "helper-a", "helper_url": "https://helper.example.org:8443",
                 "helper_key": HELPER.public_b64}


def test_a_one_server_study_keeps_its_text_and_hash():
    study = Study(**BASE)
    assert "two_server" not in json.loads(study.canonical_text)
    assert study.two_server_calibration is None and study.mode_text == "one server"


def test_a_two_server_study_carries_its_helper_and_the_calibrations_encoding():
    study = Study(**BASE, two_server=HELPER_FIELDS)
    cal = calibrate_two_server(epsilon=1.0, delta=0.01, n=2000, d=14)
    block = json.loads(study.canonical_text)["two_server"]
    assert block == HELPER_FIELDS | {
        "fraction_bits": cal.encoding.fraction_bits, "clamp_log2": cal.encoding.clamp_log2,
        "linear_fraction_bits": cal.linear_bits, "poisson_mean": cal.poisson_mean}
    assert study.encoding == cal.encoding
    assert study.hash != Study(**BASE).hash
    assert study.mode_text == (f"two-server, helper helper-a at https://helper.example.org:8443, "
                               f"key id {study.two_server.key_id}")
    # The device's linear noise std is the Skellam's, h_b·√(2μ).
    assert study.noise.std_p == pytest.approx(cal.linear_step * (2 * cal.poisson_mean) ** 0.5)


def test_a_signed_two_server_study_reads_back_equal_and_a_changed_encoding_is_refused():
    owner = SigningKey(Ed25519PrivateKey.from_private_bytes(bytes(range(32))))
    study = Study(**BASE, two_server=HELPER_FIELDS)
    trusted = parse_trusted_keys([owner.public_b64])
    back, _ = parse_study_message(study_message(study, "open", owner), trusted)
    assert back == study and back.canonical_text == study.canonical_text
    fields = json.loads(study.canonical_text)
    fields["two_server"]["fraction_bits"] -= 1
    # Read back, a study is checked for what parsing needs (the encoding cannot wrap); its
    # calibration, computed when first used (by a device, a report), holds it to the text.
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    changed, _ = parse_study_message(json.dumps({"format": 2, "study": text,
                                                 "status": "open", "key_id": "",
                                                 "signature": ""}).encode())
    with pytest.raises(CalibrationError, match="fraction_bits"):
        _ = changed.two_server_calibration


def test_reading_a_two_server_study_back_costs_no_calibration():
    """A follower, a `study list`, reads a two-server study without its calibration (scipy's
    import and a search); the first use computes it."""
    import subprocess
    import sys

    text = Study(**BASE, two_server=HELPER_FIELDS).canonical_text
    code = ("import json, sys\n"
            "from ipdp.study import Study\n"
            f"study = Study.model_validate(json.loads({text!r}))\n"
            "print('scipy' in sys.modules)\n"
            "study.two_server_calibration\n"
            "print('scipy' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60).stdout.split()
    assert out == ["False", "True"]


@pytest.mark.parametrize("change, message", [
    ({"helper_key": "AAAA"}, "32 bytes"),
    ({"helper_key": "not base64!"}, "base64"),
    ({"helper_url": "ftp://helper.example.org"}, "http"),
    ({"helper_url": "https://"}, "host"),
    ({"helper_id": "-bad"}, "pattern"),
    ({"fraction_bits": 62, "clamp_log2": 5}, r"n·B·2\^f .* exceeds 2⁶³ − 1"),
])
def test_a_malformed_helper_or_an_encoding_that_could_wrap_is_a_clear_error(change, message):
    with pytest.raises(ValidationError, match=message):
        Study(**BASE, two_server=HELPER_FIELDS | change)


def test_a_two_server_study_is_rigorous_mode_only():
    with pytest.raises(ValidationError, match="rigorous mode only"):
        Study(**BASE, mode="paper", two_server=HELPER_FIELDS)


def _run(argv):
    from ipdp.cli.main import build_parser

    args = build_parser().parse_args(argv)
    return args.func(args)


def test_study_create_two_server_and_show_say_the_mode(env_topics, redis_settings, capsys,
                                                        tmp_path):
    helper = generate_helper_key_files(tmp_path / "helper")
    argv = ["study", "create", "--study-id", "two-cli", "--d", "14", "--n", "2000",
            "--epsilon", "1", "--delta", "0.01", "--two-server",
            "--helper-key", str(tmp_path / "helper.pub"),
            "--helper-url", "https://helper.example.org", "--helper-id", "helper-a"]
    assert _run(argv) == 0
    out = capsys.readouterr().out
    study, _ = load_study(redis_client(redis_settings), "two-cli")
    assert study.two_server.helper_key == helper.public_b64
    assert (f"two-server, helper helper-a at https://helper.example.org, key id "
            f"{study.two_server.key_id}") in out
    assert _run(["study", "show", "two-cli"]) == 0
    shown = capsys.readouterr().out
    assert "two-server, helper helper-a" in shown
    assert f"f = {study.encoding.fraction_bits} fraction bits" in shown
    # The local (ε, δ) row of the one-server rows is qualified: neither server alone sees it.
    assert "only if they collude; either alone holds uniform shares" in shown
    assert _run(["study", "show", "two-cli", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["two_server_calibration"]["encoding"]["fraction_bits"] == \
        study.encoding.fraction_bits
    with pytest.raises(UsageError, match="--two-server needs --helper-url"):
        _run(argv[:-4] + ["--helper-id", "helper-a"])
    with pytest.raises(UsageError, match="go with --two-server"):
        _run(["study", "create", "--study-id", "x", "--d", "2", "--n", "100", "--epsilon", "1",
              "--delta", "0.01", "--helper-id", "h"])
    with pytest.raises(UsageError, match="32 bytes"):
        _run(argv[:-6] + ["--helper-key", "AAAA"] + argv[-4:])
