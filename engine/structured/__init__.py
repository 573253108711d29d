"""Constrained decoding: grammars from StructuredOutputs, compiled off the step, masks applied before sampling."""
