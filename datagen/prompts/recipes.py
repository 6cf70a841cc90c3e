"""Which arm of a job's recipe each (prompt, sample) runs under: the one rule, for ingestion, a
rebuild from storage, the dry run and the tests.

The assignment depends only on the spec and the row, never on what ran before, so a resubmitted
or rebuilt job gives every sample the arm it had:

- ``weighted``: arm ``a`` with probability ``weight_a / sum(weights)``, drawn from the sha256 of the
  recipe's seed, the row's sample id and the sample's gen. A row keeps its arm wherever it sits in
  the file, and another seed gives another draw.
- ``cycle``: the i-th (row, sample) of an input file, in file order (``i = row_index * samples +
  gen``, ``row_index`` counting the file's non-blank lines from 0), gets arm ``i mod k``. Shares are
  exact over the file; with as many samples as arms, every row runs under every arm.

All turns of a row share its arm (multi-turn ``all`` keeps a conversation in one mode). A job
without a recipe never runs this module: its samples have no arm.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools

from datagen.spec import Arm, JobSpec, RecipeAssign, RecipeSpec

__all__ = ["arm_shares", "arms_of_row", "assign_arm"]

_DRAW_BYTES = 8
_DRAW_SPAN = float(2 ** (8 * _DRAW_BYTES))


def _draw(seed: int, sample_id: str, gen: int) -> float:
    """A uniform number in [0, 1) fixed by its arguments."""
    text = f"{seed}\x00{sample_id}\x00{gen}".encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:_DRAW_BYTES], "big") / _DRAW_SPAN


def arm_shares(recipe: RecipeSpec) -> dict[str, float]:
    """Each arm's expected share of the samples."""
    if recipe.assign is RecipeAssign.CYCLE:
        return {arm.name: 1 / len(recipe.arms) for arm in recipe.arms}
    total = sum(arm.weight for arm in recipe.arms)
    return {arm.name: arm.weight / total for arm in recipe.arms}


def assign_arm(recipe: RecipeSpec, *, sample_id: str, gen: int, row_index: int, samples: int) -> Arm:
    """The arm of sample ``gen`` of the row at ``row_index`` (0-based, in its file) whose id is
    ``sample_id``; ``samples``: the job's samples per row."""
    arms = recipe.arms
    if recipe.assign is RecipeAssign.CYCLE:
        return arms[(row_index * samples + gen) % len(arms)]
    bounds = list(itertools.accumulate(arm.weight for arm in arms))
    point = _draw(recipe.seed, sample_id, gen) * bounds[-1]
    return arms[min(bisect.bisect_right(bounds, point), len(arms) - 1)]


def arms_of_row(spec: JobSpec, *, sample_id: str, row_index: int) -> list[Arm | None]:
    """The arm of each of a row's samples, gen 0 to ``spec.samples - 1`` (None without a recipe)."""
    recipe = spec.recipe
    if recipe is None:
        return [None] * spec.samples
    return [
        assign_arm(recipe, sample_id=sample_id, gen=gen, row_index=row_index, samples=spec.samples)
        for gen in range(spec.samples)
    ]
