"""The contract between the API server and the engine core: typed msgpack frames.

Everything that crosses the pipe is one of these Structs. `ToEngine` and `FromEngine` are
tagged unions, so one `msgspec.msgpack.Decoder` per direction decodes any frame.
"""

from __future__ import annotations

import msgspec

from engine.lora.request import LoRARequest as LoRARequest  # carried by the contract, owned by engine/lora/


class StructuredOutputs(msgspec.Struct, frozen=True, omit_defaults=True):
    """A constraint on the generated text, compiled by the engine's grammar backend (engine/structured/).

    The server validates it before sending (a 400 names the problem); the engine compiles it off its step.
    """

    kind: str  # "json" (a JSON schema) | "json_object" (any JSON object) | "regex" | "choice" | "grammar" (Lark)
    spec: str = ""  # json: the schema as JSON text; regex: the pattern; choice: a JSON list of strings; grammar: Lark
    # Reasoning models: the constraint starts after the output contains this text (e.g. "</think>").
    reasoning_end: str | None = None
    # json / json_object: a regex for the whitespace allowed between tokens (None: none at all)
    whitespace_pattern: str | None = None


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """Token-level sampling and stopping. Text-level stops (stop strings) live in the server."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    seed: int | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per sampled token (the sampled one always included)
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputs | None = None


class ImageInput(msgspec.Struct, frozen=True, omit_defaults=True):
    """One image of a request (Qwen2-VL): its processed pixels and where its placeholder tokens sit.

    `data` is the pixel tensor's raw bytes (C order) of `shape` and `dtype`; None when the engine was sent this
    `hash` before (the API mirrors the engine's cache; a miss is refused and the API resends the pixels).
    """

    hash: str  # of the processed pixels and grid: equal hashes mean the same encoder output
    offset: int  # index in prompt_token_ids of the first of its placeholder tokens
    length: int  # placeholder tokens: t * h * w / merge_size**2
    grid_thw: list[int]  # (t, h, w) in patches
    data: bytes | None = None
    shape: list[int] = []
    dtype: str = "float32"


# The error text (prefix) of a request whose image was sent by hash only and is not in the engine's cache: the
# API resends the request with the pixels (server/request/async_llm.py).
IMAGE_CACHE_MISS = "ImageCacheMiss:"


class AudioInput(msgspec.Struct, frozen=True, omit_defaults=True):
    """A Whisper request's audio: one 30 s window's log-mel features (the API's WhisperFeatureExtractor made them).

    `features` is float32 [mels, frames] raw bytes (C order). The engine caches the encoder's output by `hash`."""

    hash: str  # of the features: equal hashes mean the same encoder output
    features: bytes
    shape: list[int]
    timestamps: bool = False  # apply Whisper's timestamp rules (the prompt has no <|notimestamps|>)
    rules: bool = True  # Whisper's suppress-token and timestamp rules; off for language detection


class AddRequest(msgspec.Struct, frozen=True, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int = 0  # lower runs first, as in vLLM
    mm_inputs: list[ImageInput] | None = None  # images, in prompt order
    lora: LoRARequest | None = None  # None: the base model
    audio: AudioInput | None = None  # a speech-to-text model's request: its audio window


class AbortRequests(msgspec.Struct, frozen=True, tag="abort"):
    request_ids: list[str]


ToEngine = AddRequest | AbortRequests  # the server ends the engine by closing its stdin


class EngineStats(msgspec.Struct, frozen=True, array_like=True):
    num_running: int
    num_waiting: int
    num_used_blocks: int  # blocks held by requests; cached-but-free blocks count as free
    num_total_blocks: int
    num_preemptions: int  # cumulative
    prefix_cache_queries: int  # cumulative, in tokens
    prefix_cache_hits: int  # cumulative, in tokens
    image_cache_hits: int = 0  # cumulative: images (or Whisper windows) whose encoder output the engine had cached
    lora_running: list[str] = []  # --enable-lora: the names of the running requests' adapters
    lora_waiting: list[str] = []  # ... and of the waiting requests' adapters
    # --speculative-config, cumulative (vLLM's spec_decode_*): verifications, draft tokens, accepted ones, and
    # how many verifications accepted the draft token at each position
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = []


class TokenLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """One position: the chosen token's logprob and rank, then the top-N alternatives."""

    token_id: int
    logprob: float
    rank: int  # 1-based rank of token_id in the distribution
    top_ids: list[int]
    top_logprobs: list[float]


class PooledData(msgspec.Struct, frozen=True, array_like=True):
    """A pooling request's raw output (engine/execution/pooler.py): float32, little-endian, C order, of `shape`:
    [D] for LAST / CLS / MEAN, [tokens, D] for ALL / STEP; D is the hidden size (embed) or the labels (classify).
    Raw: the server normalizes and applies activations per request (server/families/pooling/)."""

    data: bytes
    shape: list[int]


class RequestOutput(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """One request's news from one engine step."""

    request_id: str
    new_token_ids: list[int]
    # "stop" (eos / stop token; a pooling request's prompt fully processed) | "length" | "abort" | "error"
    finish_reason: str | None = None
    stop_token_id: int | None = None  # the stop_token_ids entry that ended it (not plain eos)
    error: str | None = None  # with finish_reason "error": why the request was refused
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when asked
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # once, with the first token
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    arrival_time: float = 0.0
    scheduled_time: float = 0.0  # first time the request was scheduled
    first_token_time: float = 0.0
    num_preemptions: int = 0
    pooled: PooledData | None = None  # runner "pooling": once, with finish_reason "stop"
    # a Whisper request's <|nospeech|> probability at <|startoftranscript|> (raw logits), with its finish
    no_speech_prob: float | None = None


class PoolingInfo(msgspec.Struct, frozen=True, omit_defaults=True):
    """A pooling engine's task and pooler as resolved at load: the checkpoint (architecture, sentence-transformers
    files, config.json) under --convert and --pooler-config (engine/pooling_config.py)."""

    task: str  # "embed" | "classify" (a *ForSequenceClassification score head)
    pooling_type: str  # LAST | CLS | MEAN | ALL | STEP
    hidden_size: int  # an embedding's length
    normalize: bool = True  # embed: L2-normalize by default
    use_activation: bool = True  # classify: apply `activation` by default
    activation: str = "softmax"  # classify: softmax | sigmoid | identity (config.json's problem_type, labels)
    score_activation: str = "sigmoid"  # a cross-encoder's score: sigmoid | identity | tanh (sentence-transformers)
    labels: list[str] = []  # classify: id2label in label order
    prompts: dict[str, str] = {}  # config_sentence_transformers.json: prompt name -> text put before the input
    default_prompt_name: str | None = None
    # Matryoshka (config.json or --pooler-config): embeddings may be cut to any length or to these lengths
    is_matryoshka: bool = False
    matryoshka_dimensions: list[int] | None = None


class Ready(msgspec.Struct, frozen=True, tag="ready"):
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    num_blocks: int
    block_size: int
    model_dtype: str
    generation_defaults: dict[str, float | int] = {}  # from generation_config.json
    pooling: PoolingInfo | None = None  # runner "pooling": what the engine computes (engine/pooling_config.py)


class LoadFailed(msgspec.Struct, frozen=True, tag="load_failed"):
    message: str


class StepOutputs(msgspec.Struct, frozen=True, tag="step"):
    """ONE frame per engine step: every request's news, the step's time, and the engine's stats."""

    outputs: list[RequestOutput]
    timestamp: float
    stats: EngineStats


class Heartbeat(msgspec.Struct, frozen=True, tag="heartbeat"):
    """Sent by a thread every heartbeat interval without other frames, also during a long step."""

    timestamp: float
    stats: EngineStats
    step_started: float = 0.0  # wall time the running step began; 0 between steps


FromEngine = Ready | LoadFailed | StepOutputs | Heartbeat
