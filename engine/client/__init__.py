"""Code that runs in the API-server process to start and talk to an engine core (the engine owns its contract: messages,
frames and this client)."""
