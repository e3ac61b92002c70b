"""The kept-prefix budget (memory/kept.py): one set per model, all within the budget, the sets of
the models evicted longest ago given up first."""

from __future__ import annotations

from prism_serve.memory.kept import KeptBudget


def test_an_eviction_gets_at_least_half_the_budget_from_the_oldest_sets() -> None:
    budget: KeptBudget[str] = KeptBudget(100)
    assert budget.room("a") == (100, [])
    budget.keep("a", "a1", 40)
    assert budget.room("b") == (60, [])  # half or more is free: nothing goes
    budget.keep("b", "b1", 30)
    allowance, gone = budget.room("c")  # 30 free: a's (the oldest) goes
    assert (allowance, gone) == (70, ["a1"])
    budget.keep("c", "c1", 70)
    assert budget.used_bytes == 100 and budget.get("a") is None
    assert budget.take("c") == "c1" and budget.take("c") is None  # restored at its activation
    budget.keep("c", "c2", 60)
    # a model evicted again replaces its own set, which goes first; then the others until half is free
    allowance, gone = budget.room("b")
    assert (allowance, gone) == (100, ["b1", "c2"])
    assert budget.used_bytes == 0 and budget.items() == []


def test_a_budget_of_zero_keeps_nothing() -> None:
    budget: KeptBudget[str] = KeptBudget(0)
    assert budget.room("a") == (0, [])
