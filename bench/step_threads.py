"""One thread against all of torch's threads per CPU step (EngineConfig.threaded_step_flops inf vs 0), on one
checkpoint: a prefill of B prompts as one step, then decode steps at each batch size; wall and CPU per step.

    python -m bench.step_threads --model DIR [--dtype bfloat16] [--prefill 16x128] [--batch 1 4 8 16 32]
                                 [--rounds 2] [--steps 12]

Both engine cores live in this process and are run alternately, so each pair of figures shares the box's load.
"""

from __future__ import annotations

import argparse
import random
import time

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.hugepages import reexec_with_huge_pages
from engine.messages import AddRequest, SamplingParams


def add(core: EngineCore, tag: str, count: int, prompt_len: int, max_tokens: int, rng: random.Random) -> list[str]:
    ids = [f"{tag}-{i}" for i in range(count)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for rid in ids:
        core.add_request(AddRequest(rid, [rng.randrange(3, core.vocab_size) for _ in range(prompt_len)], params, 0.0))
    return ids


def timed(core: EngineCore, steps: int | None) -> tuple[float, float, int]:
    """(wall s, CPU s, steps) for `steps` steps, or until the core has no work (None)."""
    t0, c0, n = time.perf_counter(), time.process_time(), 0
    while core.has_work and (steps is None or n < steps):
        core.step()
        n += 1
    return time.perf_counter() - t0, time.process_time() - c0, n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prefill", default="16x128", help="PROMPTSxTOKENS run as one prefill")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    reexec_with_huge_pages()  # as the engine process runs (engine/hugepages.py)
    prompts, tokens = (int(x) for x in args.prefill.split("x"))
    cores = {
        name: EngineCore(
            EngineConfig(
                model=args.model,
                dtype=args.dtype,
                enable_prefix_caching=False,
                max_num_batched_tokens=max(2048, prompts * tokens),
                threaded_step_flops=flops,
            )
        )
        for name, flops in (("one thread", float("inf")), ("all threads", 0.0))
    }
    rng = random.Random(0)
    for r in range(args.rounds):
        for name, core in cores.items():
            add(core, f"p{r}", prompts, tokens, 1, rng)
            wall, cpu, steps = timed(core, None)
            print(f"prefill {prompts}x{tokens} round {r} {name}: {wall:.2f} s wall, {cpu:.2f} s CPU, {steps} step(s)")
    for batch in args.batch:
        for r in range(args.rounds):
            for name, core in cores.items():
                ids = add(core, f"d{batch}-{r}", batch, 64, args.steps + 3, rng)  # every timed step decodes them all
                timed(core, 2)  # the prefill and a first decode
                wall, cpu, steps = timed(core, args.steps)
                if steps == 0:  # the requests ended at once (e.g. the prompt fills max_model_len): nothing timed
                    raise SystemExit(f"decode batch {batch}: no step to time; use a checkpoint with a longer context")
                print(
                    f"decode batch {batch} round {r} {name}: {wall / steps * 1e3:.1f} ms wall, "
                    f"{cpu / steps * 1e3:.1f} ms CPU per step"
                )
                core.abort(ids)
                timed(core, None)


if __name__ == "__main__":
    main()
