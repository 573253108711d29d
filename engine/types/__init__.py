"""The engine's shared data types: a request's state (Sequence) and the per-sequence state that other packages
own and fill (constraint, images and audio, draft acceptance). A leaf: it imports no other engine package but the
top-level contract modules, so any package may import it."""
