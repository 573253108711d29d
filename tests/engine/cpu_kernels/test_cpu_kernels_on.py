"""Where this machine can build the AVX512-BF16 kernels, every one of them is on: a kernel that fails its
self-check is switched off quietly in production (fail safe), and its tests would then only skip."""

from __future__ import annotations

import pytest
import torch

from engine.cpu_kernels import build, decode_attention, decoder_layer, delta_rule, gemm, layer_ops

pytestmark = pytest.mark.skipif(
    not build.enabled() or not build.NEEDS <= build.cpu_flags() or build.compiler() is None,
    reason="this machine cannot build the kernels",
)


def test_the_product_kernel_is_on() -> None:
    assert gemm.available()


def test_the_layer_kernels_are_on() -> None:
    assert layer_ops.available() and decoder_layer.available()


def test_the_decode_attention_kernel_is_on() -> None:
    q, cache = torch.zeros(1, 2, 32, dtype=torch.bfloat16), torch.zeros(1, 4, 1, 32, dtype=torch.bfloat16)
    assert decode_attention.usable(q, cache)


def test_the_delta_rule_kernel_is_on() -> None:
    rows, states = torch.zeros(1, 2, 16, dtype=torch.bfloat16), torch.zeros(1, 2, 16, 16)
    assert delta_rule.usable(rows, rows, rows, states)
