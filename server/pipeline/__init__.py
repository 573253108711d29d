"""The request pipeline between the routes and the engine: validate and build the engine request,
admit or refuse, send to the engine (AsyncLLM), and turn each step's token ids back into text."""
