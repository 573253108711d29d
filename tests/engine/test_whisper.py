"""Whisper in the engine against transformers' WhisperForConditionalGeneration.generate: greedy tokens for the
same features and decoder prompt (language, task, with and without timestamps), batched with other requests,
under preemption; the encoder run once per audio content; cross-attention K/V dropped when a request ends."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.core.engine_core import EngineCore
from engine.messages import AddRequest, AudioInput, RequestOutput, SamplingParams
from tests.helpers.audio import demo_whisper, hf_features, hf_generate, hf_whisper, hf_window_generate, tone
from tests.helpers.engine import make_core

SOT, EN, FR, TRANSLATE, TRANSCRIBE, NO_TS, EOT = 50258, 50259, 50265, 50358, 50359, 50363, 50257


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo_whisper(str(tmp_path_factory.mktemp("whisper")))


@pytest.fixture(scope="module")
def hf(ckpt: Path) -> Any:
    return hf_whisper(ckpt)


def audio_input(features: torch.Tensor, timestamps: bool = False, rules: bool = True) -> AudioInput:
    f = features[0].contiguous().numpy()
    return AudioInput(hashlib.sha256(f.tobytes()).hexdigest(), f.tobytes(), list(f.shape), timestamps, rules)


def run(
    core: EngineCore,
    reqs: list[tuple[str, list[int], AudioInput, int]],
    max_tokens: int,
    at_step: dict[str, int] | None = None,
) -> dict[str, list[int]]:
    outs: dict[str, list[RequestOutput]] = {rid: [] for rid, *_ in reqs}
    pending = list(reqs)
    step = 0
    while pending or core.has_work:
        for r in [r for r in pending if (at_step or {}).get(r[0], 0) <= step]:
            pending.remove(r)
            rid, prompt, audio, _ = r
            core.add_request(
                AddRequest(
                    rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0), float(step), audio=audio
                )
            )
        for o in core.step():
            assert o.error is None, o.error
            outs[o.request_id].append(o)
        step += 1
        assert step < 5000
    return {rid: [t for o in os for t in o.new_token_ids] for rid, os in outs.items()}


def strip_eos(tokens: list[int]) -> list[int]:
    return tokens[:-1] if tokens and tokens[-1] == EOT else tokens


CASES = [  # (prompt, transformers' generate kwargs, timestamps)
    ([SOT, EN, TRANSCRIBE, NO_TS], {"language": "en", "task": "transcribe"}, False),
    ([SOT, FR, TRANSLATE, NO_TS], {"language": "fr", "task": "translate"}, False),
    ([SOT, EN, TRANSCRIBE], {"language": "en", "task": "transcribe", "return_timestamps": True}, True),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_greedy_equals_transformers_batched(ckpt: Path, hf: Any, case: int) -> None:
    prompt, kw, ts = CASES[case]
    feats = [
        hf_features(ckpt, tone(s, freq=f, seed=k)) for k, (s, f) in enumerate([(3.0, 440), (7.5, 900), (1.2, 250)])
    ]
    want = [strip_eos(hf_generate(hf, f, 40, **kw)) for f in feats]
    if ts:  # generate's seek loop re-decodes after a timestamp; one window's decode is the reference
        want = [strip_eos(hf_window_generate(hf, f, prompt, 40, True)) for f in feats]
    core = make_core(ckpt, num_blocks=64, block_size=16)
    got = run(
        core, [(f"r{i}", prompt, audio_input(f, ts), 0) for i, f in enumerate(feats)], 40, at_step={"r2": 3}
    )  # the third joins mid-decode of the others
    for i in range(len(feats)):
        assert strip_eos(got[f"r{i}"]) == want[i]
    assert core.runner.audio is not None and core.runner.audio.encoder_runs == 3


def test_encoder_once_per_content_and_cross_kv_released(ckpt: Path) -> None:
    core = make_core(ckpt, num_blocks=64, block_size=16)
    a = audio_input(hf_features(ckpt, tone(2.0)))
    got = run(core, [("a", [SOT, EN, TRANSCRIBE, NO_TS], a, 0), ("b", [SOT, EN, TRANSCRIBE, NO_TS], a, 0)], 10)
    assert got["a"] == got["b"]
    runner = core.runner.audio
    assert runner is not None and runner.encoder_runs == 1
    again = run(core, [("c", [SOT, FR, TRANSLATE, NO_TS], a, 0)], 5)
    assert runner.encoder_runs == 1 and runner.cache_hits >= 1 and again["c"]
    assert core.stats().image_cache_hits == runner.cache_hits  # spindle_mm_encoder_cache_hits counts audio too
    assert not core.scheduler.has_unfinished


def test_preemption_recomputes_the_decoder_only(ckpt: Path, hf: Any) -> None:
    feats = [hf_features(ckpt, tone(2.0 + k, freq=300 + 200 * k, seed=k)) for k in range(4)]
    want = [strip_eos(hf_generate(hf, f, 60, language="en", task="transcribe")) for f in feats]
    core = make_core(ckpt, num_blocks=12, block_size=16)  # too few blocks for 4 x 64 tokens at once
    got = run(core, [(f"r{i}", [SOT, EN, TRANSCRIBE, NO_TS], audio_input(f), 0) for i, f in enumerate(feats)], 60)
    assert core.scheduler.stats().num_preemptions > 0
    assert [strip_eos(got[f"r{i}"]) for i in range(4)] == want
    assert core.runner.audio is not None and core.runner.audio.encoder_runs == 4


def test_refusals(ckpt: Path) -> None:
    core = make_core(ckpt, num_blocks=16)
    core.add_request(AddRequest("text", [SOT, EN], SamplingParams(max_tokens=2), 0.0))
    bad = AudioInput("h", b"\0" * 16, [2, 2])
    core.add_request(AddRequest("shape", [SOT, EN], SamplingParams(max_tokens=2), 0.0, audio=bad))
    outs = {o.request_id: o for o in core.step()}
    assert "needs audio" in (outs["text"].error or "")
    assert "do not fit this model" in (outs["shape"].error or "")


def test_no_prefix_cache_across_audio(ckpt: Path) -> None:
    """The same decoder tokens over different audio have different K/V: a Whisper engine shares no blocks."""
    core = make_core(ckpt, num_blocks=64, block_size=4)
    assert not core.block_manager.enable_prefix_caching
    a, b = (audio_input(hf_features(ckpt, tone(2.0, freq=f, seed=s))) for f, s in ((300, 1), (900, 2)))
    run(core, [("a", [SOT, EN, TRANSCRIBE, NO_TS], a, 0)], 8)
    run(core, [("b", [SOT, EN, TRANSCRIBE, NO_TS], b, 0)], 8)
    assert core.scheduler.stats().prefix_cache_hits == 0


def triton_child(ckpt: str, feats_file: str, out: str) -> None:
    """Entry point of the subprocess (TRITON_INTERPRET set before triton is imported): the GPU path's greedy."""
    import engine.core.engine_core
    from engine.config import EngineConfig
    from engine.execution.model_runner import ModelRunner

    torch.set_num_threads(1)
    engine.core.engine_core.make_runner = lambda cfg: ModelRunner(cfg, use_triton=True)  # type: ignore[assignment]
    core = EngineCore(EngineConfig(model=ckpt, num_blocks=64, block_size=16))
    assert core.runner.use_triton
    feats = torch.load(feats_file)
    got = run(
        core,
        [(f"r{i}", [SOT, EN, TRANSCRIBE, NO_TS], audio_input(f), 0) for i, f in enumerate(feats)],
        12,
        at_step={"r1": 2},
    )
    torch.save(got, out)


