"""`make run`'s summary: one row per step and a total, computed from the step stats."""

from devtools.run_summary import summary, table


def row(step, generated, accepted, verifies, hits):
    return dict(step=step, reward=0.1 * step, mean_length=50.0, history_hit_rate=hits,
                history_match=float("nan") if step == 0 else 0.5, acceptance_rate=0.25, makespan_s=1.5,
                num_generated_tokens=generated, num_accepted_tokens=accepted, num_verify_steps=verifies)


def test_table_rows_and_totals():
    lines = table([row(0, 100, 20, 0, 0.0), row(1, 200, 120, 60, 1.0)]).splitlines()
    assert lines[0].split()[:4] == ["step", "reward", "mean", "len"]
    assert lines[1].split() == ["0", "0.000", "50", "0%", "-", "-", "25%", "1.5", "100", "20", "80"]
    assert lines[2].split() == ["1", "0.100", "50", "100%", "50%", "2.00", "25%", "1.5", "200", "120", "80"]
    assert lines[3].split() == ["all", "3.0", "300", "140", "160"]


def test_summary_explains_the_columns_and_the_cost_mode():
    rows = [row(0, 100, 20, 10, 0.0), row(1, 200, 120, 60, 1.0)]
    text = summary(rows, measure_cost=False)
    for term in ("reward", "mean len", "hist hits", "hist match", "acc/verify", "acceptance", "step s", "tokens"):
        assert f"\n  {term}" in text
    assert "60% of their" in text and "docs/cost-model.md" in text
    assert "measured this machine" in summary(rows, measure_cost=True)
    assert "grpo_trainer.py" in text and "benchmarks/results" in text


def test_summary_says_what_it_does_not_compare_and_points_at_nothing_stopped():
    text = summary([row(0, 100, 20, 10, 0.0), row(1, 200, 120, 60, 1.0)], measure_cost=False)
    assert "does not time a rollout without drafts" in text and "engine_bench" in text
    assert "costs about one;" not in text and "draft tokens" in text
    for term in ("`loss`", "`update`", "`-> vN`", "`greedy reward`"):
        assert term in text
    assert "the services are stopped now" in text
