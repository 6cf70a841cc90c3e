"""The recipes page's YAML examples are specs the coordinator accepts, and assign arms as the page
says: a spec example that drifted from the code would teach users a refused spec."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from datagen.prompts.recipes import arm_shares, arms_of_row
from datagen.spec import JobSpec, validate_spec

PAGE = Path(__file__).resolve().parents[1] / "docs" / "user" / "recipes.md"
YAML_BLOCK = re.compile(r"```yaml\n(.*?)\n```", re.DOTALL)


def _specs() -> list[JobSpec]:
    specs = []
    for block in YAML_BLOCK.findall(PAGE.read_text(encoding="utf-8")):
        data = yaml.safe_load(block)
        specs.append(validate_spec({"tokenizer": "a/tokenizer", **data}))
    return specs


def test_every_yaml_example_is_a_valid_spec_with_a_recipe() -> None:
    specs = _specs()
    assert len(specs) >= 3
    assert all(spec.recipe is not None for spec in specs)


def test_the_gpt_oss_mixture_draws_low_medium_high_four_four_two() -> None:
    mixtures = [s for s in _specs() if s.recipe is not None and len(s.recipe.arms) == 3]
    shares = [
        arm_shares(s.recipe) for s in mixtures if s.recipe is not None and s.recipe.assign == "weighted"
    ]
    assert {"low": 0.4, "medium": 0.4, "high": 0.2} in shares


def test_the_cycle_example_runs_every_row_under_every_arm() -> None:
    cycles = [s for s in _specs() if s.recipe is not None and s.recipe.assign == "cycle"]
    assert cycles
    for spec in cycles:
        assert spec.recipe is not None and spec.samples == len(spec.recipe.arms)
        for row in range(4):
            arms = arms_of_row(spec, sample_id=f"s{row}", row_index=row)
            assert [a.name for a in arms if a is not None] == [a.name for a in spec.recipe.arms]
