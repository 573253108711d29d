"""A decoded OpenAI request -> what the engine and the output side need; every check that knows the model.

Messages follow OpenAI's wording and state the real numbers, so a user knows what to change.
"""

from __future__ import annotations

import itertools
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from engine.messages import AudioInput, ImageInput, LoRARequest, Ready, SamplingParams, StructuredOutputs
from server.config import RequestCaps, ServerConfig
from server.http.errors import APIError, bad_request
from server.lora.adapters import LoRARegistry
from server.request.collector import OutputKind
from server.request.openai_protocol import ChatCompletionRequest, CompletionRequest
from server.request.prompt_shapes import num_prompts

MAX_N = 128
_INT64 = 1 << 63


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """What the engine told us at Ready, plus the server's own caps."""

    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...] = ()
    max_logprobs: int = 20
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    caps: RequestCaps = field(default_factory=RequestCaps)
    loras: LoRARegistry | None = None  # --enable-lora: the adapters a request's `model` may name


def lora_for(limits: ModelLimits, model: str | None) -> LoRARequest | None:
    """The adapter a request's `model` names (None: the base); 404 for a name unloaded since check_model."""
    registry = limits.loras
    if registry is None or model is None or model in registry.base_names:
        return None
    adapter = registry.get(model)
    if adapter is None:
        raise APIError(f"The model `{model}` does not exist.", status=404, param="model")
    return adapter.request


def limits_for(config: ServerConfig, ready: Ready, tokenizer: Any) -> ModelLimits:
    """The limits a server checks requests against: the engine's Ready (or, render-only, the checkpoint's
    files read as the engine reads them), the tokenizer's vocabulary and the config's caps."""
    vocab = ready.vocab_size
    if tokenizer is not None:  # ids the tokenizer cannot decode are refused even if the embedding is padded
        vocab = min(vocab, tokenizer.get_vocab_size(with_added_tokens=True))
    return ModelLimits(
        max_model_len=ready.max_model_len,
        vocab_size=vocab,
        eos_token_ids=tuple(ready.eos_token_ids),
        max_logprobs=config.scheduling.max_logprobs,
        generation_defaults=config.model.sampling_defaults(dict(ready.generation_defaults))[0],
        caps=config.scheduling.request_caps(),
    )


@dataclass(slots=True)
class GenerationSpec:
    """One prompt's generation: n engine requests sharing a prompt, reassembled by one parent."""

    external_id: str  # what responses show (cmpl-<external_id>)
    request_id: str  # f"{a counter in hex}-{external_id}"; children append -<index>
    prompt_token_ids: list[int]
    params: SamplingParams
    n: int = 1
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    output_kind: OutputKind = OutputKind.FINAL_ONLY
    priority: int = 0
    arrival_time: float = 0.0
    index_offset: int = 0  # choice index of child 0 (completions with several prompts: prompt_no * n)
    mm_inputs: list[ImageInput] | None = None  # images (a vision model): pixels + placeholder positions
    lora: LoRARequest | None = None  # the adapter (n > 1: every child's); None: the base model
    audio: AudioInput | None = None  # a speech model's audio window (server/families/audio/)

    def child_ids(self) -> list[str]:
        return [self.request_id] if self.n == 1 else [f"{self.request_id}-{i}" for i in range(self.n)]

    def child_params(self, i: int) -> SamplingParams:
        """n > 1: each child gets its own seed (seed + i) so seeded choices differ but stay reproducible."""
        if self.n == 1 or self.params.seed is None:
            return self.params
        return msgspec.structs.replace(self.params, seed=(self.params.seed + i) % _INT64)


_request_numbers = itertools.count()


def unique_prefix() -> str:
    """Keeps two requests with the same external id apart in the engine: a counter in hex (no '-' in it, so the
    id up to its first '-' is unique by construction; random bits collided for 10^5 prompts of one request)."""
    return format(next(_request_numbers), "x")


def external_request_id(header: str | None, body_id: str | None) -> str:
    """X-Request-Id wins, then the body's request_id, else a fresh random hex id."""
    return header or body_id or secrets.token_hex(16)


def _in_range(value: float | None, name: str, low: float, high: float, *, low_open: bool = False) -> None:
    if value is None:
        return
    if value != value or value < low or value > high or (low_open and value == low):
        left = "(" if low_open else "["
        raise bad_request(f"{name} must be in {left}{low}, {high}], got {value}.", name)


