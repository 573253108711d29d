"""What the pooling routes compute from the engine's raw pooled outputs, below the routes: normalization,
activations and Matryoshka cuts (outputs.py), pairing and scores (scoring.py), Cohere's embedding types
(quantize.py). Pure functions over numpy arrays."""
