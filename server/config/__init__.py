"""Server configuration: frozen sub-configs by concern, each validated on construction, composed by ServerConfig,
readable from flags (server/cli.py) and SPINDLE_* env vars (server/config/server.py).

Every check of a setting lives in this package, and it imports nothing else from the server (it is the root the
rest reads).
"""

from server.config.engine_core import EngineCoreConfig
from server.config.http import HttpConfig, WorkerClass
from server.config.lora import LoRAConfig
from server.config.media import MediaConfig
from server.config.model import DEFAULT_MODEL, ModelConfig, Runner, check_model_exists
from server.config.models_dir import ModelsDirConfig
from server.config.outputs import REASONING_PARSER_NAMES, TOOL_CALL_PARSER_NAMES, LogLevel, MetricsCompat, OutputConfig
from server.config.parallel import DataParallelPolicy, ParallelConfig
from server.config.process_env import ServerEnv
from server.config.scheduling import RequestCaps, SchedulingConfig, SchedulingPolicy
from server.config.server import _NOT_CONFIG, ENV_PREFIX, RENDER_NEEDS_MODEL, SETTINGS, ServerConfig
from server.config.values import (
    JSON_FIELDS,
    JSON_LIST_FIELDS,
    SIZE_FIELDS,
    parse_json_list,
    parse_json_object,
    parse_size,
)

__all__ = [
    "DEFAULT_MODEL",
    "ENV_PREFIX",
    "JSON_FIELDS",
    "JSON_LIST_FIELDS",
    "REASONING_PARSER_NAMES",
    "RENDER_NEEDS_MODEL",
    "SETTINGS",
    "SIZE_FIELDS",
    "TOOL_CALL_PARSER_NAMES",
    "_NOT_CONFIG",
    "DataParallelPolicy",
    "EngineCoreConfig",
    "HttpConfig",
    "LoRAConfig",
    "LogLevel",
    "MediaConfig",
    "MetricsCompat",
    "ModelConfig",
    "ModelsDirConfig",
    "OutputConfig",
    "ParallelConfig",
    "RequestCaps",
    "Runner",
    "SchedulingConfig",
    "SchedulingPolicy",
    "ServerConfig",
    "ServerEnv",
    "WorkerClass",
    "check_model_exists",
    "parse_json_list",
    "parse_json_object",
    "parse_size",
]
