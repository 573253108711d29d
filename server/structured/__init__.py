"""Structured output on the server's side: a request's constraint (constraint.py) and its answer budget, tool
parameters the engine enforces, the tool-call and reasoning parsers of each choice (parsing.py), and the finished
answer checked against its schema (output_check.py)."""
