"""ServerConfig: the sub-configs composed, the checks that span them, the engine's EngineConfig built from them,
and the reading of SPINDLE_* variables and flat settings (a flag's or variable's name is its field's name, and
every field name is unique across the sub-configs)."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Any, get_type_hints

from engine.config import EngineConfig
from engine.lora.config import check_lora_serving
from engine.spec.vocab import check_draft_vocab
from server.config.batch import BatchConfig
from server.config.engine_core import EngineCoreConfig
from server.config.http import HttpConfig
from server.config.lora import LoRAConfig
from server.config.media import MediaConfig
from server.config.model import DEFAULT_MODEL, ModelConfig
from server.config.models_dir import ModelsDirConfig
from server.config.outputs import OutputConfig
from server.config.parallel import ParallelConfig
from server.config.scheduling import SchedulingConfig
from server.config.values import parse_setting

ENV_PREFIX = "SPINDLE_"
# What `spindle render` (and SPINDLE_RENDER_ONLY=1) says without a model: it never builds the demo (torch)
RENDER_NEEDS_MODEL = "spindle render needs --model (a local checkpoint folder with the tokenizer)"
# SPINDLE_* variables that other parts of the project read (not ServerConfig fields).
_NOT_CONFIG = frozenset(
    {
        "api_key",
        "output_chunk",
        "cache_dir",
        "fuzz_examples",
        "direct_write",
        "engine_command",  # engine_command: engine/client/process_client.py, benchmarks and tests only
        "cpu_kernels",  # read by the engine (engine/cpu_kernels/build.py)
        "kernel_choice",  # read by the engine (engine/cpu_kernels/chooser.py)
        "gguf_dequantize",  # read by the engine (engine/models/loader.py)
        "spec_draft_cost",  # read by the engine (engine/spec/speculator.py)
        "chromium",
        "update_screenshot",
    }
)  # tests/e2e/browser.py, tests/e2e/test_ui.py


@dataclass(frozen=True)
class ServerConfig:
    http: HttpConfig = field(default_factory=HttpConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    scheduling: SchedulingConfig = field(default_factory=SchedulingConfig)
    engine: EngineCoreConfig = field(default_factory=EngineCoreConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    outputs: OutputConfig = field(default_factory=OutputConfig)
    media: MediaConfig = field(default_factory=MediaConfig)
    models: ModelsDirConfig = field(default_factory=ModelsDirConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)

    def __post_init__(self) -> None:
        lora = self.lora
        check_lora_serving(lora.enable_lora, lora.lora_modules, self.model.model_name, lora.allow_runtime_lora_updating)
        self._engine_config(self.model.model or "<demo>")  # the engine's own checks (dtype, sizes) fail at startup
        check_draft_vocab(self.model.model, self.engine.speculative_config)  # a draft's ids must mean the target's
        if self.parallel.render_only and self.model.model is None:  # the demo build needs torch
            raise ValueError(RENDER_NEEDS_MODEL)
        self._check_models_dir()

    def _check_models_dir(self) -> None:
        """--models-dir serves many models from one API process and its own engines: what it does not combine with."""
        if self.models.models_dir is None:
            return
        if self.model.model is not None or self.model.served_model_name is not None:
            raise ValueError(
                "--models-dir serves every model in the folder: leave --model and --served-model-name unset"
            )
        p = self.parallel
        if p.render_only or p.headless or p.tensor_parallel_size > 1:
            raise ValueError(
                "--models-dir runs one engine per model: not with --tensor-parallel-size, --headless or spindle render"
            )
        if p.api_server_count > 1 and p.data_parallel_size > 1:
            raise ValueError("--models-dir with --api-server-count runs one engine per model: not --data-parallel-size")

    def engine_config(self) -> EngineConfig:
        return self._engine_config(self.model.model_path)

    def _engine_config(self, model: str) -> EngineConfig:
        m, s, e, p, lora = self.model, self.scheduling, self.engine, self.parallel, self.lora
        return EngineConfig(
            model=model,
            dtype=m.dtype,
            quantization=m.quantization,
            max_model_len=m.max_model_len,
            max_num_seqs=s.max_num_seqs,
            max_num_batched_tokens=s.max_num_batched_tokens,
            block_size=e.block_size,
            kv_cache_memory=e.kv_cache_memory,
            num_blocks=e.num_blocks,
            enable_prefix_caching=e.enable_prefix_caching,
            kv_disk_cache_size=int(e.kv_disk_cache_size * (1 << 30)),
            state_snapshot_interval=e.state_snapshot_interval,
            state_snapshot_memory=e.state_snapshot_memory,
            seed=e.seed,
            device=e.device,
            scheduling_policy=s.scheduling_policy,
            runner=m.runner,
            convert=m.convert,
            pooler_config=m.engine_pooler_config(),
            tensor_parallel_size=p.tensor_parallel_size,
            nnodes=p.nnodes,
            node_rank=p.node_rank,
            master_addr=p.master_addr,
            master_port=p.master_port,
            distributed_timeout=p.distributed_timeout,
            structured_outputs_warmup=e.structured_outputs_warmup,
            enable_lora=lora.enable_lora,
            max_loras=lora.max_loras,
            max_lora_rank=lora.max_lora_rank,
            max_cpu_loras=lora.max_cpu_loras,
            lora_dtype=lora.lora_dtype,
            speculative_config=e.speculative_config,
            cpu_threads=e.cpu_threads,
        )

    def resolved(self) -> ServerConfig:
        """The same config with the served folder in `model` (done at startup, not at validation: the demo is
        built, a GGUF model's folder derived, on first use); the name --model gave stays a name requests may use."""
        m = self.model
        path = m.model_path
        aliases = m.model_aliases if m.model in (None, path) else (*m.model_aliases, m.model)
        return dataclasses.replace(
            self, model=dataclasses.replace(m, model=path, served_model_name=m.model_name, model_aliases=aliases)
        )

    @classmethod
    def from_settings(cls, **settings: Any) -> ServerConfig:
        """A config from flat settings (each named as its flag and SPINDLE_* variable), each put in its sub-config."""
        unknown = sorted(set(settings) - SETTINGS.keys())
        if unknown:
            raise TypeError(f"not server settings: {', '.join(unknown)}")
        groups: dict[str, dict[str, Any]] = {group: {} for group in _GROUPS}
        for name, value in settings.items():
            groups[SETTINGS[name]][name] = value
        return cls(**{group: _GROUPS[group](**values) for group, values in groups.items()})

    @classmethod
    def from_env(
        cls, environ: dict[str, str] | None = None, *, default_model: bool = False, **overrides: Any
    ) -> ServerConfig:
        """Read SPINDLE_<FIELD> (upper case) for every setting; `overrides` (flat settings) win. Unknown SPINDLE_
        vars are logged. default_model: a server that starts (not a config built in code) serves DEFAULT_MODEL
        when no model is named (the demo only as `demo`)."""
        env = dict(os.environ if environ is None else environ)
        values: dict[str, Any] = {}
        for key, raw in env.items():
            if not key.startswith(ENV_PREFIX):
                continue
            name = key[len(ENV_PREFIX) :].lower()
            if name in _NOT_CONFIG:
                continue
            if name not in SETTINGS:  # other tools share the prefix: say so, but do not refuse to start
                logging.getLogger("spindle.server").warning("ignoring %s: not a server setting", key)
                continue
            values[name] = parse_setting(name, _HINTS[name], raw, key)
        if "api_keys" not in values and env.get(ENV_PREFIX + "API_KEY", "").strip():  # vLLM's VLLM_API_KEY twin
            values["api_keys"] = parse_setting("api_keys", tuple, env[ENV_PREFIX + "API_KEY"], ENV_PREFIX + "API_KEY")
        values.update(overrides)
        config = cls.from_settings(**values)
        if (
            default_model
            and config.model.unset
            and config.models.models_dir is None
            and not config.parallel.render_only
        ):
            return cls.from_settings(**{**values, "model": DEFAULT_MODEL})
        return config


# ServerConfig's field -> its sub-config class, in the order they are built (and checked).
_GROUPS: dict[str, Any] = {f.name: f.default_factory for f in dataclasses.fields(ServerConfig)}
# Every setting (a flag's dest, a SPINDLE_* variable's lower-case name) -> the ServerConfig field holding it.
SETTINGS: dict[str, str] = {
    f.name: group
    for group, sub in _GROUPS.items()
    for f in dataclasses.fields(sub)
    if f.metadata.get("setting", True)  # model_aliases: set at start-up, never by a flag or variable
}
# Every setting's type, for reading SPINDLE_* text.
_HINTS: dict[str, Any] = {name: hint for sub in _GROUPS.values() for name, hint in get_type_hints(sub).items()}
