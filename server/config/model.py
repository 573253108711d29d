"""The model and how it is served: the checkpoint, its names, tokenizer and chat template, the renderer that runs
the template, dtype, and the runner (generation or pooling)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from engine.gguf.folder import resolve_gguf
from engine.pooling_config import CONVERTS, check_pooler_overrides
from server.config.values import check_at_least_one, check_positive

Runner = Literal["generate", "pooling"]


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None  # None: the built-in demo checkpoint
    served_model_name: str | None = None  # None: the --model value (a GGUF model: the file's name)
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

    def __post_init__(self) -> None:
        check_at_least_one(self, ("renderer_num_workers",))
        gguf = resolve_gguf(self.model) if self.model is not None else None  # GGUFError (a ValueError) on a bad file
        if gguf is not None:  # a .gguf file (or a folder of one) is served from its derived HF-shaped folder
            object.__setattr__(self, "model", str(gguf[0]))
            object.__setattr__(self, "served_model_name", self.served_model_name or gguf[1])
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

    @property
    def model_path(self) -> str:
        if self.model is not None:
            return self.model
        from demo.checkpoints import demo_checkpoint_path  # why here: it imports torch

        return str(demo_checkpoint_path())

    @property
    def model_name(self) -> str:
        """The name responses show and requests may ask for."""
        return self.served_model_name or self.model or "spindle-demo"

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.model_path

    def engine_pooler_config(self) -> dict[str, Any]:
        """--pooler-config as the engine reads it (pooling_type in upper case)."""
        return {k: str(v).upper() if k == "pooling_type" else v for k, v in self.pooler_config.items()}
