"""Speech to text through the real server with the official `openai` SDK: transcriptions and translations equal
transformers' greedy Whisper on the random demo checkpoint for WAV (16 kHz mono, 44.1 kHz stereo), FLAC, MP3
and M4A made here; streamed == non-streamed; verbose_json / srt / vtt well formed; long audio split and joined;
language detected when absent; every bad input a 400 naming the problem, the server unaffected."""

from __future__ import annotations

import io
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf
import tokenizers

from server.multimodal.audio_decode import decode, split_points
from tests.e2e.conftest import Server, start_server
from tests.helpers.audio import SR, demo_whisper, encode, hf_features, hf_generate, hf_whisper, tone

MAX_NEW = 64  # the server's --max-model-len 68 less the 4-token prompt: the random model never stops by itself


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """transformers' references on one thread: on a busy machine, more threads wait on each other."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo_whisper(str(tmp_path_factory.mktemp("whisper")))


@pytest.fixture(scope="module")
def srv(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(ckpt, tmp_path_factory.mktemp("wsrv"), "--max-num-seqs", "16", "--max-model-len", str(MAX_NEW + 4))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", timeout=120)


@pytest.fixture(scope="module")
def hf(ckpt: Path) -> Any:
    return hf_whisper(ckpt)


def reference(hf: Any, ckpt: Path, audio16k: np.ndarray, max_new: int = MAX_NEW, **kw: Any) -> str:
    """transformers' greedy text of one window (special tokens skipped, stripped as the API answers)."""
    tokens = hf_generate(hf, hf_features(ckpt, audio16k), max_new, **kw)
    tok = tokenizers.Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    return str(tok.decode(tokens, skip_special_tokens=True)).strip()


def upload(data: bytes, name: str) -> tuple[str, bytes]:
    return (name, data)


