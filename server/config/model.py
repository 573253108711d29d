"""The model and how it is served: the checkpoint, its names, tokenizer and chat template, the renderer that runs
the template, dtype, and the runner (generation or pooling)."""

from __future__ import annotations

import difflib
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from engine.gguf.folder import derived_folder, gguf_files
from engine.gguf.header import read_header
from engine.gguf.source import INSTALLED, gguf_file_of, open_model, sampling_defaults
from engine.models.checkpoint_meta import generation_defaults, read_generation_config
from engine.pooling_config import CONVERTS, check_pooler_overrides
from server.config.values import check_at_least_one, check_positive

Runner = Literal["generate", "pooling"]
DEFAULT_MODEL = "smollm2"  # what `spindle serve` serves with no --model (engine/gguf/source.py INSTALLED)
DEMO = "demo"  # --model demo: the built-in random-weight checkpoint (tests, benchmarks)
DEMO_NAME = "demo"


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None  # None (or "demo"): the built-in random demo checkpoint; the CLI's default is smollm2
    served_model_name: str | None = None  # None: the --model value (a GGUF model: the file's name, no .gguf)
    tokenizer: str | None = None  # None: the model folder
    max_model_len: int | None = None  # None: the checkpoint's limit
    dtype: str = "auto"
    quantization: str | None = None  # "int8": weight-only int8 on CPU (engine/layers/linear.py); off by default
    runner: Runner = "generate"  # "pooling": embeddings, classify, score, rerank, /pooling (generation routes 400)
    convert: str = "auto"  # runner "pooling": embed | classify | auto (engine/pooling_config.py CONVERTS)
    pooler_config: dict[str, Any] = field(default_factory=dict)  # JSON: engine/pooling_config.py POOLER_KEYS
    chat_template: str | None = None  # a file path or the template text
    trust_request_chat_template: bool = False
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    renderer_num_workers: int = 1
    chat_template_render_timeout: float = 5.0
    # sampling defaults for fields a request leaves out (vLLM's flag): auto, the model's; vllm, the API's plain
    # ones; or a folder holding a generation_config.json
    generation_config: str = "auto"
    # other names requests may give for the model: the one --model named it by (`smollm2`) once start-up has put
    # the served folder in `model` (resolved()); not a setting
    model_aliases: tuple[str, ...] = field(default=(), metadata={"setting": False})

    def __post_init__(self) -> None:
        check_at_least_one(self, ("renderer_num_workers",))
        if self.model == DEMO and not (Path(DEMO) / "config.json").is_file():  # (the source tree has a demo/ too)
            object.__setattr__(self, "model", None)
            object.__setattr__(self, "model_aliases", tuple(dict.fromkeys((*self.model_aliases, DEMO))))
        name = gguf_name(self.model) if self.model is not None else None  # GGUFError (a ValueError) on a bad file
        if name is not None:  # a .gguf file, a folder of one or a name like smollm2: served under the file's name
            object.__setattr__(self, "served_model_name", self.served_model_name or name)
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"--max-model-len must be at least 2, got {self.max_model_len}")
        check_positive(self, ("chat_template_render_timeout",))
        if self.runner not in get_args(Runner):
            raise ValueError(f"--runner must be generate or pooling; got {self.runner!r}")
        if self.convert not in CONVERTS:
            raise ValueError(f"--convert must be one of {', '.join(CONVERTS)}; got {self.convert!r}")
        if self.runner != "pooling" and (self.pooler_config or self.convert != "auto"):
            raise ValueError(
                f"--{'pooler-config' if self.pooler_config else 'convert'} applies to --runner pooling only"
            )
        check_pooler_overrides(self.pooler_config)
        if self.generation_config not in ("auto", "vllm") and not Path(self.generation_config).is_dir():
            raise ValueError(
                f"--generation-config must be auto, vllm or a folder holding generation_config.json; "
                f"got {self.generation_config!r}"
            )

    @property
    def model_path(self) -> str:
        """The checkpoint folder served: --model's, a GGUF model's derived folder (written on first use), or the
        demo's (built on first use)."""
        if self.model is not None:
            return served_folder(self.model)
        from demo.checkpoints import demo_checkpoint_path  # why here: it imports torch

        return str(demo_checkpoint_path())

    @property
    def model_name(self) -> str:
        """The name responses show and requests may ask for."""
        return self.served_model_name or self.model or DEMO_NAME

    @property
    def unset(self) -> bool:
        """No model named (neither --model nor SPINDLE_MODEL): the CLI then serves DEFAULT_MODEL."""
        return self.model is None and DEMO not in self.model_aliases

    def sampling_defaults(self, checkpoint: dict[str, float | int]) -> tuple[dict[str, float | int], str]:
        """The defaults for sampling fields a request leaves out, and where they come from. `checkpoint`: what the
        engine read from the served folder's generation_config.json. auto: a GGUF file's general.sampling.*, else
        llama.cpp's defaults; a folder's generation_config.json; vllm: none (the API's plain defaults)."""
        if self.generation_config == "vllm":
            return {}, "the API's own (--generation-config vllm)"
        if self.generation_config != "auto":
            folder = Path(self.generation_config)
            return generation_defaults(read_generation_config(folder)), str(folder / "generation_config.json")
        file = served_gguf(self.model) if self.model is not None else None
        if file is not None:
            found, source = sampling_defaults(read_header(file).metadata, Path(file))
            return {**checkpoint, **found}, source
        return checkpoint, "generation_config.json" if checkpoint else "the API's own (no generation_config.json)"

    def names(self) -> tuple[str, ...]:
        """Every name a request may give for the model: the served name, --model as given, its aliases."""
        return tuple(dict.fromkeys([self.model_name, *([self.model] if self.model else []), *self.model_aliases]))

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.model_path

    def engine_pooler_config(self) -> dict[str, Any]:
        """--pooler-config as the engine reads it (pooling_type in upper case)."""
        return {k: str(v).upper() if k == "pooling_type" else v for k, v in self.pooler_config.items()}


def check_model_exists(model: str) -> None:
    """A --model that names nothing stops start-up in one line (checked when a server starts, not when a config is
    built): a path that is not there, or a bare name that is neither a known model nor a hub id (`org/name`)."""
    path = Path(model).expanduser()
    if path.exists() or model in INSTALLED or model == DEMO:
        return
    if model.startswith(("/", ".", "~")) or model.count("/") > 1 or path.suffix == ".gguf":
        raise ValueError(f"no such file or folder: {model}")
    if "/" not in model:
        known = sorted({*INSTALLED, DEMO})
        close = difflib.get_close_matches(model, known, n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise ValueError(
            f"--model {model}: no such file or folder, and not a known model name (known: {', '.join(known)}, or "
            f"a Hugging Face id such as org/name){hint}"
        )


@functools.cache
def gguf_name(model: str) -> str | None:
    """The served name of the GGUF model `model` names (a file, a folder of one, a name such as smollm2: fetched
    once when not installed), its header checked; None for anything else."""
    file = gguf_file_of(model)
    return None if file is None else open_model(file).name


@functools.cache
def served_folder(model: str) -> str:
    """The folder the server and engine read: a GGUF model's derived one (written once), else `model` itself."""
    file = gguf_file_of(model)
    return model if file is None else str(derived_folder(open_model(file)))


def served_gguf(model: str) -> Path | None:
    """The (first) GGUF file behind `model`: a derived folder's, or the file a path or name gives; else None."""
    files = gguf_files(Path(model))
    return files[0] if files else gguf_file_of(model)
