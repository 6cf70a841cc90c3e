"""One resolver for tokenizer and template names, used by the allowlist check and the loaders alike."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from datagen.errors import InvalidSpecError
from datagen.prompts.sources import ResolvedSource, SourceKind, resolve_source
from datagen.prompts.tokenization import PromptRenderer, bundled_tokenizer_path, default_chat_template_path
from datagen.settings import CoordinatorSettings
from service.allowlist import check_allowed
from tests.support.specs import NO_CONTEXT_LEN, job_spec

SECRET = "TOP-SECRET-TEMPLATE-TEXT"


@pytest.fixture
def layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """A coordinator whose working directory lies inside its allowlisted prefix, and a $HOME outside."""
    allowed, home = tmp_path / "allowed", tmp_path / "home"
    (allowed / "work").mkdir(parents=True)
    (home / "tok").mkdir(parents=True)
    (home / "secret.jinja").write_text(SECRET + "{{ messages }}")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (home / "tok" / name).write_bytes((Path(bundled_tokenizer_path()) / name).read_bytes())
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(allowed / "work")
    return allowed, home


def _settings(allowlist: str) -> CoordinatorSettings:
    return CoordinatorSettings(tokenizer_allowlist=allowlist)


def test_tilde_is_the_coordinators_home_for_check_and_load(layout: tuple[Path, Path]) -> None:
    _, home = layout
    source = resolve_source("~/secret.jinja", SourceKind.TEMPLATE)
    assert source == ResolvedSource(
        "~/secret.jinja", SourceKind.TEMPLATE, path=os.path.realpath(home / "secret.jinja")
    )
    assert resolve_source("~/tok", SourceKind.TOKENIZER).path == os.path.realpath(home / "tok")


def test_a_template_in_home_is_refused_when_the_cwd_is_allowlisted(layout: tuple[Path, Path]) -> None:
    allowed, _ = layout
    with pytest.raises(InvalidSpecError, match=r"chat template '~/secret\.jinja' is not allowed") as info:
        check_allowed(job_spec(NO_CONTEXT_LEN, chat_template="~/secret.jinja"), _settings(str(allowed)))
    assert SECRET not in str(info.value)


def test_a_tokenizer_in_home_is_refused_when_the_cwd_is_allowlisted(layout: tuple[Path, Path]) -> None:
    allowed, _ = layout
    with pytest.raises(InvalidSpecError, match="tokenizer '~/tok' is not allowed"):
        check_allowed(job_spec(NO_CONTEXT_LEN, tokenizer="~/tok"), _settings(str(allowed)))


def test_a_relative_name_is_checked_and_loaded_from_the_working_directory(
    layout: tuple[Path, Path],
) -> None:
    allowed, _ = layout
    (allowed / "work" / "mine.jinja").write_text(default_chat_template_path().read_text())
    spec = job_spec(NO_CONTEXT_LEN, chat_template="mine.jinja")
    check_allowed(spec, _settings(str(allowed)))
    renderer = PromptRenderer(bundled_tokenizer_path(), chat_template_path="mine.jinja")
    # <｜begin▁of▁sentence｜> <｜User｜> "Hi" <｜Assistant｜> <think> "\n", ids written by hand.
    assert renderer.render([{"role": "user", "content": "Hi"}]) == [0, 128803, 23166, 128804, 128821, 201]


def test_an_unlisted_hub_id_is_refused_and_a_listed_one_passes(tmp_path: Path) -> None:
    with pytest.raises(InvalidSpecError, match="tokenizer 'someorg/somemodel' is not allowed"):
        check_allowed(job_spec(NO_CONTEXT_LEN, tokenizer="someorg/somemodel"), _settings(str(tmp_path)))
    # A path prefix never admits a hub id, and a hub id admits only itself.
    with pytest.raises(InvalidSpecError, match="not allowed"):
        check_allowed(job_spec(NO_CONTEXT_LEN, tokenizer="someorg/somemodel"), _settings("someorg/other,/"))
    check_allowed(job_spec(NO_CONTEXT_LEN, tokenizer="someorg/somemodel"), _settings("someorg/somemodel"))
    check_allowed(job_spec(NO_CONTEXT_LEN, tokenizer="someorg/somemodel"), _settings("*"))
    assert resolve_source("someorg/somemodel", SourceKind.TOKENIZER).hub_id == "someorg/somemodel"


@pytest.mark.parametrize("name", ["tok\x00/etc/passwd", "tok\nname", "tok\u202ename"])
def test_control_characters_in_a_name_are_a_spec_error(name: str) -> None:
    with pytest.raises(InvalidSpecError, match="control characters"):
        resolve_source(name, SourceKind.TOKENIZER)
    # The spec model refuses some of these itself; the check must hold on its own as well.
    spec = job_spec(NO_CONTEXT_LEN).model_copy(update={"chat_template": name})
    with pytest.raises(InvalidSpecError, match="control characters"):
        check_allowed(spec, _settings("*"))


def test_a_name_that_is_neither_a_path_nor_a_hub_id_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidSpecError, match="neither an existing local directory nor a hub id"):
        resolve_source("a/b/c", SourceKind.TOKENIZER)


def test_a_symlink_inside_an_allowlisted_prefix_cannot_point_outside(
    layout: tuple[Path, Path],
) -> None:
    allowed, home = layout
    (allowed / "link.jinja").symlink_to(home / "secret.jinja")
    with pytest.raises(InvalidSpecError, match="not allowed"):
        check_allowed(
            job_spec(NO_CONTEXT_LEN, chat_template=str(allowed / "link.jinja")), _settings(str(allowed))
        )
