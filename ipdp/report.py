"""Human-readable renderings shared by the CLI commands (tables, not logs: no rows, no statistics)."""

from __future__ import annotations

from ipdp.calibration import Calibration
from ipdp.sample_size import SampleSize


def table(rows: list[tuple[str, str]], title: str | None = None) -> str:
    """Two aligned columns."""
    width = max(len(k) for k, _ in rows)
    lines = [title, "-" * len(title)] if title else []
    lines += [f"{k.ljust(width)}  {v}" for k, v in rows]
    return "\n".join(lines)


def fmt(x: float | None, digits: int = 6) -> str:
    """A number to `digits` significant digits; None is an unbounded guarantee."""
    return "unbounded" if x is None else f"{x:.{digits}g}"


def calibration_rows(cal: Calibration) -> list[tuple[str, str]]:
    """Parameters, noise and guarantees of a calibration, in reading order."""
    rows = [
        ("mode", f"{cal.mode} ({'proven' if cal.proven else 'NOT proven: for reproducing the paper'})"),
        ("neighbouring data sets", cal.neighbouring),
        ("central (ε, δ)", (f"({fmt(cal.epsilon)}, {fmt(cal.delta)})  — δ = "
                            f"{fmt(cal.mechanism_delta)} for the noise (Steps 1–7) + "
                            f"{fmt(cal.norm_check_delta)} for the aggregator's norm check")),
        ("n, d", f"{cal.n}, {cal.d}"),
        ("λ, P, η", f"{fmt(cal.lam)}, {fmt(cal.p_bound)}, {fmt(cal.eta)}"),
        ("ζ = λη + P", fmt(cal.zeta)),
        ("σ_u²  (u ~ N(0, σ_u²/n·I))", fmt(cal.sigma_u2)),
        ("σ_b²  (r ~ N(0, σ_b²/n·I))", fmt(cal.sigma_b2)),
        ("std of u, r per coordinate", f"{fmt(cal.noise_std_q, 4)}, {fmt(cal.noise_std_p, 4)}"),
        ("Δ_in (trainer ridge)", fmt(cal.delta_in)),
    ]
    why = "what Step 8 minimises over the proven splits (public parameters only)"
    if cal.predicted_error is not None:
        rows.append(("predicted excess risk R", fmt(cal.predicted_error, 4) + (
            f"  — {why}" if cal.predicted_direction_error is None else "")))
    if cal.predicted_direction_error is not None:
        rows.append(("predicted direction error D",
                     f"{fmt(cal.predicted_direction_error, 4)}  — {why}, for a classifier"))
    if cal.lambda_prime is not None:
        rows += [("λ′ (noisy smoothness)", fmt(cal.lambda_prime)),
                 ("ζ′ (noisy Lipschitz)", fmt(cal.zeta_prime))]
    rows += [
        ("linear sensitivity", fmt(cal.linear_sensitivity)),
        ("ε split", _split(cal.epsilon_split)),
        ("δ split", _split(cal.delta_split)),
    ]
    local = (f"({fmt(cal.local_epsilon, 5)}, {fmt(cal.local_delta)})  — "
             f"{local_protection(cal.local_epsilon)}")
    rows.append(("local (ε, δ) of one record", local))
    return rows


LOCAL_EPSILON_STRONG = 1.0
"""A local ε at most this protects a record on its own about as well as a central ε of 1."""
LOCAL_EPSILON_WEAK = 10.0
"""Past this local ε a record on its own is barely protected: e^ε > 20,000."""


def local_protection(local_epsilon: float | None) -> str:
    """What the local ε of one record means, in words that follow its value (docs/security.md)."""
    if local_epsilon is not None and local_epsilon <= LOCAL_EPSILON_STRONG:
        return "each record alone is well protected too (local ε ≤ 1)"
    if local_epsilon is not None and local_epsilon <= LOCAL_EPSILON_WEAK:
        return ("each record alone is moderately protected (1 < local ε ≤ 10); the central "
                "guarantee is the one to quote")
    return ("each record alone is only weakly protected (local ε > 10): guard the records topic "
            "and Redis like raw data; the central guarantee is the one to quote")


def _amount(size: SampleSize, value: float) -> str:
    """A promise's amount: τ in the target's units, or accuracy points for a classifier."""
    if size.loss == "logistic":
        return f"{100 * value:.2g} points"
    return f"τ = {fmt(value, 3)}" + ("" if size.target_name == "y" else f" {size.target_name}")


