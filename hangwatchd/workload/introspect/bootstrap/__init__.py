"""The directory ``hangwatchd run`` puts first on a job's PYTHONPATH: its ``sitecustomize``
installs the reporter in every Python process of the job (this file makes the directory
part of the package, so that the wheel carries it)."""