def too_many(what: str, count: int, cap: int, flag: str, param: str) -> None:
    if count > cap:
        raise bad_request(f"{what}: {count}, but this server allows at most {cap} per request ({flag}).", param)


def check_request(req: CompletionRequest | ChatCompletionRequest, limits: ModelLimits) -> None:
    """Checks that need no tokens: run before rendering/tokenizing, so a bad request costs nothing."""
    _check_work(req, limits.caps)
    _check_sampling(req)
    _check_stops(req, limits.caps)
    _check_token_lists(req, limits)
    _logit_bias(req.logit_bias, limits.vocab_size)
    _num_logprobs(req, limits.max_logprobs)
    if req.truncate_prompt_tokens is not None and req.truncate_prompt_tokens < 1 and req.truncate_prompt_tokens != -1:
        raise bad_request(
            f"truncate_prompt_tokens must be -1 (max_model_len) or at least 1, got {req.truncate_prompt_tokens}.",
            "truncate_prompt_tokens",
        )


def check_priority(priority: int, caps: RequestCaps) -> None:
    if priority != 0 and not caps.priority_scheduling:  # vLLM's refusal, with the flag that enables it
        raise bad_request(
            f"Got priority {priority} but priority scheduling is not enabled; start the server "
            f"with --scheduling-policy priority, or leave priority out.",
            "priority",
        )


def _check_work(req: CompletionRequest | ChatCompletionRequest, caps: RequestCaps) -> None:
    """n, prompts and priority against the server's caps."""
    if not 1 <= req.n <= MAX_N:
        raise bad_request(f"n must be between 1 and {MAX_N}, got {req.n}.", "n")
    check_priority(req.priority, caps)
    prompts = num_prompts(req.prompt) if isinstance(req, CompletionRequest) else 1
    too_many("Number of prompts", prompts, caps.max_prompts_per_request, "--max-prompts-per-request", "prompt")
    if req.n * prompts > caps.max_choices_per_request:
        raise bad_request(
            f"n ({req.n}) times the number of prompts ({prompts}) is {req.n * prompts} choices, but "
            f"this server allows at most {caps.max_choices_per_request} per request "
            f"(--max-choices-per-request).",
            "n",
        )


def _check_sampling(req: CompletionRequest | ChatCompletionRequest) -> None:
    """Sampling ranges, token counts, the seed and stream_options."""
    _in_range(req.temperature, "temperature", 0.0, 2.0)
    _in_range(req.top_p, "top_p", 0.0, 1.0, low_open=True)
    _in_range(req.min_p, "min_p", 0.0, 1.0)
    _in_range(req.presence_penalty, "presence_penalty", -2.0, 2.0)
    _in_range(req.frequency_penalty, "frequency_penalty", -2.0, 2.0)
    if req.repetition_penalty is not None and not (0.0 < req.repetition_penalty <= 2.0):
        raise bad_request(f"repetition_penalty must be in (0, 2], got {req.repetition_penalty}.", "repetition_penalty")
    if req.top_k is not None and req.top_k < -1:
        raise bad_request(f"top_k must be -1 or 0 (off) or a positive number of tokens, got {req.top_k}.", "top_k")
    if req.min_tokens < 0:
        raise bad_request(f"min_tokens must be at least 0, got {req.min_tokens}.", "min_tokens")
    max_tokens = _requested_max_tokens(req)
    if max_tokens is not None and max_tokens < 1:
        name = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"
        raise bad_request(f"{name} must be at least 1, got {max_tokens}.", name)
    if max_tokens is not None and req.min_tokens > max_tokens:
        raise bad_request(f"min_tokens ({req.min_tokens}) must not exceed max_tokens ({max_tokens}).", "min_tokens")
    if req.seed is not None and not -_INT64 <= req.seed < _INT64:
        raise bad_request(f"seed must fit in 64 bits, got {req.seed}.", "seed")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true.", "stream_options")


def _check_stops(req: CompletionRequest | ChatCompletionRequest, caps: RequestCaps) -> None:
    stops = _stops(req)
    too_many("Number of stop strings", len(stops), caps.max_stop_strings, "--max-stop-strings", "stop")
    if any(s == "" for s in stops):
        raise bad_request("stop strings must not be empty.", "stop")
    longest = max(map(len, stops), default=0)
    if longest > caps.max_stop_string_length:
        raise bad_request(
            f"stop strings may be at most {caps.max_stop_string_length} characters long "
            f"(--max-stop-string-length), got one of {longest}.",
            "stop",
        )


