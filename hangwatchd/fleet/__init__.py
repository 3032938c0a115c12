"""Many nodes: each node's incidents in a shared S3-compatible store, and job-wide capture requests through it.

The local state dir stays the node's source of truth; this package only copies
finished incidents out (``uploader``), carries capture requests between nodes
(``requests``) and reads a job back as one merged incident (``reader``).
"""
