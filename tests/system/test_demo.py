"""`ipdp demo`, the README's main job, run as a user runs it (embedded broker and Redis)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from ipdp.cli.demo import LEGEND
from tests.conftest import _require_binaries

#: A log line at ERROR (ipdp.process.setup_logging's format).
ERROR_LINE = re.compile(r"^\S+ \S+ ERROR ", re.MULTILINE)


def _demo(*flags: str) -> dict:
    _require_binaries()
    out = subprocess.run([sys.executable, "-m", "ipdp.cli", "demo", "--json", *flags],
                         check=False, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and not ERROR_LINE.search(out.stderr), out.stderr[-3000:]
    return json.loads(out.stdout)


@pytest.mark.integration
def test_demo_as_make_demo_runs_it_logs_no_error_and_each_trust_warning_once():
    _require_binaries()
    out = subprocess.run([sys.executable, "-m", "ipdp.cli", "demo", "--n", "5000"],
                         check=False, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ipdp demo: result" in out.stdout
    assert "Traceback" not in out.stderr and not ERROR_LINE.search(out.stderr), out.stderr[-3000:]
    # The demo's study is unsigned and its models unverified, on purpose: each said once,
    # with what to do about it.
    assert out.stderr.count("UNSIGNED") == 1 and "--signing-key owner.key" in out.stderr
    assert out.stderr.count("UNVERIFIED") == 1 and "IPDP_TRUSTED_MODEL_KEYS" in out.stderr


@pytest.mark.integration
def test_demo_squared_loss_reports_a_private_model_from_exactly_n_records():
    result = _demo("--n", "20000")
    assert {"n", "records_folded", "round", "rmse_private", "rmse_nonprivate", "epsilon",
            "delta", "elapsed_s"} <= result.keys()
    assert (result["n"], result["records_folded"], result["round"]) == (20000, 20000, 1)
    # The model's guarantee is the study's (ε, δ): the norm check's thousandth is taken out of δ.
    assert (result["epsilon"], result["delta"]) == (1.0, 0.01)
    # At n = 20,000 the private fit is about 0.05 and predicting 0 about 0.26.
    assert result["rmse_private"] < result["rmse_zero_model"] / 2
    assert result["rmse_nonprivate"] < result["rmse_zero_model"] / 2
    # Step 8's prediction of the excess squared error, next to the one measured on the test rows.
    assert result["excess_mse_predicted"] > 0.0
    assert result["excess_mse_measured"] == pytest.approx(
        result["rmse_private"] ** 2 - result["rmse_nonprivate"] ** 2)
    # Every number has its meaning printed next to it; the coefficients come by feature name.
    assert set(result) - {"coefficients"} <= LEGEND.keys()
    coefficients = result["coefficients"]
    assert coefficients["features"] == [f"x{j}" for j in range(1, 15)]
    assert all(len(coefficients[k]) == 14 for k in ("private", "nonprivate", "generating"))


@pytest.mark.integration
def test_demo_logistic_loss_reports_accuracy_instead_of_rmse():
    result = _demo("--n", "20000", "--loss", "logistic")
    assert {"accuracy_private", "accuracy_nonprivate"} <= result.keys()
    assert "rmse_private" not in result
    assert result["records_folded"] == 20000
    assert result["accuracy_private"] > 0.75  # about 0.92 here; chance is 0.5
    assert result["accuracy_majority_label"] < result["accuracy_private"]
    assert set(result) - {"coefficients"} <= LEGEND.keys()


@pytest.mark.integration
def test_demo_via_gateway_sends_every_record_over_http_and_gets_the_same_round():
    result = _demo("--n", "5000", "--via-gateway")
    assert result["via_gateway"] is True
    assert (result["records_sent"], result["records_folded"], result["round"]) == (5000, 5000, 1)
    assert result["rmse_private"] < result["rmse_zero_model"]


@pytest.mark.integration
def test_demo_web_serves_the_page_and_a_study_signed_by_the_key_in_its_url(tmp_path):
    import signal
    import urllib.request
    from urllib.parse import parse_qs, urlsplit

    from gateway.web import checkout_web_dir
    from ipdp.signing import parse_trusted_keys
    from ipdp.study import StudyStatus, parse_study_message

    _require_binaries()
    if not (checkout_web_dir() / "demo" / "index.html").is_file():
        pytest.skip("producer/web is not built (cd producer/web && npm ci && npm run build)")
    with open(tmp_path / "stderr", "wb") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "ipdp.cli", "demo", "--web"],
                                stdout=subprocess.PIPE, stderr=stderr, text=True,
                                start_new_session=True)
    with proc:  # its exit closes the read end of the demo's stdout, then waits
        try:
            page = proc.stdout.readline().strip()
            assert page, (tmp_path / "stderr").read_text()[-3000:]
            parts = urlsplit(page)
            assert parts.path == "/web/demo/"
            query = {k: v[0] for k, v in parse_qs(parts.query).items()}
            origin = f"{parts.scheme}://{parts.netloc}"
            with urllib.request.urlopen(page, timeout=10) as resp:
                assert resp.headers["content-type"].startswith("text/html")
                assert b"Contribute one example" in resp.read()
            with urllib.request.urlopen(f"{origin}/studies/{query['study']}", timeout=10) as resp:
                study, status = parse_study_message(resp.read(), parse_trusted_keys(query["key"]))
            assert (study.study_id, study.n, study.d, status) == \
                (query["study"], 200, 3, StudyStatus.OPEN)
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=60) == 0
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.mark.integration
def test_demo_two_server_trains_from_shares_and_neither_domain_holds_a_plain_record():
    result = _demo("--two-server", "--n", "2000")
    assert result["two_server"] is True
    assert (result["n"], result["records_folded"], result["round"]) == (2000, 2000, 1)
    assert result["rmse_private"] < result["rmse_zero_model"]
    assert set(result) - {"coefficients", "domains"} <= LEGEND.keys()
    seen = result["domains"]
    assert seen["records_read"] == 2000
    # χ² of byte values, 255 degrees of freedom: 255 ± 23 for uniform bytes; the bound below is
    # about 6 standard deviations above, the plain encoding tens of thousands.
    for held in ("leader_shares_chi2", "sealed_helper_shares_chi2", "helper_round_sum_chi2"):
        assert seen[held] < 400, (held, seen)
    assert seen["plain_encoding_chi2"] > 10_000
    assert seen["helper_jobs_holding_opened_shares"] == 0
