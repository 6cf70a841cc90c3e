from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from datagen.errors import InvalidSpecError
from datagen.spec import JobSpec
from datagen_cli.specfile import EXAMPLE_SPEC, load_spec_file, merge_spec


def test_the_example_is_a_valid_spec_with_every_field() -> None:
    example = yaml.safe_load(EXAMPLE_SPEC)
    spec = JobSpec.model_validate(example)
    assert set(example) == set(JobSpec.model_fields)  # the example documents every field
    assert spec.sampling.temperature == 0.6 and spec.multi_turn.value == "last"


def test_flags_override_the_file_and_sampling_merges(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(
        "tokenizer: /models/x\nshort_max_new_tokens: 100\nsampling:\n  temperature: 0.2\n  top_p: 0.5\n"
    )
    merged = merge_spec(load_spec_file(path), {"short_max_new_tokens": 7, "sampling": {"temperature": 0.9}})
    assert merged == {
        "tokenizer": "/models/x",
        "short_max_new_tokens": 7,
        "sampling": {"temperature": 0.9, "top_p": 0.5},
    }


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("tokenizer: x\nmax_tokens: 5\n", "max_tokens"),  # unknown keys are refused
        ("tokenizer: x\nsampling: {top_p: 2}\n", "sampling.top_p"),
        ("- just\n- a list\n", "mapping"),
        ("tokenizer: [unclosed\n", "cannot read"),
    ],
)
def test_bad_spec_files_say_what_to_fix(tmp_path: Path, text: str, fragment: str) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(InvalidSpecError, match=fragment.replace(".", r"\.")):
        merge_spec(load_spec_file(path), {})
