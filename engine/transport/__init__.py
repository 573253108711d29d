"""The engine subprocess's side of the pipes and sockets: frames, several API servers' channels."""
