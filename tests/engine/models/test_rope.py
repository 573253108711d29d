"""Rotary tables against transformers' ROPE_INIT_FUNCTIONS: inverse frequencies and attention factors of every
scaling type, longrope's short and long factors, partial rotary dims."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import LlamaConfig, Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.models.rope import inv_freq, rope_table

ORIG = 64
YARNS = [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIG},
    {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": ORIG,
        "beta_fast": 16,
        "beta_slow": 2,
        "truncate": False,
    },
    {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": ORIG,
        "mscale": 0.8,
        "mscale_all_dim": 0.6,
    },
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIG, "attention_factor": 1.3},
]


def llama(scaling: dict[str, Any]) -> LlamaConfig:
    legacy: dict[str, Any] = dict(rope_theta=10_000.0, rope_scaling=scaling)  # old-style keys transformers converts
    return LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        head_dim=64,
        num_hidden_layers=1,
        intermediate_size=64,
        vocab_size=100,
        max_position_embeddings=4 * ORIG,
        **legacy,
    )


@pytest.mark.parametrize(
    "scaling",
    YARNS
    + [
        {"rope_type": "linear", "factor": 3.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": ORIG,
        },
    ],
)
def test_scalings_match_transformers(scaling: dict[str, Any]) -> None:
    ref, ref_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](llama(dict(scaling)), "cpu")
    ours, factor = inv_freq(64, 10_000.0, scaling, max_positions=4 * ORIG, max_position_embeddings=4 * ORIG)
    torch.testing.assert_close(ours, ref, atol=0, rtol=1e-6)
    assert factor == pytest.approx(ref_factor, rel=1e-7)
    plain, _ = inv_freq(64, 10_000.0, None, max_positions=4 * ORIG, max_position_embeddings=4 * ORIG)
    assert not torch.allclose(ours, plain)  # the scaling did something


@pytest.mark.parametrize("served", [ORIG, 4 * ORIG])
def test_longrope_picks_short_or_long_factors_by_served_length(served: int, caplog: pytest.LogCaptureFixture) -> None:
    """Long factors when the served length passes the original one (vLLM's rule), as transformers does for a
    sequence that long, with a warning (shorter sequences differ from transformers then); short ones otherwise.
    Partial rotary: 24 of 32 dims, so 12 factors."""
    scaling = {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.05 * i for i in range(12)],
        "long_factor": [1.0 + 0.5 * i for i in range(12)],
    }
    legacy: dict[str, Any] = dict(rope_scaling=dict(scaling), partial_rotary_factor=0.75)
    cfg = Phi3Config(
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_hidden_layers=1,
        intermediate_size=64,
        vocab_size=100,
        pad_token_id=0,
        max_position_embeddings=4 * ORIG,
        original_max_position_embeddings=ORIG,
        **legacy,
    )
    seq_len = served + 1 if served > ORIG else None
    ref, ref_factor = ROPE_INIT_FUNCTIONS["longrope"](cfg, "cpu", seq_len=seq_len)
    ours, factor = inv_freq(
        24,
        10_000.0,
        scaling | {"original_max_position_embeddings": ORIG},
        max_positions=served,
        max_position_embeddings=4 * ORIG,
    )
    torch.testing.assert_close(ours, ref, atol=0, rtol=1e-6)
    assert factor == pytest.approx(ref_factor) and factor > 1.0  # sqrt(1 + ln 4 / ln 64)
    warned = [r.getMessage() for r in caplog.records if "longrope" in r.getMessage()]
    assert warned == (
        [
            f"longrope: long factors for every sequence, since max_model_len {served} > "
            f"original_max_position_embeddings {ORIG} (as vLLM); --max-model-len {ORIG} keeps the "
            "short factors"
        ]
        if served > ORIG
        else []
    )


def test_table_scales_cos_and_sin_by_the_attention_factor() -> None:
    scaling = YARNS[3]
    table = rope_table(64, 10_000.0, scaling, 10, 4 * ORIG)
    assert table.shape == (10, 64)
    torch.testing.assert_close(table[0], torch.cat([torch.full((32,), 1.3), torch.zeros(32)]))
