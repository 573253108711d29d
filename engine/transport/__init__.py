"""The engine subprocess's side of the pipes and sockets: frames, the read/step loop, several API servers' channels."""
