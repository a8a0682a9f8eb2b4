"""The project's own packaging builds without a warning and installs the layout CONTRIBUTING.md describes."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What a wheel is built from (pyproject.toml's packages and package-dir, and the readme it names).
SOURCES = ("pyproject.toml", "README.md", "specexec_hf", "integrations", "patches")


def test_wheel_builds_without_warnings_and_keeps_the_installed_layout(tmp_path):
    # A copy, so the build leaves no build/ or egg-info in the checkout; without the shipped draft's 19 MB of
    # weights, whose compression would be most of the test's time (the draft's config stands for the data files).
    skipped = shutil.ignore_patterns("__pycache__", "*.egg-info", "*.safetensors")
    for name in SOURCES:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, tmp_path / name, ignore=skipped)
        else:
            shutil.copy(source, tmp_path / name)
    # The installed setuptools, as `pip install --no-build-isolation` builds; every warning is an error.
    build = "from setuptools import build_meta; print(build_meta.build_wheel('dist'))"
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", build], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    wheel = tmp_path / "dist" / result.stdout.strip().splitlines()[-1]
    names = set(zipfile.ZipFile(wheel).namelist())
    for expected in (
        "specexec_hf/patches/transformers_generate.py",
        "specexec_hf/integrations/vllm.py",
        "specexec_hf/vllm/proposer.py",
        "specexec_hf/vllm/seams.py",
        "specexec_hf/patches/patch.py",
        "specexec_hf/models/data/smollm2_draft.json",
        "specexec_hf/tools/data/prompts_eval.jsonl",
    ):
        assert expected in names