def _check_token_lists(req: CompletionRequest | ChatCompletionRequest, limits: ModelLimits) -> None:
    """stop_token_ids, allowed_token_ids and logit_bias: counts first, so an oversized list is refused without
    walking it, then each id against the vocabulary."""
    caps = limits.caps
    too_many(
        "Number of stop_token_ids",
        len(req.stop_token_ids or ()),
        caps.max_stop_token_ids,
        "--max-stop-token-ids",
        "stop_token_ids",
    )
    too_many(
        "Number of allowed_token_ids",
        len(req.allowed_token_ids or ()),
        caps.max_allowed_token_ids,
        "--max-allowed-token-ids",
        "allowed_token_ids",
    )
    too_many(
        "Number of logit_bias entries", len(req.logit_bias or ()), caps.max_logit_bias, "--max-logit-bias", "logit_bias"
    )
    for name, ids in (("stop_token_ids", req.stop_token_ids), ("allowed_token_ids", req.allowed_token_ids)):
        for tid in ids or ():
            if not 0 <= tid < limits.vocab_size:
                raise bad_request(f"{name} contains {tid}, outside the vocabulary [0, {limits.vocab_size}).", name)
    if req.allowed_token_ids is not None and not req.allowed_token_ids:
        raise bad_request(
            "allowed_token_ids must not be empty; leave it out to allow every token.", "allowed_token_ids"
        )


def _requested_max_tokens(req: CompletionRequest | ChatCompletionRequest) -> int | None:
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        return req.max_completion_tokens
    return req.max_tokens


def _stops(req: CompletionRequest | ChatCompletionRequest) -> tuple[str, ...]:
    if req.stop is None:
        return ()
    return (req.stop,) if isinstance(req.stop, str) else tuple(req.stop)


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    if not bias:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            tid = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}.", "logit_bias") from None
        if not 0 <= tid < vocab_size:
            raise bad_request(f"logit_bias has token id {tid}, outside the vocabulary [0, {vocab_size}).", "logit_bias")
        if not -100.0 <= value <= 100.0:
            raise bad_request(f"logit_bias values must be in [-100, 100], got {value} for token {tid}.", "logit_bias")
        out[tid] = float(value)
    return out


def _num_logprobs(req: CompletionRequest | ChatCompletionRequest, max_logprobs: int) -> int | None:
    """Top-N alternatives per sampled token, or None when logprobs are off."""
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true.", "top_logprobs")
        if not req.logprobs:
            return None
        n, name = (req.top_logprobs or 0), "top_logprobs"
    else:
        if req.logprobs is None:
            return None
        n, name = req.logprobs, "logprobs"
    if not 0 <= n <= max_logprobs:
        raise bad_request(f"{name} must be between 0 and {max_logprobs} (--max-logprobs), got {n}.", name)
    return n


def check_prompt_ids(ids: list[int], vocab_size: int, param: str = "prompt") -> None:
    for tid in ids:
        if not 0 <= tid < vocab_size:
            raise bad_request(f"Token id {tid} is out of vocabulary; ids must be in [0, {vocab_size}).", param)


def build_spec(
    req: CompletionRequest | ChatCompletionRequest,
    prompt_ids: list[int],
    limits: ModelLimits,
    *,
    external_id: str,
    stream: bool,
    index_offset: int = 0,
    structured_outputs: StructuredOutputs | None = None,
) -> GenerationSpec:
    """Lengths, then sampling parameters. `check_request` must have passed; `structured_outputs` comes from
    server/structured/constraint.py `structured_outputs` (already validated)."""
    prompt_ids, max_tokens = _lengths(req, prompt_ids, limits)
    return GenerationSpec(
        external_id=external_id,
        request_id=f"{unique_prefix()}-{external_id}",
        prompt_token_ids=prompt_ids,
        params=_sampling_params(req, limits, max_tokens, structured_outputs),
        n=req.n,
        stop=_stops(req),
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        output_kind=OutputKind.DELTA if stream else OutputKind.FINAL_ONLY,
        priority=req.priority,
        arrival_time=time.time(),
        index_offset=index_offset,
        lora=lora_for(limits, req.model),
    )