def test_triton_kernel_path_equals_transformers(ckpt: Path, hf: Any, tmp_path: Path) -> None:
    """The decoder's self-attention through the Triton paged kernels (the GPU path), run by Triton's interpreter
    on CPU in a fresh process, gives transformers' greedy tokens."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    feats = [hf_features(ckpt, tone(2.0, freq=f, seed=s)) for f, s in ((330, 3), (770, 4))]
    torch.save(feats, tmp_path / "feats.pt")
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_whisper as t; "
        f"t.triton_child({str(ckpt)!r}, {str(tmp_path / 'feats.pt')!r}, {str(tmp_path / 'out.pt')!r})"
    )
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        cwd=Path(__file__).parents[2],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(tmp_path / "out.pt")
    for i, f in enumerate(feats):
        assert strip_eos(got[f"r{i}"]) == strip_eos(hf_generate(hf, f, 12, language="en", task="transcribe"))


def test_no_speech_prob_equals_transformers(ckpt: Path, hf: Any) -> None:
    """Whisper's no_speech_prob: softmax of the raw logits at <|startoftranscript|>, for <|nospeech|> (50362),
    reported with the finish; also when a prompt (<|startofprev|> ...) comes first."""
    feats = [hf_features(ckpt, tone(2.0, freq=f, seed=s)) for f, s in ((330, 5), (610, 6))]
    prompts = [[SOT, EN, TRANSCRIBE, NO_TS], [50361, 7751, 456, SOT, EN, TRANSCRIBE, NO_TS]]
    core = make_core(ckpt, num_blocks=64, block_size=16)
    for i, (f, prompt) in enumerate(zip(feats, prompts)):
        core.add_request(
            AddRequest(f"r{i}", prompt, SamplingParams(max_tokens=3, temperature=0.0), 0.0, audio=audio_input(f))
        )
    finals: dict[str, RequestOutput] = {}
    while core.has_work:
        for o in core.step():
            if o.finish_reason is not None:
                finals[o.request_id] = o
    for i, (f, prompt) in enumerate(zip(feats, prompts)):
        with torch.no_grad():
            logits = hf(input_features=f, decoder_input_ids=torch.tensor([prompt])).logits[0, prompt.index(SOT)]
        want = float(torch.softmax(logits.float(), dim=-1)[50362])
        got = finals[f"r{i}"].no_speech_prob
        assert got is not None and got == pytest.approx(want, rel=1e-4, abs=1e-7)
