"""Qwen2-VL in the engine against transformers' Qwen2VLForConditionalGeneration: greedy tokens with images under
chunked prefill and preemption, text-only prompts as plain Qwen2, the encoder run once per image, and prefix
caching that never shares KV between different images behind the same text."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from engine.core.engine_core import EngineCore
from engine.messages import IMAGE_CACHE_MISS, AddRequest, ImageInput, RequestOutput
from engine.multimodal.processing import (
    IMAGE_PAD_ID,
    expand_placeholders,
    image_hash,
    make_processor,
    num_image_tokens,
    process_image,
    read_preprocessor_config,
)
from tests.helpers import engine as helpers
from tests.helpers.engine import greedy, make_core

VISION_START, VISION_END = 151652, 151653


def picture(seed: int, h: int, w: int) -> Image.Image:
    rng = np.random.RandomState(seed)
    return Image.fromarray(rng.randint(0, 255, (h, w, 3), dtype=np.uint8))


def build(
    ckpt: Path, text_before: list[int], images: list[Image.Image], text_after: list[int]
) -> tuple[list[int], list[ImageInput], dict[str, Any]]:
    """A prompt with one <|vision_start|><|image_pad|><|vision_end|> per image, expanded; the engine's image
    inputs and transformers' inputs."""
    proc = make_processor(read_preprocessor_config(ckpt))
    ids = list(text_before)
    for i, _ in enumerate(images):
        ids += [VISION_START, IMAGE_PAD_ID, VISION_END] + ([100 + i] if i + 1 < len(images) else [])
    ids += text_after
    done = [process_image(proc, im) for im in images]
    expanded, offsets = expand_placeholders(ids, [num_image_tokens(g) for _, g in done])
    mm = [
        ImageInput(image_hash(px, g), off, num_image_tokens(g), g, px.tobytes(), list(px.shape), "float32")
        for (px, g), off in zip(done, offsets)
    ]
    hf = {
        "pixel_values": torch.from_numpy(np.concatenate([px for px, _ in done])),
        "image_grid_thw": torch.tensor([g for _, g in done]),
    }
    return expanded, mm, hf


def hf_greedy(ckpt: Path, prompt: list[int], hf: dict[str, Any] | None, n: int) -> list[int]:
    ids = torch.tensor([prompt])
    extra: dict[str, Any] = dict(hf, mm_token_type_ids=(ids == IMAGE_PAD_ID).int()) if hf else {}
    return helpers.hf_greedy(
        ckpt, prompt, n, "Qwen2VLForConditionalGeneration", attention_mask=torch.ones_like(ids), **extra
    )


def run(core: EngineCore, reqs: list[AddRequest]) -> dict[str, list[int]]:
    outs: dict[str, list[RequestOutput]] = {r.request_id: [] for r in reqs}
    for r in reqs:
        core.add_request(r)
    steps = 0
    while core.has_work:
        for o in core.step():
            assert o.finish_reason != "error", o.error
            outs[o.request_id].append(o)
        steps += 1
        assert steps < 5000
    return {k: [t for o in v for t in o.new_token_ids] for k, v in outs.items()}


TEXT = [9707, 11, 1246, 525, 498, 30, 220, 16, 17, 18]  # "Hello, how are you? 123"


def test_text_only_prompt_is_plain_qwen2(qwen2_vl_ckpt: Path, tmp_path: Path) -> None:
    """The VL checkpoint on text equals a Qwen2 checkpoint with the same language weights (and transformers)."""
    qwen2 = tmp_path / "qwen2"
    shutil.copytree(qwen2_vl_ckpt, qwen2)
    cfg = json.loads((qwen2 / "config.json").read_text())
    text = {
        **cfg["text_config"],
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "rope_theta": cfg["text_config"]["rope_parameters"]["rope_theta"],
    }
    text.pop("rope_parameters")
    (qwen2 / "config.json").write_text(json.dumps(text))
    weights = load_file(qwen2 / "model.safetensors")
    save_file({k: v for k, v in weights.items() if not k.startswith("visual.")}, qwen2 / "model.safetensors")
    prompt = TEXT * 3
    vl, plain = make_core(qwen2_vl_ckpt), make_core(qwen2)
    from engine.types.sequence import ScheduledSeq, Sequence

    logits = []
    for core in (vl, plain):
        seq = Sequence.new("a", prompt, greedy(1), 0.0)
        core.block_manager.allocate(seq, len(prompt))
        logits.append(core.runner.execute([ScheduledSeq(seq, len(prompt))]).logits.clone())
    torch.testing.assert_close(logits[0], logits[1], atol=0, rtol=0)
    got = run(vl, [AddRequest("t", prompt, greedy(8), 0.0)])["t"]
    assert got == hf_greedy(qwen2_vl_ckpt, prompt, None, 8)


