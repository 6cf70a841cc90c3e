"""Content deduplication: normalization, the LSH layout, the seen index and its Redis records."""

from __future__ import annotations

from datagen.hygiene.dedup import NearParams, SeenIndex, exact_digest, near_params, normalize_words
from datagen.hygiene.screen import Hygiene, HygieneRow
from datagen.states import DedupMode
from tests.support.planted import CONTAMINATED, NEAR_COPIES, ROWS, planted_rows


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def test_exact_digest_ignores_case_spacing_and_unicode_forms() -> None:
    # NFKC folds the full-width "Ａ" and the "ﬁ" ligature.
    assert exact_digest(_user("Ａ  ﬁne\tDay"), None) == exact_digest(_user("a fine day"), None)
    assert exact_digest(_user("a fine day"), None) != exact_digest(_user("a fine day!"), None)
    assert exact_digest(_user("hi"), None) != exact_digest([{"role": "system", "content": "hi"}], None)


def test_words_lose_punctuation() -> None:
    assert normalize_words("Hello, WORLD!  it's  (ok)") == ["hello", "world", "it", "s", "ok"]


def test_band_layout_follows_the_threshold() -> None:
    assert near_params(0.5) == NearParams(bands=25, rows=5)
    assert near_params(0.7) == NearParams(bands=16, rows=8)


def test_planted_near_copies_are_found_and_clean_rows_kept() -> None:
    rows = [HygieneRow(i, r["messages"], None) for i, r in enumerate(planted_rows(), start=1)]  # type: ignore[arg-type]
    verdicts = Hygiene(DedupMode.NEAR, 0.5).judge(rows, "upload")
    found = {line: fields["duplicate_of"] for line, fields in verdicts.rejected.items()}
    hits = sum(1 for line, kept in NEAR_COPIES.items() if found.get(line) == kept)
    clean = set(range(1, ROWS + 1)) - set(NEAR_COPIES) - set(CONTAMINATED)
    assert hits >= 0.95 * len(NEAR_COPIES)
    assert len(clean & set(found)) <= 0.005 * len(clean)
    assert found[111] == 14  # written by hand from NEAR_COPIES' layout


def test_chunks_and_reloaded_records_give_the_verdicts_of_one_pass() -> None:
    rows = [HygieneRow(i, r["messages"], None) for i, r in enumerate(planted_rows(), start=1)]  # type: ignore[arg-type]
    whole = Hygiene(DedupMode.NEAR, 0.5).judge(rows, "upload").rejected
    chunked = Hygiene(DedupMode.NEAR, 0.5)
    records = b""
    found: dict[int, dict[str, object]] = {}
    for start in range(0, len(rows), 100):
        if start == 300:  # a restart: a new index from the records stored so far
            chunked = Hygiene(DedupMode.NEAR, 0.5)
            chunked.seen.load(records)
        verdicts = chunked.judge(rows[start : start + 100], "upload")
        chunked.keep(verdicts)
        records += verdicts.record_bytes(chunked.bands)
        found.update(verdicts.rejected)
    assert found == whole
    assert len(records) == (ROWS - len(whole)) * (12 + 8 * 25) + 6 * (
        12 + 8 * 25
    )  # rows + a header per chunk


def test_another_upload_is_named_and_repeats_are_left_alone() -> None:
    hygiene = Hygiene(DedupMode.EXACT, 0.5)
    hygiene.keep(hygiene.judge([HygieneRow(3, _user("Same"), None)], "first"))
    rows = [HygieneRow(1, _user("same"), None), HygieneRow(2, _user("SAME "), None)]
    verdicts = hygiene.judge(rows, "second", repeats=frozenset({1}))
    assert {k: v["reason"] for k, v in verdicts.rejected.items()} == {
        2: "duplicate of line 3 of an earlier upload"
    }


def test_index_memory_per_row() -> None:
    index = SeenIndex(bands=25)
    index.add(1, [(d, d, [d * 31 + b for b in range(25)]) for d in range(1, 10_001)])
    assert index.find_exact([5, 10_001]) == [(5, 1), None]
    # 4 (line) + 4 (tag) + 12 (digest and ordinal) + 25 x 12 (band keys and ordinals) bytes a row.
    assert index.nbytes() == 10_000 * (4 + 4 + 12 + 25 * 12)
