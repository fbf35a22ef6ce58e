"""Power laws L(C) = a * C^b fitted to runs' losses against training compute, two ways, each with a
bootstrap-over-seeds interval for the exponent: the one fitting function (`fit_scaling`) that
`eval scaling` and the sweep's MoBA figure share.

Methods, per attention kind:
- `envelope`: least squares in log space over the lower envelope of every run's checkpoints (the
  points no cheaper point beats). The luckiest seeds' best checkpoints make it, so seed noise
  biases it downward and a few runs can supply most of its points: `runs` says which.
- `seed_means`: one point per configuration (size and tokens trained): the final checkpoint's
  compute and loss averaged over the configuration's seeds. Final checkpoints only: an earlier
  checkpoint of a warm-up + cosine schedule is not the loss a run given that much compute would
  reach (its learning rate has not decayed yet), and the papers fit one point per model trained
  to its budget.

Bootstrap: each resample draws every configuration's seeds with replacement (a configuration
with one seed stays as it is), rebuilds the envelope or the means and refits; `b_ci95` is the
2.5th to 97.5th percentile of b over RESAMPLES resamples from a fixed RNG seed. It measures seed
noise only (not the scatter of sizes about the law: see `b_stderr`, `residual_se`), and is None
when no configuration has two seeds.

Input: runs, each {"run": name, "kind": label, "size": non-embedding parameters, "seed": int,
"points": [{<compute axis>: C, <loss name>: L, ...}, ...] in training order}; a configuration is
(kind, size, the last point's "tokens" if present); the last point is the final checkpoint.

`fit_scaling(...)[loss][compute][method][kind]` is None (fewer than two compute values) or:
- `a`, `b`: the law L = a * C^b, C in PFLOP/s-days on that compute axis (`full`: every matmul of
  training; `6nd`: 6 x non-embedding parameters x tokens);
- `a_stderr`, `b_stderr`: standard errors from the residuals; `residual_se`: the residual
  standard error of log L (all three None below three points);
- `points`: how many points were fitted; `compute_range`: [min, max] of their C, the only range
  the law is drawn over;
- `b_ci95`: [low, high], the bootstrap percentile interval of b, or None; `resamples`: how many
  resamples gave a fit (one with a single compute value gives none);
- `runs`: run -> fitted points it supplies (envelope: only the runs on it; seed_means: each run
  of the kind, 1 each); `configurations`: how many configurations the kind has.
"""

from __future__ import annotations

import math

import numpy as np

RESAMPLES = 2000
RNG_SEED = 0
METHODS = ("envelope", "seed_means")


def fit_power_law(compute, loss) -> dict:
    """(a, b) of L = a * C^b by least squares in log space, with standard errors and the residual
    standard error of log L (nan for n < 3)."""
    x, y = np.log(np.asarray(compute, float)), np.log(np.asarray(loss, float))
    if len(x) < 2 or np.ptp(x) == 0:
        raise ValueError(f"a power-law fit needs at least two distinct compute values, got {len(x)} points")
    design = np.stack([np.ones_like(x), x], axis=1)
    coef, *_ = np.linalg.lstsq(design, y, rcond=None)
    dof = len(x) - 2
    if dof > 0:
        sigma2 = float(((y - design @ coef) ** 2).sum()) / dof
        cov = sigma2 * np.linalg.inv(design.T @ design)
        se_log_a, se_b, residual = math.sqrt(cov[0, 0]), math.sqrt(cov[1, 1]), math.sqrt(sigma2)
    else:
        se_log_a = se_b = residual = float("nan")
    a = math.exp(coef[0])
    return {
        "a": a,
        "a_stderr": a * se_log_a,
        "b": float(coef[1]),
        "b_stderr": se_b,
        "residual_se": residual,
        "points": len(x),
    }


def _envelope_mask(compute: np.ndarray, loss: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Indices of the points sorted by (compute, loss), and which of them no cheaper point beats."""
    order = np.lexsort((loss, compute))
    ls = loss[order]
    best_before = np.concatenate([[np.inf], np.minimum.accumulate(ls)[:-1]])
    return order, ls < best_before


def lower_envelope(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (compute, loss) points no point of less compute beats: the frontier a law is fitted to."""
    if not points:
        return []
    c, loss = (np.asarray(v, float) for v in zip(*points, strict=True))
    order, keep = _envelope_mask(c, loss)
    return [(float(c[i]), float(loss[i])) for i in order[keep]]


def _slope(c: np.ndarray, loss: np.ndarray) -> float | None:
    """b of the log-space least-squares line (None for a single compute value): the bootstrap's fit."""
    x, y = np.log(c), np.log(loss)
    dx = x - x.mean()
    ss = float(dx @ dx)
    return None if ss <= 1e-300 else float(dx @ (y - y.mean())) / ss


class _Kind:
    """One attention kind's runs as arrays: every checkpoint's (compute, loss) per axis and loss."""

    def __init__(self, runs: list[dict], computes, losses):
        self.names = [r["run"] for r in runs]
        self.curves = {
            (c, loss): [
                (
                    np.array([p[c] for p in r["points"]], float),
                    np.array([p[loss] for p in r["points"]], float),
                )
                for r in runs
            ]
            for c in computes
            for loss in losses
        }
        configs: dict[tuple, list[int]] = {}
        for i, r in enumerate(runs):
            configs.setdefault((r["size"], r["points"][-1].get("tokens")), []).append(i)
        self.configs = [configs[k] for k in sorted(configs, key=lambda k: (k[0], k[1] or 0))]

    def resample(self, rng) -> list[list[int]]:
        """Each configuration's runs drawn with replacement; one-seed configurations unchanged."""
        return [g if len(g) == 1 else [g[j] for j in rng.integers(len(g), size=len(g))] for g in self.configs]

    def envelope(self, key, groups) -> tuple[np.ndarray, np.ndarray, list[int]]:
        runs = [i for g in groups for i in g]
        curves = self.curves[key]
        c = np.concatenate([curves[i][0] for i in runs])
        loss = np.concatenate([curves[i][1] for i in runs])
        owner = np.concatenate([np.full(len(curves[i][0]), i) for i in runs])
        order, keep = _envelope_mask(c, loss)
        chosen = order[keep]
        return c[chosen], loss[chosen], [int(v) for v in owner[chosen]]

    def seed_means(self, key, groups) -> tuple[np.ndarray, np.ndarray, list[int]]:
        curves = self.curves[key]
        c = np.array([np.mean([curves[i][0][-1] for i in g]) for g in groups])
        loss = np.array([np.mean([curves[i][1][-1] for i in g]) for g in groups])
        return c, loss, [i for g in groups for i in g]

    def points(self, method, key, groups):
        return (self.envelope if method == "envelope" else self.seed_means)(key, groups)


def _none_if_nan(fit: dict) -> dict:
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in fit.items()}