CASES = {  # name -> (file bytes, the 16 kHz mono samples the reference hears)
    "wav16k": lambda: (encode(tone(3.0), SR, "wav"), None),
    "wav44k_stereo": lambda: (encode(tone(2.5, sr=44_100, freq=600, seed=2, channels=2), 44_100, "wav"), None),
    "flac": lambda: (encode(tone(2.0, freq=300, seed=3), SR, "flac"), None),
    "mp3": lambda: (encode(tone(2.0, freq=700, seed=4), SR, "mp3"), None),
    "m4a": lambda: (encode(tone(2.0, freq=500, seed=5), SR, "m4a"), None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_transcription_equals_transformers(client: openai.OpenAI, hf: Any, ckpt: Path, case: str) -> None:
    data, _ = CASES[case]()
    ext = case.split("_")[0].removesuffix("16k").removesuffix("44k")
    samples = sf.read(io.BytesIO(data), dtype="float32")[0] if case == "wav16k" else decode(data, 60)
    got = client.audio.transcriptions.create(model="tiny", file=upload(data, f"a.{ext}"), language="en")
    assert got.text == reference(hf, ckpt, samples, language="en", task="transcribe")
    assert got.text  # the random model always says something


def test_decoded_audio_is_the_signal() -> None:
    """The decoder's 16 kHz mono output of a 44.1 kHz stereo file is the mono mix, resampled; OGG / WebM decode
    to their length too (AAC's priming and padding make M4A a little longer)."""
    t = np.arange(2 * 44_100) / 44_100
    sine = np.sin(2 * np.pi * 440 * t).astype(np.float32)
    stereo = np.stack([0.5 * sine, 0.3 * sine], axis=1)
    got = decode(encode(stereo, 44_100, "wav"), 60)
    want = 0.4 * np.sin(2 * np.pi * 440 * np.arange(len(got)) / SR)
    assert len(got) == 2 * SR and np.abs(got - want)[200:-200].max() < 1e-3
    for fmt in ("ogg", "webm", "mp3", "m4a"):
        n = len(decode(encode(stereo, 44_100, fmt), 60))
        assert 2 * SR <= n <= 2 * SR + 1024, (fmt, n)


def test_translation_equals_transformers(client: openai.OpenAI, hf: Any, ckpt: Path) -> None:
    data = encode(tone(2.0, freq=800, seed=6), SR, "wav")
    samples = sf.read(io.BytesIO(data), dtype="float32")[0]
    got = client.audio.translations.create(model="tiny", file=upload(data, "a.wav"))
    # no language given: detected on the window, as transformers' generate does when it is not forced
    want_lang = hf.detect_language(hf_features(ckpt, samples))
    tok = tokenizers.Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    code = str(tok.id_to_token(int(want_lang[0]))).strip("<|>")
    assert got.text == reference(hf, ckpt, samples, language=code, task="translate")


def test_prompt_conditions_as_in_transformers(client: openai.OpenAI, hf: Any, ckpt: Path) -> None:
    """`prompt` goes before <|startoftranscript|> after <|startofprev|>, as transformers' prompt_ids."""
    from transformers import AutoTokenizer

    data = encode(tone(3.0, freq=510, seed=12), SR, "wav")
    samples = sf.read(io.BytesIO(data), dtype="float32")[0]
    ids = AutoTokenizer.from_pretrained(ckpt).get_prompt_ids("hello there", return_tensors="pt")
    got = client.audio.transcriptions.create(
        model="tiny", file=upload(data, "a.wav"), language="en", prompt="hello there"
    )
    want = reference(hf, ckpt, samples, MAX_NEW - len(ids), language="en", task="transcribe", prompt_ids=ids)
    assert got.text == want
    assert got.text != reference(hf, ckpt, samples, language="en", task="transcribe")


def test_stream_equals_non_stream(client: openai.OpenAI) -> None:
    data = encode(tone(4.0, freq=350, seed=7), SR, "flac")
    plain = client.audio.transcriptions.create(
        model="tiny", file=upload(data, "a.flac"), language="en", response_format="text"
    )
    events = list(
        client.audio.transcriptions.create(model="tiny", file=upload(data, "a.flac"), language="en", stream=True)
    )
    deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
    done = [e for e in events if e.type == "transcript.text.done"]
    assert len(done) == 1 and events[-1] is done[0] and len(deltas) > 1
    assert "".join(deltas) == done[0].text == plain.strip()
    assert done[0].usage is not None and done[0].usage.seconds == 4  # type: ignore[union-attr]


_SRT = re.compile(r"(\d+)\n(\d\d):(\d\d):(\d\d),(\d{3}) --> (\d\d):(\d\d):(\d\d),(\d{3})\n(.*)\n\n")
_VTT = re.compile(r"(\d\d):(\d\d):(\d\d)\.(\d{3}) --> (\d\d):(\d\d):(\d\d)\.(\d{3})\n(.*)\n\n")


def _secs(h: str, m: str, s: str, ms: str) -> float:
    return int(h) * 3600 + int(m) * 60 + int(s) + int(ms) / 1000


def test_verbose_json_srt_vtt(client: openai.OpenAI) -> None:
    data = encode(tone(5.0, freq=420, seed=8), SR, "wav")
    verbose = client.audio.transcriptions.create(
        model="tiny",
        file=upload(data, "a.wav"),
        language="en",
        response_format="verbose_json",
        timestamp_granularities=["segment"],
    )
    assert verbose.language == "english" and verbose.duration == pytest.approx(5.0)
    segs = verbose.segments or []
    assert segs and all(0 <= s.start <= s.end <= 5.0 for s in segs)
    assert all(s.tokens and s.avg_logprob <= 0 for s in segs)
    assert all(0.0 < s.no_speech_prob < 1.0 for s in segs) and len({s.no_speech_prob for s in segs}) == 1
    srt = client.audio.transcriptions.create(
        model="tiny", file=upload(data, "a.wav"), language="en", response_format="srt"
    )
    blocks = _SRT.findall(srt)
    assert "".join(f"{b[0]}\n" for b in blocks) and len(_SRT.sub("", srt)) == 0
    assert [int(b[0]) for b in blocks] == list(range(1, len(segs) + 1))
    assert [(_secs(*b[1:5]), _secs(*b[5:9])) for b in blocks] == [
        (pytest.approx(s.start), pytest.approx(s.end)) for s in segs
    ]
    assert [b[9] for b in blocks] == [s.text.strip() for s in segs]
    vtt = client.audio.transcriptions.create(
        model="tiny", file=upload(data, "a.wav"), language="en", response_format="vtt"
    )
    assert vtt.startswith("WEBVTT\n\n")
    cues = _VTT.findall(vtt[len("WEBVTT\n\n") :])
    assert len(_VTT.sub("", vtt[len("WEBVTT\n\n") :])) == 0 and [c[8] for c in cues] == [b[9] for b in blocks]


def test_long_audio_split_and_joined(client: openai.OpenAI, hf: Any, ckpt: Path) -> None:
    audio = np.concatenate(
        [
            tone(29.5, freq=300, seed=9),
            np.zeros(SR // 2, np.float32),
            tone(25.0, freq=900, seed=10),
            np.zeros(SR // 4, np.float32),
            tone(10.0, seed=11),
        ]
    )
    data = encode(audio, SR, "flac")
    starts = split_points(audio)
    assert len(starts) == 3 and 29 * SR <= starts[1] <= 30 * SR
    ends = starts[1:] + [len(audio)]
    want = " ".join(reference(hf, ckpt, audio[a:b], language="en", task="transcribe") for a, b in zip(starts, ends))
    got = client.audio.transcriptions.create(model="tiny", file=upload(data, "long.flac"), language="en")
    assert got.text == want
    events = list(
        client.audio.transcriptions.create(model="tiny", file=upload(data, "long.flac"), language="en", stream=True)
    )
    assert "".join(e.delta for e in events if e.type == "transcript.text.delta") == want == events[-1].text
    verbose = client.audio.transcriptions.create(
        model="tiny", file=upload(data, "long.flac"), language="en", response_format="verbose_json"
    )
    seeks = sorted({s.seek for s in verbose.segments or []})
    assert seeks == [round(a / SR * 100) for a in starts]
    assert all(s.start >= s.seek / 100 - 1e-6 for s in verbose.segments or [])


def _post(srv: Server, path: str = "/v1/audio/transcriptions", files: Any = None, **fields: Any) -> httpx.Response:
    return httpx.post(f"{srv.url}{path}", files=files, data=fields, timeout=60)


def _err(r: httpx.Response, status: int, *words: str) -> None:
    assert r.status_code == status, r.text
    msg = r.json()["error"]["message"]
    assert all(w in msg for w in words), msg


def test_bad_inputs(srv: Server) -> None:
    wav = encode(tone(1.0), SR, "wav")
    m4a = encode(tone(1.0), SR, "m4a")
    _err(_post(srv, files={"file": ("a.txt", b"hello, this is not audio at all" * 10)}), 400, "could not be decoded")
    _err(_post(srv, files={"file": ("a.m4a", m4a[: len(m4a) // 2])}), 400)
    _err(_post(srv, files={"file": ("a.wav", b"")}), 400, "empty")
    _err(_post(srv, files={"file": ("a.wav", encode(np.zeros(0, np.float32), SR, "wav"))}), 400, "zero length")
    _err(_post(srv, files={"file": ("a.wav", wav)}, response_format="xml"), 400, "response_format")
    _err(_post(srv, files={"file": ("a.wav", wav)}, response_format="verbose_json", stream="true"), 400, "stream")
    _err(_post(srv, files={"model": (None, "tiny")}), 400, "no `file` part")  # multipart, no file
    _err(
        _post(srv, files={"file": ("a.wav", wav)}, timestamp_granularities="word", response_format="verbose_json"),
        400,
        "word timestamps are not supported",
    )
    _err(_post(srv, files={"file": ("a.wav", wav)}, language="xx"), 400, "language")
    _err(_post(srv, files={"file": ("a.wav", wav)}, temperature="2"), 400, "temperature")
    _err(_post(srv, files={"file": ("a.wav", wav)}, model="other"), 404, "does not exist")
    r = httpx.post(f"{srv.url}/v1/audio/transcriptions", json={"file": "x"}, timeout=10)
    assert r.status_code == 415
    chat = httpx.post(
        f"{srv.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=10
    )
    _err(chat, 400, "speech-to-text model")
    ok = _post(srv, files={"file": ("a.wav", wav)}, language="en")
    assert ok.status_code == 200 and ok.json()["text"]


def test_audio_route_on_a_text_model(server: Server) -> None:
    r = _post(server, files={"file": ("a.wav", encode(tone(1.0), SR, "wav"))})
    _err(r, 400, "not a speech-to-text model")
    _err(_post(server, "/v1/audio/translations", files={"file": ("a.wav", b"x")}), 400, "not a speech-to-text model")


def test_limits_from_the_flags(ckpt: Path, tmp_path: Path) -> None:
    """--max-audio-filesize-mb and --max-audio-duration-s at, under and over, each a 400 naming its flag."""
    s = start_server(
        ckpt, tmp_path, "--max-audio-filesize-mb", "0.1", "--max-audio-duration-s", "2", "--max-model-len", "8"
    )
    try:

        def wav(frames: int) -> bytes:
            return encode(np.zeros(frames, np.float32), SR, "wav")  # 44-byte header + 2 bytes a frame

        for frames, status in ((2 * SR, 200), (2 * SR - 1, 200), (2 * SR + 1, 400)):
            r = _post(s, files={"file": ("a.wav", wav(frames))}, language="en")
            assert r.status_code == status, r.text
            if status == 400:
                _err(r, 400, "--max-audio-duration-s")
        size = 100_000  # the cap in bytes
        noise = np.random.default_rng(0).uniform(-1, 1, SR).astype(np.float32)
        blob = encode(noise, SR, "wav")  # 32,044 bytes, 1 s
        pad = b"\0" * (size - len(blob))  # trailing bytes past the WAV's data chunk are ignored by the decoder
        for extra, status in ((0, 200), (-1, 200), (1, 400)):
            body = blob + pad + b"\0" * max(extra, 0)
            body = body[: len(body) + extra] if extra < 0 else body
            r = _post(s, files={"file": ("a.wav", body)}, language="en")
            assert r.status_code == status, (len(body), r.text)
            if status == 400:
                _err(r, 400, "--max-audio-filesize-mb")
    finally:
        s.stop()


def test_ten_minutes(client: openai.OpenAI) -> None:
    """A 10-minute file (the default duration cap, exactly): 20 windows in one batch, segments in every one."""
    audio = np.concatenate([tone(30.0, freq=200 + 40 * k, seed=k) for k in range(20)])
    assert len(audio) == 600 * SR
    verbose = client.audio.transcriptions.create(
        model="tiny", file=upload(encode(audio, SR, "flac"), "ten.flac"), language="en", response_format="verbose_json"
    )
    assert verbose.duration == pytest.approx(600.0)
    assert sorted({s.seek for s in verbose.segments or []}) == [round(a / SR * 100) for a in split_points(audio)]
    assert len(split_points(audio)) == 21 and verbose.usage.seconds == 600  # type: ignore[union-attr]


def test_vllm_sampling_fields(srv: Server, client: openai.OpenAI, hf: Any, ckpt: Path) -> None:
    """vLLM's form fields through the real server: 16 tokens asked, transformers' 16-token greedy text answered
    (the random model never stops by itself, so the cap is what ends it); the bounds' 400s name the form field;
    a seed reproduces a sampled answer; stream_include_usage false leaves the usage out of the done event."""
    data = encode(tone(3.0, freq=610, seed=13), SR, "wav")
    samples = sf.read(io.BytesIO(data), dtype="float32")[0]
    got = client.audio.transcriptions.create(
        model="tiny", file=upload(data, "a.wav"), language="en", extra_body={"max_completion_tokens": 16}
    )
    assert got.text == reference(hf, ckpt, samples, 16, language="en", task="transcribe")
    assert got.text != reference(hf, ckpt, samples, language="en", task="transcribe")
    verbose = _post(
        srv, files={"file": ("a.wav", data)}, language="en", response_format="verbose_json", max_completion_tokens="16"
    )
    assert sum(len(s["tokens"]) for s in verbose.json()["segments"]) <= 16
    for path in ("/v1/audio/transcriptions", "/v1/audio/translations"):
        assert (
            _post(
                srv,
                path,
                files={"file": ("a.wav", data)},
                language="en",
                max_completion_tokens="64",
                top_p="1",
                top_k="-1",
                min_p="0",
                frequency_penalty="2",
                presence_penalty="-2",
                repetition_penalty="2",
            ).status_code
            == 200
        )
        for field, value in (
            ("max_completion_tokens", "65"),
            ("max_completion_tokens", "0"),
            ("top_p", "0"),
            ("top_k", "-2"),
            ("min_p", "1.01"),
            ("frequency_penalty", "2.01"),
            ("presence_penalty", "-2.01"),
            ("repetition_penalty", "0"),
            ("seed", str(1 << 63)),
            ("stream_include_usage", "true"),
        ):
            r = _post(srv, path, files={"file": ("a.wav", data)}, language="en", **{field: value})
            _err(r, 400)
            assert r.json()["error"]["param"] == field, (field, value, r.text)
    sampled = [
        _post(
            srv,
            files={"file": ("a.wav", data)},
            language="en",
            temperature="1",
            seed=str(s),
            max_completion_tokens="24",
        ).json()["text"]
        for s in (7, 7, 8)
    ]
    assert sampled[0] == sampled[1] != sampled[2]
    events = list(
        client.audio.transcriptions.create(
            model="tiny",
            file=upload(data, "a.wav"),
            language="en",
            stream=True,
            extra_body={"stream_include_usage": "false", "max_completion_tokens": 16},
        )
    )
    assert events[-1].type == "transcript.text.done" and events[-1].usage is None  # type: ignore[union-attr]
    assert events[-1].text == got.text


def test_to_language(srv: Server) -> None:
    data = encode(tone(2.0, freq=640, seed=14), SR, "wav")
    assert _post(srv, "/v1/audio/translations", files={"file": ("a.wav", data)}, to_language="en").status_code == 200
    _err(_post(srv, "/v1/audio/translations", files={"file": ("a.wav", data)}, to_language="fr"), 400, "to_language")
    assert _post(srv, files={"file": ("a.wav", data)}, language="fr", to_language="french").status_code == 200
    r = _post(srv, files={"file": ("a.wav", data)}, language="fr", to_language="de")
    _err(r, 400, "to_language", "translations")
    _err(_post(srv, files={"file": ("a.wav", data)}, language="fr", to_language="xx"), 400, "to_language")
