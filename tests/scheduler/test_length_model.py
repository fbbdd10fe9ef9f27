"""The length model ranks requests for every history-driven policy: if these break,
longest-first becomes random-first."""

import pytest

from services.scheduler.length_model import LengthModel, accuracy
from services.scheduler.policies.base import Request
from services.scheduler.simulator import synthetic_workload


def req(prompt="p", step="s", i=0, generated=0, max_tokens=1000):
    return Request(step, prompt, i, 10, max_tokens, num_generated=generated)


def test_history_prediction_is_the_recency_weighted_mean_above_what_was_generated():
    model = LengthModel({"p": [[100, 300], [200]]}, recency=0.5)  # newest epoch first
    assert model.predict(req()) == pytest.approx((100 + 300 + 0.5 * 200) / 2.5)
    assert model.predict(req(generated=150)) == pytest.approx((300 + 0.5 * 200) / 1.5)
    assert model.predict(req(generated=300)) == 1000  # outgrew every past sample: assume the cap


def test_finished_siblings_join_the_history_of_their_group_only():
    model = LengthModel({"p": [[100, 100, 100]]})
    model.observe(req(step="s1", i=1), 140)
    assert model.predict(req(step="s1")) == pytest.approx(140)  # the longest sibling is a floor
    model.observe(req(step="s1", i=2), 60)
    assert model.predict(req(step="s1")) == pytest.approx(140)
    assert model.predict(req(step="s2")) == 100
    model.forget_step("s1")
    assert model.predict(req(step="s1")) == 100


def test_a_sibling_that_outruns_the_history_pulls_its_group_up():
    """A scout still running at 600 tokens when history says 100: its queued siblings are
    predicted at least 600, not 100 (the prompt changed since the last epoch)."""
    model = LengthModel({"p": [[100, 120], [90]]})
    scout = req(step="s1", i=0, generated=600)
    assert model.observe_progress(scout)
    assert not model.observe_progress(req(step="s1", i=3, generated=200))  # not further
    assert model.predict(req(step="s1", i=1)) == 600
    assert model.predict(req(step="s2", i=1)) == pytest.approx((100 + 120 + 0.5 * 90) / 2.5)
    assert LengthModel().predict(req(step="s1", i=1)) == 1000  # without history: Seer's rule, untouched
    model.forget_step("s1")
    assert model.predict(req(step="s1", i=1)) == pytest.approx((100 + 120 + 0.5 * 90) / 2.5)


def test_without_history_seer_rule_then_prior():
    """First epoch: longest finished sibling, max_tokens while none finished (Seer)."""
    model = LengthModel()
    assert model.predict(req()) == 1000
    model.observe(req(i=1), 40)
    model.observe(req(i=2), 70)
    assert model.predict(req()) == 70
    assert model.predict(req(generated=70)) == 1000
    assert LengthModel(prior=250).predict(req(prompt="q")) == 250
    with_history = LengthModel({"p": [[10]]})
    assert with_history.predict(req(), use_history=False) == 1000


def test_cap_hit_rate_counts_runaways_in_history():
    model = LengthModel({"p": [[1000, 5], [1000, 5]]}, recency=0.5)
    assert model.cap_hit_rate("p", 1000) == pytest.approx(0.5)
    assert model.cap_hit_rate("q", 1000) is None


def test_accuracy_on_a_hand_example_with_ties():
    acc = accuracy([1, 2, 2, 4], [10, 20, 30, 40])
    # ranks of predictions with ties: 0, 1.5, 1.5, 3 against 0, 1, 2, 3
    assert acc.spearman == pytest.approx(0.9486832980505138)
    assert acc.mean_abs_error == pytest.approx((9 + 18 + 28 + 36) / 4)
    assert acc.mean_rel_error == pytest.approx((0.9 + 0.9 + 28 / 30 + 0.9) / 4)
    with pytest.raises(ValueError):
        accuracy([1, 2], [1])


def test_history_ranks_a_correlated_synthetic_workload():
    """Three epochs of history predict epoch 3's lengths with rank correlation > 0.6,
    and more recent epochs weigh more (lengths drift upward during RL)."""
    workload = synthetic_workload(200, n=16, num_epochs=4, seed=3, runaway_prob=0.0)
    step = workload.step(3)
    true = [step.true_len[r.key] for r in step.requests]
    recent = LengthModel(step.history, recency=0.5)
    flat = LengthModel(step.history, recency=1.0)
    acc = accuracy([recent.predict(r) for r in step.requests], true)
    assert acc.spearman > 0.6
    assert acc.mean_abs_error < accuracy([flat.predict(r) for r in step.requests], true).mean_abs_error
    no_history = accuracy([LengthModel().predict(r) for r in step.requests], true)
    assert acc.mean_rel_error < no_history.mean_rel_error / 5
