"""Speech to text: real-time factor (seconds of audio transcribed per wall second) of 30-second clips on the
demo Whisper checkpoint (`spindle make-demo --whisper`), through the real server at concurrency 1 and 8, beside
transformers' ASR pipeline on the same checkpoint (one clip at a time, and 8 clips as one batch).

    python -m bench.audio [--clips 8] [--max-tokens 64]

The random model never says <|endoftext|>: every clip decodes until its limit, so both sides get the same
work: the server runs with --max-model-len (prompt 4 + --max-tokens), transformers with max_new_tokens.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import io
import sys
import tempfile
import time
from pathlib import Path

import httpx
import soundfile as sf

from tests.e2e.conftest import start_server
from tests.helpers.audio import SR, demo_whisper, tone

CLIP_SECONDS = 30.0


def clips(n: int) -> list[bytes]:
    out = []
    for k in range(n):
        buf = io.BytesIO()
        sf.write(buf, tone(CLIP_SECONDS - 0.1, freq=200 + 90 * k, seed=k), SR, format="WAV")
        out.append(buf.getvalue())
    return out


def serve_rtf(url: str, data: list[bytes], concurrency: int) -> float:
    def one(blob: bytes) -> None:
        r = httpx.post(
            f"{url}/v1/audio/transcriptions", files={"file": ("a.wav", blob)}, data={"language": "en"}, timeout=600
        )
        r.raise_for_status()

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, data))
    return len(data) * CLIP_SECONDS / (time.perf_counter() - start)


def transformers_rtf(ckpt: Path, data: list[bytes], batch: int, max_tokens: int) -> float:
    import torch
    from transformers import pipeline

    torch.set_num_threads(1)  # as the engine's step (one intra-op thread): on 2 busy cores more threads only wait
    asr = pipeline("automatic-speech-recognition", model=str(ckpt), device="cpu", dtype=torch.float32)
    audio = [sf.read(io.BytesIO(b), dtype="float32")[0] for b in data]
    kw = {"language": "en", "task": "transcribe", "max_new_tokens": max_tokens}
    start = time.perf_counter()
    for i in range(0, len(audio), batch):
        asr([{"raw": a, "sampling_rate": SR} for a in audio[i : i + batch]], batch_size=batch, generate_kwargs=kw)
    return len(audio) * CLIP_SECONDS / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clips", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    a = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-audio-"))
    ckpt = demo_whisper(str(root))
    data = clips(a.clips)
    server = start_server(ckpt, root, "--max-num-seqs", "16", "--max-model-len", str(a.max_tokens + 4))
    try:
        serve_rtf(server.url, data[:1], 1)  # warm-up
        rows = [
            ("spindle, concurrency 1", serve_rtf(server.url, data, 1)),
            ("spindle, concurrency 8", serve_rtf(server.url, data, 8)),
        ]
    finally:
        server.stop()
    rows += [
        ("transformers pipeline, batch 1", transformers_rtf(ckpt, data, 1, a.max_tokens)),
        ("transformers pipeline, batch 8", transformers_rtf(ckpt, data, 8, a.max_tokens)),
    ]
    print(f"{a.clips} clips of {CLIP_SECONDS:g} s, {a.max_tokens} tokens each, demo Whisper (d_model 64)")
    for name, rtf in rows:
        print(f"  {name:34s} RTF {rtf:8.1f} audio s / wall s")
    base = rows[2][1]
    print(
        "  ratios to transformers batch 1: " + ", ".join(f"{n.split(',')[1].strip()} {r / base:.2f}x" for n, r in rows)
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
