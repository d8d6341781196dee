"""Routing policies of a data-parallel router: ``round-robin``, ``least-load`` and
``prefix-aware`` (core/interfaces/routing.py)."""
