"""Pooling (the `pooling` runner): how a decoder's hidden states become one vector.

    --runner pooling                       every request is prefilled, never decoded
    --pooler-config '{"pooling_type": "MEAN", "normalize": false}'   overrides the model's

Resolution, first that applies (vLLM's order):
1. `--pooler-config` (each key it sets);
2. the model's sentence-transformers files: `modules.json` names a
   `sentence_transformers.models.Pooling` module whose `config.json` sets one
   `pooling_mode_*` (lasttoken -> LAST, mean_tokens -> MEAN, cls_token -> CLS), and a
   `sentence_transformers.models.Normalize` module turns normalisation on;
3. LAST with normalisation.

Matryoshka models (`is_matryoshka` or `matryoshka_dimensions` in config.json or
config_sentence_transformers.json) accept `dimensions`: the vector is cut to its
first d values and normalised again when the model normalises. Other models refuse it.

This module holds the rules every process shares: the worker pools with
`PoolingSpec`, the scheduler picks the prefix-cache rule by its type, the frontend and
the offline API check `dimensions` and shape the output.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

import numpy as np

from kvflow.errors import ConfigError, InvalidRequestError
from kvflow.json_options import json_options

if TYPE_CHECKING:
    from kvflow.config import EngineConfig

PoolingType = Literal["LAST", "MEAN", "CLS"]
POOLING_TYPES: tuple[str, ...] = ("LAST", "MEAN", "CLS")
Runner = Literal["generate", "pooling"]

_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"
# sentence-transformers' pooling_mode_* key -> ours (the modes kvflow pools by).
_ST_MODES = {
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
}


@dataclass(frozen=True)
class PoolerConfig:
    """`--pooler-config`: what to override (None: the model's own, or the default)."""

    pooling_type: PoolingType | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ConfigError(
                f"pooler_config pooling_type must be one of {', '.join(POOLING_TYPES)}, "
                f"got {self.pooling_type!r}"
            )
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ConfigError(
                f"pooler_config normalize must be true or false, got {self.normalize!r}"
            )

    @classmethod
    def parse(cls, value: str | dict[str, Any] | PoolerConfig) -> PoolerConfig:
        """From JSON text (the flag), a dict (`LLM(pooler_config={...})`) or itself;
        unknown keys are errors."""
        if isinstance(value, PoolerConfig):
            return value
        options = json_options(value, cls, "pooler_config", required=())
        pooling_type = options.get("pooling_type")
        if isinstance(pooling_type, str):  # checked in __post_init__
            pooling_type = pooling_type.upper()
        return cls(pooling_type=cast(PoolingType, pooling_type), normalize=options.get("normalize"))


def parse_pooler_config(text: str) -> PoolerConfig:
    """argparse `type=` of `--pooler-config`: a bad value is a usage error."""
    try:
        return PoolerConfig.parse(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


@dataclass(frozen=True)
class PoolingParams:
    """Per request (`LLM.embed`): `dimensions` cuts a Matryoshka model's vector."""

    dimensions: int | None = None


@dataclass(frozen=True)
class PoolingSpec:
    """The resolved pooler of a served model."""

    pooling_type: PoolingType = "LAST"
    normalize: bool = True
    hidden_size: int = 0  # the vector's length
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None  # None: any d <= hidden_size

    @property
    def needs_every_position(self) -> bool:
        """MEAN reads every prompt position and CLS the first: a prefix-cache hit would
        skip their hidden states, so these requests never read the cache (they still
        fill it). LAST always recomputes the last token, so it takes hits."""
        return self.pooling_type != "LAST"


def resolve_pooling(model_dir: Path, override: PoolerConfig | None) -> PoolingSpec:
    """The model's pooler: the override, else its sentence-transformers files, else LAST
    with normalisation."""
    model_dir = Path(model_dir)
    config = _read_json(model_dir / "config.json") or {}
    text_config = config.get("text_config", config)
    st_type, st_normalize = _sentence_transformers_pooler(model_dir)
    override = override or PoolerConfig()
    st_config = _read_json(model_dir / "config_sentence_transformers.json") or {}
    dims = config.get("matryoshka_dimensions") or st_config.get("matryoshka_dimensions")
    matryoshka = bool(dims) or bool(config.get("is_matryoshka") or st_config.get("is_matryoshka"))
    return PoolingSpec(
        pooling_type=override.pooling_type or st_type or "LAST",
        normalize=_first_set(override.normalize, st_normalize, True),
        hidden_size=int(text_config.get("hidden_size", 0)),
        is_matryoshka=matryoshka,
        matryoshka_dimensions=tuple(int(d) for d in dims) if dims else None,
    )


def engine_pooling(
    runner: str, model_dir: Path, override: PoolerConfig | None
) -> PoolingSpec | None:
    """The pooler of an engine with this runner (None: a generating engine)."""
    return resolve_pooling(model_dir, override) if runner == "pooling" else None


def _first_set(*values: bool | None) -> bool:
    return next(v for v in values if v is not None)


def _sentence_transformers_pooler(model_dir: Path) -> tuple[PoolingType | None, bool | None]:
    """(pooling type, normalise) from modules.json; (None, None) without the files."""
    modules = _read_json(model_dir / "modules.json")
    if not isinstance(modules, list):
        return None, None
    pooling = next((m for m in modules if m.get("type") == _ST_POOLING), None)
    normalize = any(m.get("type") == _ST_NORMALIZE for m in modules)
    if pooling is None:
        return None, normalize
    pooling_config = _read_json(model_dir / str(pooling.get("path", "")) / "config.json") or {}
    modes = [_ST_MODES.get(key) for key, on in pooling_config.items() if on is True]
    if any(mode is None for mode in modes) or len(modes) > 1:
        raise ConfigError(
            f"{model_dir}: sentence-transformers pooling {sorted(pooling_config)} is not "
            "one of lasttoken, mean_tokens, cls_token; set --pooler-config"
        )
    return (modes[0] if modes else None), normalize  # type: ignore[return-value]


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path} does not load: {exc}") from None


def check_dimensions(spec: PoolingSpec, dimensions: int | None) -> None:
    """400 for a `dimensions` the model cannot give (vLLM's rules)."""
    if dimensions is None:
        return
    if not spec.is_matryoshka:
        raise InvalidRequestError(
            "this model does not support Matryoshka representations: `dimensions` would "
            "give poor embeddings, so it is refused",
            param="dimensions",
        )
    allowed = spec.matryoshka_dimensions
    if allowed is not None and dimensions not in allowed:
        raise InvalidRequestError(
            f"this model supports the Matryoshka dimensions {list(allowed)}, got {dimensions}",
            param="dimensions",
        )
    if not 1 <= dimensions <= spec.hidden_size:
        raise InvalidRequestError(
            f"dimensions must be in [1, {spec.hidden_size}], got {dimensions}",
            param="dimensions",
        )


def embedding_vector(pooled: bytes, spec: PoolingSpec, dimensions: int | None) -> np.ndarray:
    """The float32 vector of a request's pooled output, cut to `dimensions` (and then
    normalised again when the model normalises: the cut vector is no longer unit)."""
    vector = np.frombuffer(pooled, dtype="<f4")
    if dimensions is None or dimensions >= len(vector):
        return vector
    vector = vector[:dimensions]
    if spec.normalize:
        vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
    return vector.astype(np.float32)


def check_pooling_engine(config: EngineConfig) -> None:
    """The pooling runner prefills only: what exists to decode has nothing to do there."""
    if config.speculative.speculative_config is not None:
        raise ConfigError("the pooling runner never decodes: speculative_config does not apply")
    if config.kv_transfer.kv_transfer_config is not None:
        raise ConfigError("the pooling runner never decodes: kv_transfer_config does not apply")
    if config.parallel.pipeline_parallel_size > 1:
        # The pooler reads the last stage's hidden states of every chunk; stages hand on
        # only activations. Tensor and data parallelism pool as one rank does.
        raise ConfigError("the pooling runner runs with pipeline_parallel_size 1")