REGIMES = {"together": {}, "chunked": {"max_num_batched_tokens": 7}, "preemption": {"num_blocks": 14, "block_size": 4}}


@pytest.mark.parametrize("regime", list(REGIMES))
def test_images_match_transformers(qwen2_vl_ckpt: Path, regime: str) -> None:
    core = make_core(qwen2_vl_ckpt, **REGIMES[regime])
    cases = {
        "one": build(qwen2_vl_ckpt, TEXT[:4], [picture(1, 60, 90)], TEXT),
        "two": build(qwen2_vl_ckpt, TEXT[:2], [picture(2, 56, 56), picture(3, 112, 84)], TEXT[:5]),
    }
    n = 16
    got = run(
        core, [AddRequest(k, p, greedy(n), float(i), mm_inputs=mm) for i, (k, (p, mm, _)) in enumerate(cases.items())]
    )
    for k, (p, _, hf) in cases.items():
        assert got[k] == hf_greedy(qwen2_vl_ckpt, p, hf, n), (k, regime)
    # the encoder ran once per image, even when chunks cut through an image or a request was preempted
    assert core.runner.images is not None and core.runner.images.encoder_runs == 3
    if regime == "preemption":
        assert core.stats().num_preemptions > 0


def test_output_depends_on_the_image(qwen2_vl_ckpt: Path) -> None:
    core = make_core(qwen2_vl_ckpt)
    a = build(qwen2_vl_ckpt, TEXT[:4], [picture(1, 60, 90)], TEXT)
    b = build(qwen2_vl_ckpt, TEXT[:4], [picture(5, 60, 90)], TEXT)
    got = run(
        core,
        [AddRequest("a", a[0], greedy(8), 0.0, mm_inputs=a[1]), AddRequest("b", b[0], greedy(8), 0.0, mm_inputs=b[1])],
    )
    assert a[0] == b[0] and got["a"] != got["b"]


def test_prefix_cache_never_shares_blocks_across_images(qwen2_vl_ckpt: Path) -> None:
    """A, B, A with the same text: each answer is transformers' for its own image; the second A hits the cache."""
    core = make_core(qwen2_vl_ckpt, block_size=4)
    a = build(qwen2_vl_ckpt, TEXT, [picture(11, 84, 84)], TEXT)
    b = build(qwen2_vl_ckpt, TEXT, [picture(12, 84, 84)], TEXT)
    assert a[0] == b[0]
    n = 8
    want = {"a": hf_greedy(qwen2_vl_ckpt, a[0], a[2], n), "b": hf_greedy(qwen2_vl_ckpt, b[0], b[2], n)}
    assert want["a"] != want["b"]
    for rid, (p, mm, _) in (("a", a), ("b", b), ("a", a)):
        hits = core.block_manager.prefix_cache_hits
        assert run(core, [AddRequest(rid, p, greedy(n), 0.0, mm_inputs=mm)])[rid] == want[rid]
        gained = core.block_manager.prefix_cache_hits - hits
        if rid == "b":  # only the text before the image is shared
            assert gained <= (len(TEXT) + 1) // 4 * 4
    assert gained >= len(a[0]) - 4  # the second A reused nearly its whole prompt


def test_bad_image_inputs_are_refused(qwen2_vl_ckpt: Path) -> None:
    core = make_core(qwen2_vl_ckpt)
    p, mm, _ = build(qwen2_vl_ckpt, TEXT[:4], [picture(1, 60, 90)], TEXT)
    bad = [
        ImageInput(mm[0].hash, mm[0].offset + 1, mm[0].length, mm[0].grid_thw, mm[0].data, mm[0].shape),
        ImageInput(mm[0].hash, mm[0].offset, mm[0].length, mm[0].grid_thw, mm[0].data[:-4], mm[0].shape),
        ImageInput("unknown", mm[0].offset, mm[0].length, mm[0].grid_thw),
    ]
    for i, m in enumerate(bad):
        core.add_request(AddRequest(f"x{i}", p, greedy(2), 0.0, mm_inputs=[m]))
    outs = core.step()
    assert [o.finish_reason for o in outs] == ["error"] * 3
    assert outs[2].error is not None and outs[2].error.startswith(IMAGE_CACHE_MISS)  # the API resends pixels
    # once encoded, the same image by hash only: no pixels, the encoder's output from the cache, counted
    run(core, [AddRequest("full", p, greedy(2), 0.0, mm_inputs=mm)])
    by_hash = [ImageInput(mm[0].hash, mm[0].offset, mm[0].length, mm[0].grid_thw)]
    hits = core.stats().image_cache_hits
    run(core, [AddRequest("hash", p, greedy(2), 0.0, mm_inputs=by_hash)])
    assert core.stats().image_cache_hits == hits + 1 and core.runner.images.encoder_runs == 1  # type: ignore[union-attr]
