"""One package per API family: its wire structs (protocol.py), its routes, its formatter and what only it uses.
Below them all, server/request/ is the path every family shares."""