def _lengths(
    req: CompletionRequest | ChatCompletionRequest, prompt_ids: list[int], limits: ModelLimits
) -> tuple[list[int], int]:
    """The prompt (truncated as asked) and max_tokens, both within max_model_len (else a 400)."""
    if req.truncate_prompt_tokens is not None:
        keep = limits.max_model_len if req.truncate_prompt_tokens == -1 else req.truncate_prompt_tokens
        prompt_ids = prompt_ids[-keep:]
    num_prompt = len(prompt_ids)
    if num_prompt == 0:
        raise bad_request("The prompt is empty after tokenization; send at least one token.", "prompt")
    max_len = limits.max_model_len
    if num_prompt >= max_len:
        raise bad_request(
            f"This model's maximum context length is {max_len} tokens. However, your request has "
            f"{num_prompt} input tokens, which leaves no room for output. Please reduce the length "
            f"of the input.",
            "messages" if isinstance(req, ChatCompletionRequest) else "prompt",
        )
    max_tokens = _requested_max_tokens(req)
    if max_tokens is None:
        return prompt_ids, max_len - num_prompt
    if num_prompt + max_tokens > max_len:
        raise bad_request(
            f"This model's maximum context length is {max_len} tokens. However, you requested "
            f"{num_prompt + max_tokens} tokens ({num_prompt} in the input, {max_tokens} in the "
            f"completion). Please reduce the length of the input or of the completion "
            f"(at most {max_len - num_prompt} here).",
            "max_tokens",
        )
    return prompt_ids, max_tokens


def max_tokens_for(req: CompletionRequest | ChatCompletionRequest, prompt_ids: list[int], limits: ModelLimits) -> int:
    """The request's max_tokens for this prompt, with build_spec's 400s (the audio routes' decoder prompts)."""
    return _lengths(req, prompt_ids, limits)[1]


def _sampling_params(
    req: CompletionRequest | ChatCompletionRequest,
    limits: ModelLimits,
    max_tokens: int,
    structured_outputs: StructuredOutputs | None,
) -> SamplingParams:
    """The engine's parameters: the request's, else the checkpoint's generation_config defaults."""
    num_logprobs = _num_logprobs(req, limits.max_logprobs)
    echo = isinstance(req, CompletionRequest) and req.echo
    defaults = limits.generation_defaults

    def pick(value: float | int | None, name: str, fallback: float | int) -> Any:
        return value if value is not None else defaults.get(name, fallback)

    return SamplingParams(
        max_tokens=max_tokens,
        temperature=float(pick(req.temperature, "temperature", 1.0)),
        top_p=float(pick(req.top_p, "top_p", 1.0)),
        top_k=int(pick(req.top_k, "top_k", 0)),
        min_p=float(pick(req.min_p, "min_p", 0.0)),
        presence_penalty=float(req.presence_penalty or 0.0),
        frequency_penalty=float(req.frequency_penalty or 0.0),
        repetition_penalty=float(pick(req.repetition_penalty, "repetition_penalty", 1.0)),
        logit_bias=_logit_bias(req.logit_bias, limits.vocab_size),
        allowed_token_ids=req.allowed_token_ids,
        seed=req.seed,
        min_tokens=min(req.min_tokens, max_tokens),
        stop_token_ids=list(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        logprobs=num_logprobs,
        prompt_logprobs=num_logprobs if echo and num_logprobs is not None else None,
        structured_outputs=structured_outputs,
    )


_MAX_TOKEN_BYTES: dict[int, int] = {}


def max_token_bytes(tokenizer: Any) -> int:
    """An upper bound on one token's UTF-8 length: the longest token string (byte-level BPE and SentencePiece
    write a byte as one or more chars, so this never undercounts). Computed once per tokenizer (a vocabulary scan)."""
    key = id(tokenizer)
    if key not in _MAX_TOKEN_BYTES:
        size = tokenizer.get_vocab_size(with_added_tokens=True)
        _MAX_TOKEN_BYTES[key] = max(len((tokenizer.id_to_token(i) or "").encode()) for i in range(size)) or 1
    return _MAX_TOKEN_BYTES[key]


def check_fits(min_prompt_tokens: int, limits: ModelLimits, param: str = "prompt") -> None:
    """400 before tokenizing a text whose token count surely leaves no room for output in max_model_len.

    `min_prompt_tokens` is a lower bound from the text's length (admission.min_tokens); build_spec refuses
    the same prompt once tokenized (num_prompt >= max_model_len), this only spares the tokenizer the work.
    """
    max_len = limits.max_model_len
    if min_prompt_tokens >= max_len:
        raise bad_request(
            f"This model's maximum context length (max_model_len) is {max_len} tokens. However, "
            f"your request has at least {min_prompt_tokens} input tokens (judging by its length), "
            f"which leaves no room for output. Please reduce the length of the input.",
            param,
        )
