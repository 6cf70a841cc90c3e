"""Benchmark decontamination: long n-gram overlap of user turns with benchmark prompts."""

from __future__ import annotations

import gzip
import hashlib
import json
import threading
from pathlib import Path

import pytest

from datagen.errors import InvalidSpecError
from datagen.hygiene.benchmark_sets import MAX_SET_LINE_BYTES, check_sets, sets_sha256
from datagen.hygiene.decontam import INDEX_CACHE, BenchmarkIndex, index_of
from datagen.hygiene.screen import Hygiene
from datagen.spec import DEFAULT_NGRAM, JobSpec, validate_spec
from tests.support.specs import make_spec

SENTENCE = "the quick brown fox jumps over the lazy dog while the cat sleeps on a warm mat"  # 17 words


def load_benchmarks(sources: list[str], n: int = DEFAULT_NGRAM) -> BenchmarkIndex:
    """The sets checked, then indexed as a job's hygiene indexes them (`Hygiene.for_spec`)."""
    return index_of(check_sets(sources), n)


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


def _write_set(path: Path, prompts: list[str]) -> None:
    path.write_text("".join(json.dumps({"id": f"q{i}", "prompt": p}) + "\n" for i, p in enumerate(prompts)))


def test_concurrent_loads_parse_a_set_once_and_a_changed_set_again(tmp_path: Path) -> None:
    path = tmp_path / "sets.jsonl"
    _write_set(path, [SENTENCE] * 2000)
    builds = INDEX_CACHE.builds
    found: list[object] = []
    start = threading.Barrier(8)

    def load() -> None:
        start.wait()
        found.append(load_benchmarks([str(path)]))

    threads = [threading.Thread(target=load) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(found) == 8 and all(index is found[0] for index in found)
    assert INDEX_CACHE.builds == builds + 1
    assert load_benchmarks([str(path)], n=8) is not found[0]  # another n, another index
    _write_set(path, [SENTENCE] * 2001)  # the same name, another content
    changed = load_benchmarks([str(path)])
    assert changed is not found[0] and len(changed) == 2001
    assert INDEX_CACHE.builds == builds + 3


def test_a_set_is_hashed_as_stored(tmp_path: Path) -> None:
    path = tmp_path / "sets.jsonl.gz"
    path.write_bytes(gzip.compress((json.dumps({"prompt": SENTENCE}) + "\n").encode()))
    (checked,) = check_sets([str(path)])
    assert checked.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert checked.to_json() == {"source": str(path), "sha256": checked.sha256, "bytes": path.stat().st_size}
    assert load_benchmarks([str(path)]).items[0][:2] == ("sets", "1")


def test_a_line_over_the_limit_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "long.jsonl"
    with path.open("wb") as fh:
        fh.write(b'{"prompt": "ok, a prompt long enough"}\n')
        fh.truncate(fh.tell() + MAX_SET_LINE_BYTES + 1)  # sparse, no newline
    with pytest.raises(InvalidSpecError, match="line 2 is longer than 16 MiB"):
        load_benchmarks([str(path)])


def test_an_ingestion_refuses_sets_other_than_its_manifest_pins(tmp_path: Path) -> None:
    path = tmp_path / "sets.jsonl"
    path.write_text(json.dumps({"id": "q1", "prompt": SENTENCE}) + "\n")
    spec = JobSpec.model_validate(make_spec(decontaminate=[str(path)]))
    pinned = sets_sha256(check_sets([str(path)]))
    assert Hygiene.for_spec(spec, pinned_sha256=pinned).benchmarks is not None
    path.write_text(
        json.dumps({"id": "q2", "prompt": SENTENCE + " again"}) + "\n"
    )  # changed after the submit
    with pytest.raises(InvalidSpecError, match="decontamination sets changed since the job was submitted"):
        Hygiene.for_spec(spec, pinned_sha256=pinned)
