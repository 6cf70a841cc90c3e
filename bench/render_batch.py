"""What ingestion pays a row beyond rendering it: `service.render_pool.render_batch` (parse the line,
judge the row by ingestion's rule, with its render and special-text scan, take its id) on batches of
256 JSONL lines, against `PromptRenderer.render` alone on the same rows (the raw tokenizer rate
`bench/ingest_load.py` divides by) and against the same steps run one row at a time (how
`render_batch` ran them before it ran each step over the whole batch: the baseline).

The three run in turn, ``--rounds`` times each, interleaved, so that a shared machine's drift falls
on all three alike; each line prints the fastest round and the median, in µs a row, and the ratio to
the raw render's fastest. The rows of the two batch ways are checked equal.

Run: ``python bench/render_batch.py [--n 5120] [--rounds 7]``.
"""

from __future__ import annotations

import hashlib
import statistics
from collections.abc import Callable

from _common import interleaved, job_spec, offline_hub, rounds_args
from ingest_load import jsonl_lines

from datagen.prompts.dataset import Prompt, line_items
from datagen.spec import JobSpec
from service.admit import AdmittedRow, ArmRenderers, admit_row, arm_renderers
from service.render_pool import (
    MAX_BATCH_LINES,
    LineBatch,
    RenderedRow,
    RowLine,
    _without_original,
    render_batch,
)
from service.rowids import row_id
from simulator.config import DEFAULT_CONTEXT_LEN as SIM_CONTEXT_LEN

DEFAULT_N = 5120
DEFAULT_ROUNDS = 7


def one_row_at_a_time(batch: LineBatch, spec: JobSpec, renderers: ArmRenderers) -> list[RenderedRow]:
    """`render_batch`'s steps for one-turn rows, each row through all of them before the next."""
    out = []
    for row in batch.lines:
        assert row.raw is not None
        first = line_items(row.raw, row.line, spec.multi_turn, row_index=row.row_index)[0]
        verdict = admit_row(first, spec, renderers, batch.context_len)
        ident = row_id(first) if isinstance(verdict, AdmittedRow) and isinstance(first, Prompt) else None
        shipped = _without_original(first) if isinstance(first, Prompt) else first
        out.append(RenderedRow(row.line, row.digest, shipped, None, verdict, ident))
    return out


def main() -> None:
    args = rounds_args(__doc__, DEFAULT_N, DEFAULT_ROUNDS)
    offline_hub()
    spec = job_spec()
    spec_json = spec.model_dump_json()
    lines = list(jsonl_lines(args.n))
    batches = [
        LineBatch(
            spec_json,
            "bench",
            SIM_CONTEXT_LEN,
            tuple(
                RowLine(start + i + 1, raw, start + i, hashlib.sha1(raw).hexdigest())
                for i, raw in enumerate(lines[start : start + MAX_BATCH_LINES])
            ),
        )
        for start in range(0, len(lines), MAX_BATCH_LINES)
    ]
    renderers = arm_renderers(spec)
    renderer = renderers(None)
    prompts = [line_items(raw, i + 1, spec.multi_turn)[0] for i, raw in enumerate(lines)]
    assert all(isinstance(p, Prompt) for p in prompts)
    stepwise = [r for b in batches for r in render_batch(b)]  # loads the job's renderers once
    rowwise = [r for b in batches for r in one_row_at_a_time(b, spec, renderers)]
    assert stepwise == rowwise, "the two ways' rows differ"

    ways: dict[str, Callable[[], object]] = {
        "raw: PromptRenderer.render alone": lambda: [
            renderer.render(p.messages, p.tools) for p in prompts if isinstance(p, Prompt)
        ],
        "render_batch, one row at a time (before)": lambda: [
            one_row_at_a_time(b, spec, renderers) for b in batches
        ],
        "render_batch, step by step": lambda: [render_batch(b) for b in batches],
    }
    times, _ = interleaved(ways, args.rounds, len(lines))
    raw = min(times["raw: PromptRenderer.render alone"])
    print(f"render_batch: {len(lines)} one-turn rows a round, {args.rounds} interleaved rounds, µs a row")
    for name, each in times.items():
        print(
            f"  {name:44s} {min(each):6.1f} (median {statistics.median(each):6.1f})  "
            f"{min(each) / raw:.2f}x the raw render"
        )


if __name__ == "__main__":
    main()
