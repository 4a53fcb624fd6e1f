"""constraints.txt pins what `make setup` installs: every third-party requirement of the
workspace's packages (the extras bootstrap.sh installs included) has exactly one `==` pin
that satisfies it, so a clean clone never picks an untested release."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO_ROOT = Path(__file__).resolve().parents[2]
INSTALLER = REPO_ROOT / "ops" / "scripts" / "lib.sh"  # pip_install_workspace


def _pins() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in (REPO_ROOT / "constraints.txt").read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        name, sep, version = line.partition("==")
        assert sep and version, f"constraints.txt: {line!r} is not an exact pin"
        key = canonicalize_name(name)
        assert key not in pins, f"constraints.txt pins {name} twice"
        pins[key] = version.strip()
    return pins


def _installed_extras() -> dict[str, set[str]]:
    """Extras the bootstrap installs, by package folder ("services/scheduler": {"bench"})."""
    found: dict[str, set[str]] = {}
    for path, extras in re.findall(r'\$REPO_ROOT/([\w/-]+)(?:\[([\w,]+)\])?"',
                                   INSTALLER.read_text()):
        if (REPO_ROOT / path / "pyproject.toml").exists():
            found[path] = set(extras.split(",")) if extras else set()
    return found


def test_every_installed_requirement_is_pinned_and_satisfied():
    pins = _pins()
    packages = _installed_extras()
    assert len(packages) == 6, packages  # common, four services, ops
    for path, extras in packages.items():
        project = tomllib.loads((REPO_ROOT / path / "pyproject.toml").read_text())["project"]
        requirements = list(project.get("dependencies", []))
        for extra in extras:
            requirements += project["optional-dependencies"][extra]
        for text in requirements:
            req = Requirement(text)
            if req.name.startswith("gpusched-"):
                continue
            pinned = pins.get(canonicalize_name(req.name))
            assert pinned, f"{path}: {req.name} is not pinned in constraints.txt"
            assert req.specifier.contains(pinned, prereleases=True), (
                f"{path}: constraints.txt pins {req.name}=={pinned}, outside {req.specifier}"
            )
