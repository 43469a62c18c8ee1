"""Failure injection: the chaos actor, kill kinds and failure trace kinds."""
