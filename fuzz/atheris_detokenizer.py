"""Coverage-guided fuzzing of server/request/detokenizer.py (atheris / libFuzzer).

    python fuzz/atheris_detokenizer.py -atheris_runs=20000
    python fuzz/atheris_detokenizer.py -max_total_time=600 corpus_dir/

Each input picks a tokenizer, a prompt, generated ids (any id, out-of-range ones included), a split
into engine steps, stop strings and flags, and checks the detokenizer against the reference model in
detok_support.py. A mismatch or any exception other than DetokenizeError for bad ids crashes the run.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import atheris  # noqa: E402

with atheris.instrument_imports(include=["server"]):
    from server.request.detokenizer import DetokenizeError  # noqa: E402

from detok_support import FRAGMENTS, FUZZ_FAMILIES, expected_output, run_stream, tokenizer  # noqa: E402

TOKENIZERS = {f: tokenizer(f) for f in FUZZ_FAMILIES}


def one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    family = FUZZ_FAMILIES[fdp.ConsumeIntInRange(0, len(FUZZ_FAMILIES) - 1)]
    tok = TOKENIZERS[family]
    n = tok.get_vocab_size(with_added_tokens=True)
    prompt = tok.encode(fdp.PickValueInList(["", "Hi", "你好", "a  "]), add_special_tokens=fdp.ConsumeBool()).ids
    gen: list[int] = []
    for _ in range(fdp.ConsumeIntInRange(0, 30)):
        kind = fdp.ConsumeIntInRange(0, 9)
        if kind < 5:  # real text
            gen += tok.encode(fdp.PickValueInList(FRAGMENTS), add_special_tokens=False).ids
        elif kind < 9:
            gen.append(fdp.ConsumeIntInRange(0, n - 1))
        else:
            gen.append(fdp.ConsumeIntInRange(-3, n + 3))
    steps = [fdp.ConsumeIntInRange(1, 6) for _ in range(fdp.ConsumeIntInRange(1, 4))]
    stops = [fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(1, 6)) for _ in range(fdp.ConsumeIntInRange(0, 3))]
    skip, include = fdp.ConsumeBool(), fdp.ConsumeBool()
    min_tokens = fdp.ConsumeIntInRange(0, 8)
    bad = any(not 0 <= i < n for i in gen)
    try:
        got = run_stream(tok, prompt, gen, steps, skip=skip, stops=stops, include=include, min_tokens=min_tokens)
    except DetokenizeError:
        if not bad:
            raise
        return
    if any(not 0 <= i < n for i in gen[: got.num_tokens]):  # ids after a stop are never consumed
        raise AssertionError(f"out-of-vocabulary ids {gen} were accepted")
    if bad:
        return
    expected = expected_output(tok, prompt, gen, skip, stops, include, min_tokens)
    if expected is None:
        return  # the prompt's text is not a prefix of prompt+generation: no reference
    assert (got.text, got.stop_reason) == expected, (family, prompt, gen, steps, stops, skip, include, min_tokens)
    assert "".join(got.deltas) == got.text


def main() -> None:
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
