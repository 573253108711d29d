"""Scheduling and limits: the batch the engine runs, the queue admission allows (beyond: 503), the order waiting
requests run in, and the bounds on the work one request may cause (RequestCaps; beyond: a 400 naming the flag)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from server.config.values import check_at_least_one, check_unset_or_at_least_one

SchedulingPolicy = Literal["fcfs", "priority"]


@dataclass(frozen=True, slots=True)
class RequestCaps:
    """Bounds on the work one request may cause (SchedulingConfig's fields of the same names; each has a flag)."""

    max_prompts_per_request: int = 2048
    max_choices_per_request: int = 4096  # n x prompts: engine requests
    max_stop_strings: int = 64
    max_stop_string_length: int = 1024  # characters
    max_stop_token_ids: int = 1024
    max_logit_bias: int = 1024
    max_allowed_token_ids: int = 262144
    max_structured_output_size: int = 256 << 10  # bytes of a constraint's spec (server/structured/constraint.py)
    max_documents_per_request: int = 1000  # /score and /rerank documents (one engine batch)
    priority_scheduling: bool = False  # --scheduling-policy priority: else a non-zero priority is refused


# The fields that become RequestCaps: each at least 1.
_CAP_FIELDS = (
    "max_prompts_per_request",
    "max_choices_per_request",
    "max_stop_strings",
    "max_stop_string_length",
    "max_stop_token_ids",
    "max_logit_bias",
    "max_allowed_token_ids",
    "max_structured_output_size",
    "max_documents_per_request",
)


@dataclass(frozen=True)
class SchedulingConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_num_queued_reqs: int | None = None  # requests waiting for their first token; beyond: 503
    max_num_queued_tokens: int | None = None  # prompt tokens waiting for their first token; beyond: 503
    scheduling_policy: SchedulingPolicy = "fcfs"  # as vLLM: "priority" honours requests' priority, else it is refused
    max_logprobs: int = 20
    # Bounds on the work one request may cause (a 400 naming the flag); far above what normal clients send.
    max_prompts_per_request: int = 2048  # /v1/completions prompt lists; embeddings, classify and /pooling inputs
    max_documents_per_request: int = 1000  # /score and /rerank documents (Cohere's recommended most)
    max_choices_per_request: int = 4096  # n x prompts
    max_stop_strings: int = 64
    max_stop_string_length: int = 1024  # characters
    max_stop_token_ids: int = 1024
    max_logit_bias: int = 1024
    max_allowed_token_ids: int = 262144  # above any vocabulary: refuses only padded (repeated) lists
    # bytes of one constraint's spec (schema, regex, choices, grammar): 256 KiB takes the large real-world schemas
    # (SchemaStore's, Kubernetes objects with their definitions: up to ~200 KB); what a spec costs to compile is
    # bounded by the grammar backend's own limits (engine/structured/grammar.py LIMITS), not by its bytes
    max_structured_output_size: int = 256 << 10

    def __post_init__(self) -> None:
        check_at_least_one(self, ("max_num_seqs", "max_num_batched_tokens", *_CAP_FIELDS))
        check_unset_or_at_least_one(self, ("max_num_queued_reqs", "max_num_queued_tokens"))
        if self.max_logprobs < 0:
            raise ValueError(f"--max-logprobs must be at least 0, got {self.max_logprobs}")
        if self.scheduling_policy not in get_args(SchedulingPolicy):
            raise ValueError(f"--scheduling-policy must be fcfs or priority; got {self.scheduling_policy!r}")

    def request_caps(self) -> RequestCaps:
        """The per-request bounds check_request enforces (ModelLimits.caps)."""
        return RequestCaps(
            **{name: getattr(self, name) for name in _CAP_FIELDS},
            priority_scheduling=self.scheduling_policy == "priority",
        )
