"""The sampling defaults a checkpoint's ``generation_config.json`` recommends; torch-free.

    defaults = read_sampling_defaults(model_dir)     # SamplingDefaults(temperature=0.7, ...)
    defaults.unsupported                             # ("repetition_penalty=1.05",) or ()

vLLM (with its default ``--generation-config auto``) takes ``temperature``, ``top_p``,
``top_k``, ``min_p``, ``repetition_penalty`` and ``max_new_tokens`` from this file as the
defaults of requests that omit them. We implement the first three and ``max_new_tokens``. A
field that would change which tokens are picked and that we do not implement (a repetition
penalty, min-p, typical-p, beam search, banned or forced tokens, ...) is listed in
``unsupported`` with its value, so a server can refuse to start rather than sample differently
from what the checkpoint's authors set. Fields that do not change sampling (token ids, cache
and output options, ``transformers_version``) are not read; ``eos_token_id`` is the model
config's business (``ModelConfig``).

``do_sample`` is not read either, as in vLLM: a request that omits ``temperature`` samples at
the file's temperature (or 1) even where the file says ``do_sample: false``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dualpath.errors import CheckpointError

GENERATION_CONFIG_FILE = "generation_config.json"

# Field -> its values that change nothing (None, absent and these are all neutral). Any other
# value changes which tokens are generated in a way the engine does not implement.
_NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "repetition_penalty": (1.0,),
    "encoder_repetition_penalty": (1.0,),
    "min_p": (0.0,),
    "top_h": (),
    "typical_p": (1.0,),
    "epsilon_cutoff": (0.0,),
    "eta_cutoff": (0.0,),
    "no_repeat_ngram_size": (0,),
    "encoder_no_repeat_ngram_size": (0,),
    "bad_words_ids": ([],),
    "force_words_ids": ([],),
    "constraints": ([],),
    "suppress_tokens": ([],),
    "begin_suppress_tokens": ([],),
    "sequence_bias": ({},),
    "forced_bos_token_id": (),
    "forced_eos_token_id": (),
    "exponential_decay_length_penalty": (),
    "guidance_scale": (1.0,),
    "num_beams": (1,),
    "num_beam_groups": (1,),
    "diversity_penalty": (0.0,),
    "penalty_alpha": (0.0,),  # contrastive search
    "dola_layers": (),
    "min_new_tokens": (0,),
    "min_length": (0,),  # counts the prompt too
    "stop_strings": ([],),
    "watermarking_config": (),
}


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """Values for requests that omit them; None = the file does not set it (our default)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # 0 = off (the file's -1 is read as 0)
    max_tokens: int | None = None  # the file's max_new_tokens
    # "name=value" of each field that would change sampling and is not implemented.
    unsupported: tuple[str, ...] = ()

    def describe(self) -> str:
        """The defaults set, e.g. "temperature=0.7 top_p=0.8" ("" if none)."""
        names = ("temperature", "top_p", "top_k", "max_tokens")
        return " ".join(f"{n}={getattr(self, n)}" for n in names if getattr(self, n) is not None)


def read_sampling_defaults(model_dir: Path) -> SamplingDefaults:
    """The defaults of ``model_dir/generation_config.json`` (none without the file);
    ``CheckpointError`` for a file that is not JSON or a value of the wrong type or range."""
    path = Path(model_dir) / GENERATION_CONFIG_FILE
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return SamplingDefaults()
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot be parsed as JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    top_k = _value(path, raw, "top_k", int, lambda v: v >= -1, ">= -1")
    return SamplingDefaults(
        temperature=_value(
            path, raw, "temperature", float, lambda v: math.isfinite(v) and v >= 0, ">= 0"
        ),
        top_p=_value(path, raw, "top_p", float, lambda v: 0 < v <= 1, "in (0, 1]"),
        top_k=None if top_k is None else max(top_k, 0),
        max_tokens=_value(path, raw, "max_new_tokens", int, lambda v: v >= 1, ">= 1"),
        unsupported=tuple(
            f"{name}={json.dumps(raw[name])}"
            for name, neutral in _NEUTRAL_VALUES.items()
            if raw.get(name) is not None and raw[name] not in neutral
        ),
    )


def _value(path: Path, raw: dict, name: str, kind: type, is_valid: Any, bound: str) -> Any:
    value = raw.get(name)
    if value is None:
        return None
    # JSON's 1 is a fine float; true is not a number, and 1.5 is not an integer.
    is_kind = isinstance(value, (int, float) if kind is float else int)
    if isinstance(value, bool) or not is_kind or not is_valid(value):
        raise CheckpointError(f"{path}: {name} must be a {kind.__name__} {bound}, got {value!r}")
    return kind(value)