def fit_scaling(
    runs: list[dict],
    losses=("overall", "trailing"),
    computes=("full", "6nd"),
    *,
    resamples: int = RESAMPLES,
    rng_seed: int = RNG_SEED,
) -> dict:
    """fits[loss][compute][method][kind] as the module docstring says."""
    fits = {loss: {c: {m: {} for m in METHODS} for c in computes} for loss in losses}
    rng = np.random.default_rng(rng_seed)
    for kind in dict.fromkeys(r["kind"] for r in runs):  # in the order given
        mine = _Kind([r for r in runs if r["kind"] == kind], computes, losses)
        draws = (
            [mine.resample(rng) for _ in range(resamples)] if any(len(g) > 1 for g in mine.configs) else []
        )
        for loss in losses:
            for compute in computes:
                for method in METHODS:
                    key = (compute, loss)
                    c, y, owners = mine.points(method, key, mine.configs)
                    if len(np.unique(c)) < 2:
                        fits[loss][compute][method][kind] = None
                        continue
                    fit = _none_if_nan(fit_power_law(c, y))
                    bs = [b for g in draws if (b := _slope(*mine.points(method, key, g)[:2])) is not None]
                    used: dict[str, int] = {}
                    for i in owners:
                        used[mine.names[i]] = used.get(mine.names[i], 0) + 1
                    fits[loss][compute][method][kind] = fit | {
                        "compute_range": [float(c.min()), float(c.max())],
                        "b_ci95": [float(v) for v in np.percentile(bs, [2.5, 97.5])] if bs else None,
                        "resamples": len(bs),
                        "runs": dict(sorted(used.items(), key=lambda kv: (-kv[1], kv[0]))),
                        "configurations": len(mine.configs),
                    }
    return fits


def law_line(fit: dict, n: int = 50) -> tuple[np.ndarray, np.ndarray]:
    """The fitted law sampled over the compute range of the points it was fitted on, no further."""
    grid = np.geomspace(*fit["compute_range"], n)
    return grid, fit["a"] * grid ** fit["b"]


def fit_label(fit: dict, method: str) -> str:
    """b, its bootstrap interval and what was fitted, in a few words (a legend entry)."""
    ci = "no seeds to resample" if fit["b_ci95"] is None else "95 % [{:.3f}, {:.3f}]".format(*fit["b_ci95"])
    runs = f"{len(fit['runs'])} run{'' if len(fit['runs']) == 1 else 's'}"
    what = f"{fit['points']} points from {runs}" if method == "envelope" else f"{fit['points']} sizes, {runs}"
    return f"b = {fit['b']:.3f} ({ci}), {what}"


def fit_lines(fits: dict) -> list[str]:
    """One line per fit: the law, b's bootstrap interval and standard error, the residual standard
    error and the runs used (with how many points each supplies to an envelope)."""
    lines = []
    for loss, by_compute in fits.items():
        for compute, by_method in by_compute.items():
            for method, by_kind in by_method.items():
                for kind, fit in by_kind.items():
                    head = f"{loss}, {compute}, {method}, {kind}:"
                    if fit is None:
                        lines.append(f"{head} one compute value, no fit")
                        continue
                    ci = (
                        "none (no size has two seeds)"
                        if fit["b_ci95"] is None
                        else "[{:.4f}, {:.4f}]".format(*fit["b_ci95"])
                    )
                    se = "n/a" if fit["b_stderr"] is None else f"{fit['b_stderr']:.2g}"
                    res = "n/a" if fit["residual_se"] is None else f"{fit['residual_se']:.2g}"
                    runs = ", ".join(
                        f"{r} x{k}" if method == "envelope" else r for r, k in fit["runs"].items()
                    )
                    lines.append(
                        f"{head} L = {fit['a']:.4g} * C^{fit['b']:.4f}, b 95 % bootstrap {ci}, s.e. {se}, "
                        f"residual s.e. {res}; {fit['points']} points from {len(fit['runs'])} run(s): {runs}"
                    )
    return lines
