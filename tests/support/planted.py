"""A planted dataset for the hygiene tests: distinct prompts, edited copies of some of them (case,
spacing, punctuation, two words replaced) and benchmark prompts wrapped in a sentence before and
after. Deterministic (fixed seed); where the plants go is written by hand in :data:`NEAR_COPIES` and
:data:`CONTAMINATED`."""

from __future__ import annotations

import json
import random
from pathlib import Path

SEED = 20251201
ROWS = 600
# Line of an edited copy -> line of the row it copies (both 1-based; every source is a clean row).
NEAR_COPIES = {
    **{line: line - 97 for line in range(101, 500, 10)},  # 40 copies: 101 <- 4, 111 <- 14, ... 491 <- 394
}
# Line -> item of the benchmark file (tests write it with write_benchmark) embedded in that row.
CONTAMINATED = {line: f"B{(line - 505) // 5}" for line in range(505, 600, 5)}  # 19 rows: 505 <- B0, ...
BENCHMARK_ITEMS = 40

_COMMON = (
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "with",
    "was",
    "on",
    "be",
    "by",
    "this",
    "are",
    "or",
    "from",
    "at",
    "an",
    "but",
    "not",
    "have",
    "which",
    "you",
    "can",
    "how",
    "what",
    "why",
    "when",
    "explain",
    "write",
    "describe",
    "list",
    "give",
    "show",
    "make",
    "use",
    "find",
    "help",
    "need",
    "want",
)
_SYLLABLES = ("ka", "lo", "mi", "ren", "to", "sa", "vel", "di", "mor", "an", "pe", "tu", "gri", "os", "nel")
_FILL = ("really", "quite", "very", "clearly", "simply", "briefly", "carefully", "gently")


def _vocabulary(rng: random.Random) -> list[str]:
    words = {"".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4))) for _ in range(4000)}
    return sorted(words)


def _text(rng: random.Random, vocabulary: list[str], low: int, high: int) -> str:
    words = [
        rng.choice(_COMMON) if rng.random() < 0.3 else rng.choice(vocabulary)
        for _ in range(rng.randint(low, high))
    ]
    return " ".join(words).capitalize() + "."


def near_copy(text: str, rng: random.Random) -> str:
    """Case, spacing and punctuation edited, two words replaced."""
    words = text.split()
    for _ in range(2):
        words[rng.randrange(len(words))] = rng.choice(_FILL)
    edited = " ".join(w.upper() if rng.random() < 0.2 else w for w in words)
    return "  " + edited.replace(" ", "   ", 3).replace(".", "!") + " ?"


def benchmark_prompts() -> list[str]:
    rng = random.Random(SEED + 1)
    vocabulary = _vocabulary(rng)
    return [_text(rng, vocabulary, 20, 50) for _ in range(BENCHMARK_ITEMS)]


def write_benchmark(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for i, prompt in enumerate(benchmark_prompts()):
            fh.write(json.dumps({"id": f"B{i}", "prompt": prompt}) + "\n")


def planted_rows() -> list[dict[str, object]]:
    rng = random.Random(SEED)
    vocabulary = _vocabulary(rng)
    items = {f"B{i}": p for i, p in enumerate(benchmark_prompts())}
    texts: dict[int, str] = {}
    for line in range(1, ROWS + 1):
        if line in NEAR_COPIES:
            texts[line] = near_copy(texts[NEAR_COPIES[line]], rng)
        elif line in CONTAMINATED:
            texts[line] = f"Here is a task for you. {items[CONTAMINATED[line]]} Please answer carefully."
        else:
            texts[line] = _text(rng, vocabulary, 15, 60)
    return [
        {"id": f"r{line}", "messages": [{"role": "user", "content": text}], "partition": f"p{line % 2}"}
        for line, text in texts.items()
    ]


def write_planted(path: Path) -> None:
    with path.open("w", encoding="utf-8") as fh:
        for row in planted_rows():
            fh.write(json.dumps(row) + "\n")
