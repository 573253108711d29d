"""HTTP routes, one module per route family."""
