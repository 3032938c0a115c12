"""Renderings of what the other stages found: text for a terminal, JSON, HTML. None computes anything."""