def _asked(size: SampleSize) -> str:
    """The margin asked, with the n it needs."""
    need = ("no n up to 2^40" if size.advised_n is None else f"n ≥ {size.advised_n:,}")
    if size.loss == "logistic":
        return f"{100 * size.margin:.2g} points needs {need}"
    return f"{fmt(size.margin, 3)}·s = {fmt(size.tolerance, 4)} needs {need}"


def sample_size_rows(size: SampleSize, n: int) -> list[tuple[str, str]]:
    """What n buys against the non-private model, the n the margin needs, and the assumption
    (docs/privacy.md, "The n a study needs")."""
    if size.loss == "logistic":
        bound = (f"at most {_amount(size, size.bought)} below" if size.bought < 0.5
                 else "no bound on what it loses against")
        buys = (f"test accuracy {bound} NP's, the non-private fit of the same rows; "
                f"{_asked(size)}")
        assuming = ("a classifier whose scores crowd the boundary no more than the benchmark "
                    "tables' (docs/benchmarks.md)")
    else:
        buys = (f"test RMSE ≤ √(RMSE_NP² + τ²) with {_amount(size, size.bought)}, NP the "
                f"non-private fit of the same rows; {_asked(size)}")
        lo, hi = size.target_range
        assuming = (f"s = {fmt(size.target_sd, 4)}, the target's standard deviation as given"
                    if size.target_sd_given else
                    f"s = {fmt(size.target_sd, 4)}, the largest standard deviation "
                    f"{size.target_name}'s range [{fmt(lo, 4)}, {fmt(hi, 4)}] allows "
                    "(--target-sd S: your data's)")
    return [(f"n = {n:,} buys", buys + ("" if size.enough else "  — n is BELOW it")),
            ("assuming", assuming)]


def sample_size_warning(size: SampleSize, n: int) -> str | None:
    """What `study create` says when the study's n does not meet the margin, else None."""
    if size.enough:
        return None
    if size.loss == "logistic":
        promise = ("no bound on the accuracy lost" if size.bought >= 0.5
                   else f"at most {_amount(size, size.bought)} of accuracy lost")
    else:
        promise = _amount(size, size.bought)
    return (f"WARNING: at n = {n:,} the promise against the non-private model is {promise}; "
            f"{_asked(size)} (docs/privacy.md, \"The n a study needs\")")


def _split(parts: dict[str, float]) -> str:
    return ", ".join(f"{k}={fmt(v, 4)}" for k, v in parts.items())


def two_server_rows(study) -> list[tuple[str, str]]:
    """A study's mode and, for a two-server study, its devices' encoding and the two-server
    calibration's noise and (ε, δ) split (ipdp.two_server, docs/wire-format.md "Two-server
    records"), which replace the one-server σ_b² and split above."""
    rows = [("servers", study.mode_text)]
    two = study.two_server_calibration
    if two is None:
        return rows
    fp = two.encoding
    return rows + [
        ("calibration", ("a two-server study keeps the one-server σ_u², Δ_in, γ₁ and γ₂; these "
                        "rows replace its σ_b², norm check and ε, δ splits")),
        ("encoding", (f"ring Z_2^64, f = {fp.fraction_bits} fraction bits, entries clamped to "
                     f"±2^{fp.clamp_log2}, {fp.entries} values per record")),
        ("linear noise (two-server)", (f"2^−{two.linear_bits}·(Poisson(μ) − Poisson(μ)) per "
                                      f"coordinate, μ = {fmt(two.poisson_mean)}; "
                                      f"σ_b² = {fmt(two.sigma_b2)}")),
        ("ε split (two-server)", _split(two.epsilon_split)),
        ("δ split (two-server)", _split(two.delta_split)),
        ("who sees a record", ("the local (ε, δ) above is what the leader and the helper learn "
                               "of a record only if they collude; either alone holds uniform "
                               "shares (docs/security.md)")),
    ]


def calibration_table(cal: Calibration, more: list[tuple[str, str]] | None = None) -> str:
    """`ipdp calibrate`'s human output, with `more` rows at the end."""
    return table(calibration_rows(cal) + (more or []), title="ipdp calibration")
