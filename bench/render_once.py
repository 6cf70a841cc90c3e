"""What a row's render costs: `PromptRenderer.render` rendering the template once, inside
transformers' own ``apply_chat_template`` (`datagen.prompts.template_budget.serving`), against the same
renderer rendering it twice (the budget's sandbox, then transformers: what it did before, and
still does where its probe fails) and against transformers' own ``apply_chat_template(tokenize=True)``
(what a hand-written script pays), measured in the same process on the same rows.

The three run in turn, ``--rounds`` times each, interleaved, so that a shared machine's drift
falls on all three alike; each line prints the fastest round and the median, in µs a row, and
the ratio to the two renders' (the baseline). The ids of all three are checked equal.

Run: ``python bench/render_once.py [--n 2000] [--rounds 9]``.
"""

from __future__ import annotations

import functools
import io
import statistics
from collections.abc import Callable

from _common import interleaved, job_spec, offline_hub, rounds_args, transformers_ids
from ingest_load import jsonl_lines

from datagen.prompts.dataset import Prompt, iter_prompts
from datagen.prompts.tokenization import renderer_for

DEFAULT_N = 2000
DEFAULT_ROUNDS = 9


def _rows(n: int) -> list[Prompt]:
    """`bench/ingest_load.py`'s one-turn rows, parsed as ingestion parses a JSONL line."""
    items = iter_prompts(io.BytesIO(b"".join(jsonl_lines(n))), multi_turn=job_spec().multi_turn)
    return [item for item in items if isinstance(item, Prompt)]


def _each(way: Callable[[Prompt], list[int]], prompts: list[Prompt]) -> list[list[int]]:
    return [way(p) for p in prompts]


def main() -> None:
    args = rounds_args(__doc__, DEFAULT_N, DEFAULT_ROUNDS)
    offline_hub()
    renderer = renderer_for(job_spec())
    prompts = _rows(args.n)
    renderer.render(prompts[0].messages)  # the probes, outside the timing
    if not renderer._renders_once():
        raise SystemExit("this renderer's probe failed: it renders twice whatever the bench does")

    def hooked(once: bool) -> Callable[[Prompt], list[int]]:
        def render(prompt: Prompt) -> list[int]:
            # The bench's one reach inside: the renderer's probe verdict, flipped to time both ways.
            renderer._once = once
            return renderer.render(prompt.messages, prompt.tools)

        return render

    ways: dict[str, Callable[[Prompt], list[int]]] = {
        "two renders (budget sandbox, then transformers)": hooked(False),
        "one render, inside transformers' call": hooked(True),
        "transformers' own apply_chat_template": lambda prompt: transformers_ids(renderer, prompt),
    }
    times, ids = interleaved(
        {name: functools.partial(_each, way, prompts) for name, way in ways.items()},
        args.rounds,
        len(prompts),
    )
    renderer._once = True
    first, *others = ids.values()
    if any(other != first for other in others):
        raise SystemExit("the three ways gave different ids")
    baseline = min(times["two renders (budget sandbox, then transformers)"])
    print(f"render_once: {args.n} rows x {args.rounds} rounds, interleaved; µs a row (fastest round, median)")
    for name, spent in times.items():
        fastest = min(spent)
        print(
            f"  {name:50s} {fastest:7.0f} {statistics.median(spent):7.0f}   "
            f"{baseline / fastest:.2f}x the two renders' rate"
        )
    print("  the same ids all three ways")


if __name__ == "__main__":
    main()
