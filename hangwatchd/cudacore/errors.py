"""Errors a user can cause by handing us a file that is not a good coredump."""


class CoreDumpError(Exception):
    """The file is not a readable CUDA coredump; the message says why and where."""
