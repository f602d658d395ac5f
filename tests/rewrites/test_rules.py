"""Every rewrite rule is a true identity: apply it to its small random instance in an
e-graph of its own and compare every resulting form numerically with the original."""

from __future__ import annotations

import egglog.bindings as egg
import numpy as np
import pytest

from cherenkov.rewrites import terms as t
from cherenkov.rewrites.derive import RULESETS, program_for
from cherenkov.rewrites.language import prelude
from cherenkov.rewrites.lower import Lowered
from cherenkov.rewrites.reference import evaluate_term
from cherenkov.rewrites.rule import Rule, Ruleset

CASES = [(ruleset, rule) for ruleset in RULESETS for rule in ruleset.rules]


def random_inputs(term: tuple, positive: tuple[str, ...], seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    arrays = {}
    for sub in t.subterms(term):
        if sub[0] == "Tensor" and sub[1] not in arrays:
            shape = tuple(t.extent(ix[1]) for ix in t.ix_items(sub[2]))
            values = rng.standard_normal(shape)
            arrays[sub[1]] = np.abs(values) + 0.5 if sub[1] in positive else values
    return arrays


def rewritten_forms(ruleset: Ruleset, rule: Rule) -> tuple[list[tuple], int]:
    """All root forms of the rule's example after running only that rule."""
    example = rule.example
    assert example is not None, f"rule {rule.name} has no example"
    lowered = Lowered({"ex": example.term}, {"ex": ()}, ("ex",), dict.fromkeys(example.eight_bit, "fp8_e4m3"), {})
    lets, roots = program_for(lowered)
    single = Ruleset(ruleset.name, ruleset.doc, (rule,))
    egraph = egg.EGraph()
    egraph.parse_and_run_program("\n".join([prelude(), single.egglog(), lets]))
    run = f"(run-schedule (repeat 3 (seq (saturate analysis) (run {ruleset.name}))))"
    report = egraph.parse_and_run_program(run)[-1].report
    variants = egraph.parse_and_run_program(f"(extract {roots['ex']} 64)")[-1]
    forms = [t.from_termdag(variants.termdag, term) for term in variants.terms]
    return forms, report.num_matches_per_rule.get(rule.name, 0)


@pytest.mark.parametrize(("ruleset", "rule"), CASES, ids=[rule.name for _, rule in CASES])
def test_rule_is_an_identity_on_random_inputs(ruleset: Ruleset, rule: Rule) -> None:
    assert rule.doc and "\n" not in rule.doc, "each rule states its identity in one line"
    forms, matches = rewritten_forms(ruleset, rule)
    assert matches > 0, f"{rule.name} did not match its own example"
    assert len(forms) >= 2, f"{rule.name} added no new form"
    example = rule.example
    axes = tuple(sorted(t.free_axes(example.term)))
    extents = {a: t.extent(a) for a in axes}
    for seed in range(3):
        inputs = random_inputs(example.term, example.positive, seed)
        expected = evaluate_term(example.term, inputs, axes, extents)
        finite = np.isfinite(expected)
        assert not np.isnan(expected).any() and finite.any()
        for form in forms:
            got = evaluate_term(form, inputs, axes, extents)
            assert np.array_equal(got[~finite], expected[~finite]), f"{rule.name}: masked entries differ"
            error = np.linalg.norm(got[finite] - expected[finite]) / np.linalg.norm(expected[finite])
            assert error <= rule.tolerance, f"{rule.name}: {t.show(form)} differs by {error:.2e}"


def test_rule_names_are_unique() -> None:
    names = [rule.name for _, rule in CASES]
    assert len(names) == len(set(names))


def test_every_ruleset_has_a_docstring_line() -> None:
    for ruleset in RULESETS:
        assert ruleset.doc.strip()


@pytest.mark.parametrize("splits", [2, 3, 5, 9])
def test_split_fold_equals_the_fold_even_where_a_chunk_is_masked_out(splits: int) -> None:
    """The split-KV reference (rule flash-split-kv's semantics) against the plain fold on causal
    scores: early queries see no key of the later chunks (log-sum-exp −∞, weight 0)."""
    from cherenkov.rewrites.reference import NumpyArrays, softmax_fold, split_fold

    rng = np.random.default_rng(splits)
    scores, values = rng.standard_normal((9, 9)), rng.standard_normal((9, 1, 4))
    scores = np.where(np.arange(9)[None, :] > np.arange(9)[:, None], -np.inf, scores)[:, :, None]  # (i, j, 1)
    arrays = NumpyArrays()
    values = values.transpose(1, 0, 2)  # (1, j, e)
    _, l, acc = softmax_fold(arrays, scores, values, 1, None)
    split = split_fold(arrays, scores, values, 1, splits, None)
    assert np.isfinite(split).all()
    np.testing.assert_allclose(split, acc / l, rtol=1e-12, atol=1e-12)
