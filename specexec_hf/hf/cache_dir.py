"""Where specexec-hf caches converted models and measured forward profiles."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """The directory where converted models are cached.

    ``$SPECEXEC_HF_CACHE`` wins, then ``$XDG_CACHE_HOME/specexec-hf``, then ``~/.cache/specexec-hf``.
    """
    explicit = os.environ.get("SPECEXEC_HF_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "specexec-hf"
