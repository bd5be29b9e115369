"""Write a pip constraints file that pins every dependency of pyproject.toml to its declared floor.

CI installs the project with it (``pip install -c FILE -e ".[...]"``) so that the lowest versions
the project claims to support are the ones tested, beside the newest that a plain install gets.
A requirement without a ``>=`` floor is left to pip; an exact ``==`` pin is kept as it is.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import tomllib

REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9_.\-]+)(\[[^\]]*\])?\s*(.*?)\s*(;.*)?$")


def floors(pyproject: Path) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    requirements = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        requirements.extend(extra)
    pins: dict[str, str] = {}
    for requirement in requirements:
        match = REQUIREMENT.match(requirement)
        if match is None:
            raise SystemExit(f"cannot read the requirement {requirement!r}")
        name, _extras, spec, marker = match.groups()
        key = name.lower().replace("_", "-")
        for clause in filter(None, (c.strip() for c in spec.split(","))):
            if clause.startswith(">=") or clause.startswith("=="):
                pins[key] = f"{key}=={clause[2:].strip()}{' ' + marker if marker else ''}"
    return sorted(pins.values())


if __name__ == "__main__":
    root = Path(__file__).resolve().parents[1]
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else None
    text = "\n".join(floors(root / "pyproject.toml")) + "\n"
    if out is None:
        sys.stdout.write(text)
    else:
        out.write_text(text)
