"""Where the repository lies, for tests that run its commands in a subprocess."""

import pathlib

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
