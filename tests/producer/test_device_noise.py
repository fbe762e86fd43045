"""Real devices draw their noise from the OS's CSPRNG; simulated ones from numpy's PCG64.

The statistical checks use |z| < 6 per statistic (false failure about 2·10⁻⁹ each) and the χ²
shape test at its 10⁻⁹ quantile, so they cannot fail by accident, and each is shown to catch
what it targets (a std 5 % off, a uniform of the right variance).
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from scipy import stats

from ipdp.losses import SystemNoise, clip, encode, perturb
from ipdp.study import Study
from ipdp.wire import decode_batch
from producer import contributor
from producer.contributor import Contributor
from producer.datasets import synthetic
from producer.loadgen import run_loadgen
from tests.pipeline import read_records

STD = 0.7
Z_MAX = 6.0


def gaussian_checks(z: np.ndarray, std: float) -> dict[str, float]:
    """z-scores of mean, variance (Σz² against χ²_N), lag-1 correlation; χ² shape p-value."""
    n = z.size
    w = z / std
    bins = np.linspace(-3.5, 3.5, 15)
    counts = np.histogram(w, bins=np.concatenate([[-np.inf], bins, [np.inf]]))[0]
    expected = n * np.diff(stats.norm.cdf(np.concatenate([[-np.inf], bins, [np.inf]])))
    return {
        "mean": float(w.mean() * np.sqrt(n)),
        "variance": float(((w**2).sum() - n) / np.sqrt(2 * n)),
        "lag1": float((w[:-1] * w[1:]).sum() / np.sqrt(n - 1)),
        "shape_p": float(stats.chi2.sf(((counts - expected) ** 2 / expected).sum(), 15)),
    }


def passes(checks: dict[str, float]) -> bool:
    return (all(abs(checks[k]) < Z_MAX for k in ("mean", "variance", "lag1"))
            and checks["shape_p"] > 1e-9)


def test_the_sdk_draws_from_the_csprng_and_each_device_step_names_its_noise_source():
    study = Study(study_id="noise", d=3, n=2_000, epsilon=1.0, delta=0.01)
    assert isinstance(Contributor(study, producer=None, topic="unused").noise, SystemNoise)
    assert inspect.signature(Contributor.connect).parameters["noise"].default is None
    # One device step, the noise source a parameter the caller must name.
    assert inspect.signature(contributor.perturb_records).parameters["noise"].default is \
        inspect.Parameter.empty
    # No state to seed: two sources (or two calls) never repeat.
    a, b = SystemNoise().normal(0, 1, 64), SystemNoise().normal(0, 1, 64)
    assert not np.array_equal(a, b)


def test_the_simulator_repeats_its_noise_for_a_seed_and_draws_fresh_noise_without_one(
        kafka_settings, topics):
    """Simulated devices are reproducible from the seed of their generator, so that a run can be
    replayed, and the load generator seeds it from the OS when none is given, so that two runs
    of the same rows never send the same noise."""
    rows = synthetic(50, 3, "squared", seed=0)
    runs = {"seed-7": 7, "seed-7-again": 7, "seed-8": 8, "unseeded": None,
            "unseeded-again": None}
    hashes = {}
    for study_id, seed in runs.items():
        study = Study(study_id=study_id, d=3, n=2_000, epsilon=1.0, delta=0.01)
        hashes[study.hash] = study_id
        rng = None if seed is None else np.random.default_rng(seed)
        assert run_loadgen(study, kafka_settings, topics, rows.x, rows.y, progress=False,
                           rng=rng).sent == 50
    values = [m.value for m in read_records(kafka_settings, topics.records, 50 * len(runs))]
    (batch,), rejects = decode_batch(values)
    assert not rejects and len(batch) == 50 * len(runs)
    # Each run's q̃ entries sorted per coordinate: an order the partitions they went through
    # cannot change.
    noisy = {hashes[h]: np.sort(batch.q[[bytes(r) == h for r in batch.study_hash]], axis=0)
             for h in hashes}
    assert all(len(rows_of_run) == 50 for rows_of_run in noisy.values())
    np.testing.assert_array_equal(noisy["seed-7"], noisy["seed-7-again"])
    assert not np.any(noisy["seed-7"] == noisy["seed-8"])
    assert not np.any(noisy["unseeded"] == noisy["unseeded-again"])
    assert not np.any(noisy["unseeded"] == noisy["seed-7"])


def test_system_noise_is_gaussian_with_the_asked_std():
    z = SystemNoise().normal(0.0, STD, size=(2_000, 100))
    assert z.shape == (2_000, 100)
    checks = gaussian_checks(z.ravel(), STD)
    assert passes(checks), checks
    assert np.abs(z).max() <= STD * np.sqrt(106 * np.log(2))
    assert SystemNoise().normal(1.0, 2.0).shape == ()
    assert SystemNoise().normal(size=7).shape == (7,)


def test_the_checks_catch_a_wrong_std_and_a_uniform_of_the_right_variance():
    z = SystemNoise().normal(0.0, STD, size=200_000)
    assert abs(gaussian_checks(z * 1.05, STD)["variance"]) > 20
    uniform = np.random.default_rng(1).uniform(-1, 1, 200_000) * STD * np.sqrt(3)
    checks = gaussian_checks(uniform, STD)
    assert abs(checks["variance"]) < Z_MAX and checks["shape_p"] < 1e-9


@pytest.mark.parametrize("loss", ["squared", "logistic"])
def test_records_from_the_sdk_carry_noise_of_the_study_calibration(loss):
    study = Study(study_id="sdk-noise", loss=loss, d=14, n=10_000, epsilon=1.0, delta=0.01)
    rng = np.random.default_rng(3)
    x = rng.normal(size=(10_000, study.d))
    y = np.sign(rng.normal(size=10_000))
    # 10,000 draws through the SDK's own path: one Contributor allowed that many records.
    sdk = Contributor(study, producer=None, topic="unused", records_per_device=10_000)
    _, values = sdk.encode_many(x, y)
    (batch,), rejects = decode_batch(values)
    assert not rejects
    q, p = clip(*encode(loss, x, y), study.lam, study.p_bound)
    cal = study.calibration
    assert passes(gaussian_checks((batch.q - q).ravel(), cal.noise_std_q))
    assert passes(gaussian_checks((p - batch.p).ravel(), cal.noise_std_p))


def test_perturb_defaults_to_the_csprng_and_takes_a_seeded_source_for_simulation():
    study = Study(study_id="sim", d=4, n=2_000, epsilon=1.0, delta=0.01)
    q = p = np.zeros((3, 4))
    seeded = [perturb(q, p, study.calibration, np.random.default_rng(5)) for _ in range(2)]
    np.testing.assert_array_equal(seeded[0][0], seeded[1][0])
    assert not np.array_equal(perturb(q, p, study.calibration)[0],
                              perturb(q, p, study.calibration)[0])
