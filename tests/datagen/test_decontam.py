"""Benchmark decontamination: long n-gram overlap of user turns with benchmark prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from datagen.decontam import load_benchmarks
from datagen.errors import InvalidSpecError
from datagen.spec import validate_spec

SENTENCE = "the quick brown fox jumps over the lazy dog while the cat sleeps on a warm mat"  # 17 words


def test_humaneval_ships_offline() -> None:
    index = load_benchmarks(["humaneval"])
    assert len(index) == 164
    assert index.items[0][:2] == ("humaneval", "HumanEval/0")


def test_thirteen_shared_words_match_twelve_do_not(tmp_path: Path) -> None:
    path = tmp_path / "sets.jsonl"
    rows = [
        {"id": "q1", "prompt": SENTENCE},
        {"question_id": 7, "turns": ["A first turn that is long enough here.", "second turn"]},
        {"messages": [{"role": "user", "content": "Name the largest planet please."}]},
        {"prompt": "too short"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    index = load_benchmarks([str(path)])
    assert (len(index), index.skipped) == (3, 2)  # "second turn" and "too short" are under 5 words
    words = SENTENCE.split()
    found = index.match(["Intro sentence. " + " ".join(words[2:15]).upper() + "! Outro."])
    assert found is not None and found.reason == "contaminated: sets q1"
    assert index.match([" ".join(words[2:14])]) is None
    # A prompt shorter than 13 words matches whole; the item id falls back to the line number.
    assert index.match(["x", "Please: name the LARGEST planet, please?"]).item == "3"  # type: ignore[union-attr]
    assert index.match(["a first turn that is long enough here"]).item == "7"  # type: ignore[union-attr]


def test_bad_sets_say_what_to_fix(tmp_path: Path) -> None:
    with pytest.raises(InvalidSpecError, match="cannot read"):
        load_benchmarks([str(tmp_path / "missing.jsonl")])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\n')
    with pytest.raises(InvalidSpecError, match='line 1 has no "prompt"'):
        load_benchmarks([str(bad)])
    with pytest.raises(InvalidSpecError, match="neither a built-in set"):
        validate_spec({"tokenizer": "t", "decontaminate": ["relative.jsonl"]})
