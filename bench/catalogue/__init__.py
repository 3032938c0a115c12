"""The hang catalogue: real hang patterns from user reports, each a small script that really
hangs that way, run under one real daemon and scored on the verdict it gets.

``cases/`` holds the classes that run on a CPU (stdlib, or torch's gloo backend), ``gpu/`` those
that need a GPU; ``run.py`` runs them (``python3 -m bench.catalogue --help``).
"""
