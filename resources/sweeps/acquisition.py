"""A tick's TPE draws computed together: candidates from one pass over the random stream, acquisition once per fit.

`TPESampler._compute_acquisition_func` is log l(x) - log g(x), where l and g
are the Parzen estimators of the better and worse trials: mixtures with one
component per trial. Optuna's `_MixtureOfProductDistribution.log_pdf`
evaluates every candidate against every component and, per call, recomputes
per-component terms that only depend on the fit (each truncated normal's log
mass, an erf per component; the log of its scale and weight; a discrete
parameter's normalising mass), then selects, adds and reduces over
candidates x components arrays in some 15 passes. A tick draws 64 trials of
24 candidates each from one fit, so with g holding every other trial of the
study that was most of a tick (0.22 of 0.45 s at 3,000 trials, issue 16).

`FastMixture` computes the per-component terms once per fit, turns discrete
and categorical parameters into one row of per-component terms per distinct
combination of their candidate values (Optuna's own truncated-normal mass for
a discrete value, the component's category weight), and evaluates the
continuous parameters' Gaussian kernels in one subtract, scale, square, add
and a log-sum-exp per block of candidates; terms more than e^-600 below a
candidate's largest are floored there before `exp` (they add nothing to the
sum, and `exp` of what underflows is ten times slower: at 10,000 trials most
components are that far from any candidate). Same mixture, same formula: the
log densities agree with Optuna's to rounding (about 1e-12 relative;
tests/resources/sweeps/test_batch_ask.py compares them, and the picks, with
Optuna's own). A candidate outside a continuous parameter's range (Optuna
gives it -inf) or a degenerate component sends the whole call to Optuna's own
`log_pdf`.

`sample_draws` draws every draw's candidates at once, bit for bit what
Optuna's `mixture.sample` calls draw one after another (see there).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

_BLOCK = 1 << 18  # candidates x components per block: about 2 MB of float64, cache-sized
_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)
_FLOOR = -600.0  # exp(-600) = 2.7e-261: a sum of 1e200 of them still leaves 1.0 unchanged


class FastMixture:
    """A fitted `_MixtureOfProductDistribution` whose `log_pdf` reuses the per-component terms.

    Args:
        mixture: the Parzen estimator's `_mixture_distribution`.
    """

    def __init__(self, mixture: Any) -> None:
        from optuna.samplers._tpe import _truncnorm
        from optuna.samplers._tpe.probability_distributions import _BatchedCategoricalDistributions, _unique_inverse_2d

        self.mixture = mixture
        weights = np.asarray(mixture.weights, dtype=np.float64)
        with np.errstate(divide="ignore"):
            base = np.log(weights)
        self.continuous: list[tuple[int, bool, float, float, np.ndarray, np.ndarray]] = []
        self.discrete: list[tuple[int, Any, np.ndarray, np.ndarray, np.ndarray]] = []
        self.categorical: list[tuple[int, np.ndarray]] = []
        self.degenerate = False
        for i, d in enumerate(mixture.distributions):
            if isinstance(d, _BatchedCategoricalDistributions):
                with np.errstate(divide="ignore"):
                    self.categorical.append((i, np.log(d.weights).T.copy()))  # (choices, components)
                continue
            mu = np.asarray(d.mu, dtype=np.float64)
            sigma = np.asarray(d.sigma, dtype=np.float64)
            low, high = d.adapted_low, d.adapted_high
            a, b = (low - mu) / sigma, (high - mu) / sigma
            if np.any(a == b) or not np.all(sigma > 0):
                self.degenerate = True
            if d.step == 0.0:
                base = base - _truncnorm._log_gauss_mass(a, b) - np.log(sigma) - _LOG_SQRT_2PI
                self.continuous.append((i, bool(d.is_log), float(low), float(high), mu, math.sqrt(0.5) / sigma))
            else:
                mu_u, sigma_u, inv = _unique_inverse_2d(mu, sigma)
                base = base - _truncnorm._log_gauss_mass((low - mu_u) / sigma_u, (high - mu_u) / sigma_u)[inv]
                self.discrete.append((i, d, mu_u, sigma_u, inv))
        self.base = base
        self.n = len(weights)

    def log_pdf(self, x: np.ndarray) -> np.ndarray:
        """Log density of each row of `x` (the estimator's transformed samples, one column per parameter)."""
        if self.degenerate or len(x) == 0:
            return np.asarray(self.mixture.log_pdf(x))
        cont = []
        for i, is_log, low, high, _, _ in self.continuous:
            with np.errstate(divide="ignore", invalid="ignore"):
                xi = np.log(x[:, i]) if is_log else np.asarray(x[:, i], dtype=np.float64)
            if not np.all((xi >= low) & (xi <= high)):
                return np.asarray(self.mixture.log_pdf(x))
            cont.append(xi)
        rows, groups = self._rows(x)
        out = np.empty(len(x), dtype=np.float64)
        block = max(1, _BLOCK // self.n)
        for k, row in enumerate(rows):
            members = np.nonzero(groups == k)[0]
            for start in range(0, len(members), block):
                at = members[start:start + block]
                out[at] = self._logsumexp(row, [c[at] for c in cont], len(at))
        return out

    def _rows(self, x: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
        """Per distinct combination of the rows' discrete and categorical values, the components' terms; each row's
        combination."""
        from optuna.samplers._tpe import _truncnorm

        if not self.discrete and not self.categorical:
            return [self.base], np.zeros(len(x), dtype=np.int64)
        columns = [i for i, *_ in self.discrete] + [i for i, _ in self.categorical]
        combos, groups = np.unique(x[:, columns], axis=0, return_inverse=True)
        rows = []
        for combo in combos:
            row = self.base.copy()
            for value, (_, d, mu_u, sigma_u, inv) in zip(combo, self.discrete):
                left, right = value - d.step / 2, value + d.step / 2
                if d.is_log:
                    left, right = math.log(left), math.log(right)
                row += _truncnorm._log_gauss_mass((left - mu_u) / sigma_u, (right - mu_u) / sigma_u)[inv]
            for value, (_, log_weights) in zip(combo[len(self.discrete):], self.categorical):
                row += log_weights[int(value)]
            rows.append(row)
        return rows, np.asarray(groups).reshape(-1)

    def _logsumexp(self, row: np.ndarray, cont: list[np.ndarray], count: int) -> np.ndarray:
        """log sum_j exp(row_j - sum_c ((x_c - mu_cj) / (sqrt(2) sigma_cj))^2) for each of `count` candidates."""
        if not cont:
            v = row[None, :].copy()
        else:
            v = np.empty((count, self.n), dtype=np.float64)
            t = np.empty_like(v) if len(cont) > 1 else v
            for c, (xc, (_, _, _, _, mu, scale)) in enumerate(zip(cont, self.continuous)):
                np.subtract(xc[:, None], mu[None, :], out=t)
                t *= scale
                np.square(t, out=t)
                if c == 0:
                    if t is not v:
                        np.copyto(v, t)
                else:
                    v += t
            np.subtract(row[None, :], v, out=v)
        top = v.max(axis=1)
        top[np.isneginf(top)] = 0.0
        v -= top[:, None]
        # Terms below e^-600 add nothing to a sum >= 1 (its largest term is e^0), and exp of what underflows (below
        # about -708) is ten times slower here than of anything else: most of a large study's components are that far.
        np.maximum(v, _FLOOR, out=v)
        np.exp(v, out=v)
        with np.errstate(divide="ignore"):
            lse = np.log(v.sum(axis=1)) + top
        return lse if cont else np.full(count, lse[0])


def sample_draws(mixtures: list[Any], rng: np.random.RandomState, draws: int, size: int) -> list[np.ndarray]:
    """`draws` rounds of `mixture.sample(rng, size)` over `mixtures` in turn, as one computation; per mixture its
    samples, draw after draw.

    Optuna's `_MixtureOfProductDistribution.sample` per call draws `size`
    component indices (`rng.choice`), a uniform per categorical parameter
    and candidate, then a uniform per numerical parameter and candidate, and
    inverts each truncated normal's CDF by Newton's method until every value
    of that call converged. Here the same uniforms come from one
    `random_sample` (the legacy RandomState's stream is the same doubles
    whichever calls draw them), each draw keeps its own Newton stopping point,
    and every array operation is Optuna's: the samples are the ones the calls
    draw one after another (tests/resources/sweeps/test_batch_ask.py).

    Returns:
        per mixture, an array of `draws * size` rows (draw 0's `size` first), one column per parameter, in the
        transformed space `log_pdf` takes.
    """
    from optuna.samplers._tpe.probability_distributions import _BatchedCategoricalDistributions

    layout = []
    total = 0
    for mixture in mixtures:
        n_cat = sum(isinstance(d, _BatchedCategoricalDistributions) for d in mixture.distributions)
        n_num = len(mixture.distributions) - n_cat
        layout.append((total, n_cat, n_num))
        total += size * (1 + n_cat + (1 if n_num else 0) * n_num)
    uniforms = rng.random_sample(draws * total).reshape(draws, total)
    return [
        _sample(mixture, uniforms[:, start:], n_cat, n_num, draws, size)
        for mixture, (start, n_cat, n_num) in zip(mixtures, layout)
    ]


def _sample(mixture: Any, u: np.ndarray, n_cat: int, n_num: int, draws: int, size: int) -> np.ndarray:
    from optuna.samplers._tpe.probability_distributions import _BatchedCategoricalDistributions

    weights = np.asarray(mixture.weights, dtype=np.float64)
    cdf = weights.cumsum()
    cdf /= cdf[-1]
    active = np.asarray(
        cdf.searchsorted(np.ascontiguousarray(u[:, :size]), side="right"), dtype=np.int64
    )  # (draws, size), as RandomState.choice
    ret = np.empty((draws, size, len(mixture.distributions)), dtype=float)
    column = size
    numerical = []
    for i, d in enumerate(mixture.distributions):
        if isinstance(d, _BatchedCategoricalDistributions):
            quantile = u[:, column:column + size]
            column += size
            cum_probs = np.cumsum(d.weights[active, :], axis=-1)
            cum_probs[..., -1] = 1
            ret[..., i] = np.sum(cum_probs < quantile[..., np.newaxis], axis=-1)
        else:
            numerical.append((i, d))
    if numerical:
        q = np.ascontiguousarray(u[:, column:column + n_num * size]).reshape(draws, n_num, size)
        mus = np.stack([d.mu[active] for _, d in numerical], axis=1)  # (draws, n_num, size)
        sigmas = np.stack([d.sigma[active] for _, d in numerical], axis=1)
        lows = np.asarray([d.adapted_low for _, d in numerical])[np.newaxis, :, np.newaxis]
        highs = np.asarray([d.adapted_high for _, d in numerical])[np.newaxis, :, np.newaxis]
        a = (lows - mus) / sigmas
        b = (highs - mus) / sigmas
        groups = np.broadcast_to(np.arange(draws)[:, None, None], q.shape)
        values = (
            _ppf(q.ravel(), a.ravel(), b.ravel(), groups.ravel(), n_num * size).reshape(q.shape) * sigmas + mus
        ).transpose(0, 2, 1)
        for j, (i, d) in enumerate(numerical):
            column_values = np.ascontiguousarray(
                values[..., j]
            )  # contiguous as Optuna's: a strided exp may round differently
            if d.is_log:
                column_values = np.exp(column_values)
            if d.step != 0.0:
                column_values = np.clip(d.low + np.round((column_values - d.low) / d.step) * d.step, d.low, d.high)
            ret[..., i] = column_values
    return ret.reshape(draws * size, -1)


def _ppf(q: np.ndarray, a: np.ndarray, b: np.ndarray, groups: np.ndarray, chunk: int) -> np.ndarray:
    """Optuna's `_truncnorm.ppf` of flat arrays holding several calls' values at once (`groups`: the call of each,
    `chunk` values each)."""
    from optuna.samplers._tpe import _truncnorm

    case_left = a < 0
    case_right = ~case_left
    # Optuna's erf takes another formula from 2,000 values on (math.erf below, a polynomial above), which differ in
    # the last bits: in pieces of one call's size, every value goes the way it goes when its own call computes it.
    log_mass = (
        np.concatenate(
            [_truncnorm._log_gauss_mass(a[i : i + chunk], b[i : i + chunk]) for i in range(0, len(a), chunk)]
        )
        if len(a)
        else np.empty(0)
    )
    out = np.empty_like(q)
    if case_left.any():
        log_phi = _truncnorm._log_sum(_truncnorm._log_ndtr(a[case_left]), np.log(q[case_left]) + log_mass[case_left])
        out[case_left] = _ndtri_exp(log_phi, groups[case_left])
    if case_right.any():
        log_phi = _truncnorm._log_sum(
            _truncnorm._log_ndtr(-b[case_right]), np.log1p(-q[case_right]) + log_mass[case_right]
        )
        out[case_right] = -_ndtri_exp(log_phi, groups[case_right])
    out[q == 0] = a[q == 0]
    out[q == 1] = b[q == 1]
    out[a == b] = math.nan
    return out


def _ndtri_exp(y: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """Optuna's `_truncnorm._ndtri_exp` with each group's Newton iterations stopping when that group's have
    converged."""
    from optuna.samplers._tpe import _truncnorm

    flipped = y > -1e-2
    z = y.copy()
    z[flipped] = np.log(-np.expm1(y[flipped]))
    x = np.empty_like(y)
    if (small := np.nonzero(z < -5))[0].size:
        x[small] = -np.sqrt(-2.0 * (z[small] + _truncnorm._norm_pdf_logC))
    if (moderate := np.nonzero(z >= -5))[0].size:
        x[moderate] = -_truncnorm._ndtri_exp_approx_C * np.log(np.expm1(-z[moderate]))
    live = np.arange(len(y))
    for _ in range(100):
        xs, zs = x[live], z[live]
        log_ndtr_x = _truncnorm._log_ndtr(xs)
        log_norm_pdf_x = -0.5 * xs**2 - _truncnorm._norm_pdf_logC
        dx = (log_ndtr_x - zs) * np.exp(log_ndtr_x - log_norm_pdf_x)
        xs -= dx
        x[live] = xs
        unconverged = np.unique(groups[live][~(np.abs(dx) < 1e-8 * np.abs(xs))])
        live = live[np.isin(groups[live], unconverged)]
        if not live.size:
            break
    x[flipped] *= -1
    return x
