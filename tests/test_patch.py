"""The Patch helper every patch goes through: idempotent, reversible to the exact attribute, refusing a changed
signature or another release line before it replaces anything."""

from __future__ import annotations

import sys
import types

import pytest
from hypothesis import given
from hypothesis import strategies as st

from specexec_hf.patches.patch import Patch, Release, UnsupportedRelease

# A library the patches below are "written for", importable by name as Release reads its version.
LIBRARY = sys.modules.setdefault("fake_library", types.ModuleType("fake_library"))
LIBRARY.__version__ = "1.4.2"
RELEASE = Release("fake_library", ">=1.4,<1.5", "fake_library==1.4.2")


class Base:
    def step(self, x):
        return ("base", x)


class Child(Base):
    @staticmethod
    def helper(x):
        return ("helper", x)


def doubling(original):
    def replacement(*args):
        return ("patched", original(*args))

    return replacement


def owner_state(owner) -> dict:
    return dict(vars(owner))


# Where a patched attribute can live: defined on the class, inherited from a base, looked up on an instance.
CASES = {
    "own method": lambda: (Base, "step", ("self", "x")),
    "inherited method": lambda: (Child, "step", ("self", "x")),
    "static method": lambda: (Child, "helper", ("x",)),
    "instance": lambda: (Child(), "step", ("x",)),
}


@given(case=st.sampled_from(sorted(CASES)), verbs=st.lists(st.sampled_from(["apply", "revert"]), max_size=8))
def test_any_sequence_of_verbs_leaves_the_owner_as_applied_or_as_it_was(case, verbs):
    owner, name, parameters = CASES[case]()
    before = owner_state(owner)
    original = getattr(owner, name)
    patch = Patch(owner, name, parameters, doubling, RELEASE)
    try:
        for verb in verbs:
            getattr(patch, verb)()
            if patch.applied:
                assert patch.original == original
                call = getattr(owner, name)
                arguments = (1,) if parameters[0] != "self" else (owner(), 1)
                assert call(*arguments)[0] == "patched"
            else:
                assert owner_state(owner) == before
        assert patch.applied == (bool(verbs) and verbs[-1] == "apply")
    finally:
        patch.revert()
    assert owner_state(owner) == before
    assert getattr(owner, name) == original


def test_a_changed_signature_is_refused_naming_both_and_nothing_is_replaced():
    patch = Patch(Base, "step", ("self", "x", "y"), doubling, RELEASE, "the test's wrapper", "skip the wrapper")
    with pytest.raises(UnsupportedRelease, match=r"Base\.step takes \(self, x\), but the test's wrapper replaces it "
                       r"as \(self, x, y\) .*fake_library==1\.4\.2.*skip the wrapper"):  # fmt: skip
        patch.apply()
    assert not patch.applied and Base.step(Base(), 1) == ("base", 1)
    with pytest.raises(RuntimeError, match="not applied"):
        patch.original  # noqa: B018


def test_a_missing_attribute_is_refused():
    with pytest.raises(UnsupportedRelease, match=r"Base\.gone has no such attribute"):
        Patch(Base, "gone", ("self",), doubling, RELEASE).apply()


@pytest.mark.parametrize("version", ["1.3.9", "1.5.0", "2.0"])
def test_another_release_line_is_refused_before_the_signature(version, monkeypatch):
    monkeypatch.setattr(LIBRARY, "__version__", version)

    class Refused(UnsupportedRelease):
        pass

    release = Release("fake_library", ">=1.4,<1.5", "fake_library==1.4.2", error=Refused)
    refused = rf"written for fake_library >=1\.4,<1\.5; found fake_library {version}\. Install"
    with pytest.raises(Refused, match=refused):
        Patch(Base, "step", ("self", "changed"), doubling, release).apply()
    assert "step" in vars(Base) and Base.step(Base(), 2) == ("base", 2)


@pytest.mark.parametrize("version", ["1.4.0", "1.4.7.dev3", "1.4.1+cpu", "1.4rc1"])
def test_pre_and_local_releases_count_as_their_base_release(version):
    RELEASE.check(version)
