"""Demo checkpoints and offline tokenizers: random-weight models with real vocabularies, for the demo, tests and
benchmarks."""
