"""The pruning_savings benchmark's accounting, on tiny sweeps (real trials, real pruning callback)."""

from __future__ import annotations

import pytest

from bench import pruning_savings as ps


def test_epochs_to_counts_every_epoch_until_the_first_reach() -> None:
    curves = [[0.1, 0.2], [0.3, 0.9, 0.95], [0.99]]
    assert ps._epochs_to(curves, 0.9) == 4
    assert ps._epochs_to(curves, 0.99) == 6
    assert ps._epochs_to(curves, 1.0) is None


def test_a_tiny_pair_of_sweeps_charges_the_pruned_sweep_honestly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ps, "N_TRIALS", 6)
    monkeypatch.setattr(ps, "CAP_TRIALS", 8)
    monkeypatch.setattr(ps, "MAX_EPOCHS", 3)
    seen: list[tuple[bool, dict, list[float]]] = []
    fit = ps._fit

    def recording_fit(params: dict, data: object, pruning: object) -> list[float]:
        curve = fit(params, data, pruning)
        seen.append((pruning is not None, dict(params), curve))
        return curve

    monkeypatch.setattr(ps, "_fit", recording_fit)
    run = ps._pair(0)
    full = [(p, c) for pruned, p, c in seen if not pruned]
    cut = [(p, c) for pruned, p, c in seen if pruned]
    assert len(full) == 6 and all(len(c) == 3 for _, c in full)
    assert 6 <= len(cut) <= 8 and run["pruned_sweep_trials"] == len(cut)
    # same trials in the same order, and a trial follows the same curve until it is pruned
    for (p_full, c_full), (p_cut, c_cut) in zip(full, cut):
        assert p_full == p_cut and c_cut == c_full[: len(c_cut)]
    assert run["pruned_trials_of_first"] >= 1  # 2 startup trials, no warm-up: someone falls below the median
    assert run["unpruned_epochs"] == 18 and run["pruned_epochs_spent"] == sum(len(c) for _, c in cut)
    bar = max(max(c) for _, c in full)
    assert run["unpruned_best"] == round(bar, 4)
    assert run["unpruned_epochs_to_best"] == ps._epochs_to([c for _, c in full], bar)
    assert run["reached"] and len(cut) == 6  # reached: the pruned sweep stops at the unpruned budget
    assert run["pruned_charged"] == run["pruned_epochs_to_best"] == ps._epochs_to([c for _, c in cut], bar)


def test_a_pruned_sweep_that_misses_the_target_goes_on_to_the_cap(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setattr(ps, "N_TRIALS", 4)
    monkeypatch.setattr(ps, "CAP_TRIALS", 7)
    monkeypatch.setattr(ps, "MAX_EPOCHS", 2)
    data = ps._data()
    (tmp_path / "a").mkdir()
    missed = ps._sweep(tmp_path / "a", 0, True, data, bar=1.01)  # no trial can reach 101 %
    assert len(missed["curves"]) == 7
    (tmp_path / "b").mkdir()
    hit = ps._sweep(tmp_path / "b", 0, True, data, bar=0.0)  # the first epoch reaches it
    assert len(hit["curves"]) == 4
