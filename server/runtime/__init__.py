"""Process start-up: what runs in each process the server starts, and how it learns its role.

- http_server.py: one serving process (Hypercorn + create_app's app): `spindle serve`, `spindle render`, and
  each API process of --api-server-count; SIGTERM drains, SIGINT stops.
- launcher.py: --api-server-count N: one listening socket, the engine cores, N API processes; serves no HTTP.
- api_process.py: `python -m server.runtime.api_process`, the launcher's API process.
- worker.py: WorkerContext, an API process's role (its fds, its shared state), passed to create_app(worker=...).
- hypercorn_config.py, sockets.py, logs.py: Hypercorn's config, the listening sockets, logging (once each).
- headless.py: --headless, a node other than 0 running only engine ranks.

server/cli.py turns argv into a ServerConfig and calls one of these; none of them imports the CLI.
"""
