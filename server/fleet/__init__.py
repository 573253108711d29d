"""Several models behind one server (`--models-dir`): the catalog of what the folder holds, the registry that loads
and unloads each model's engine, and the front app that routes each request by its `model` field."""
