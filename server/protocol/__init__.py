"""Wire formats: msgspec Structs for each API family's request and response bodies (no behaviour)."""
