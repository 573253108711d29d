"""Helpers more than one test module needs, written once: processes, engine cores, API error bodies."""
