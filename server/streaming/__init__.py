"""After validation: run `generate` and answer, as one JSON body or as server-sent events. Below the routes
(it never imports server.api); each wire format brings its formatter and framing."""
