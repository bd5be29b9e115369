"""Quantize-then-serve recipes: the JSON data files under ``qserve/recipes/<model>/<method>-<card>.json``.

Knows: where the recipe files live (``qserve/recipes/``, package data, found from this file's path), how to find one by name and how to fill in its command templates
(``{model_path}``, ``{output_path}``, ``{calib}``). Must not know: what the commands do.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"
# The demo's calibration text (Python source): the default --calib of qserve quantize and qserve recipe.
DEMO_CALIB = RECIPES_DIR / "demo" / "calib.txt"


@dataclass(frozen=True, slots=True)
class Recipe:
    name: str
    path: Path
    data: dict[str, Any]

    def commands(self, model_path: str, output_path: str | None = None, calib: str | None = None) -> tuple[str, str]:
        """(quantize command, serve command) with the placeholders filled in (shell-quoted)."""
        values = {"model_path": model_path}
        values["output_path"] = output_path or self.data["output_path"].format(**values)
        values["calib"] = calib if calib is not None else "{calib}"
        quoted = {k: v if v == "{calib}" else shlex.quote(v) for k, v in values.items()}
        return self.data["quantize"].format(**quoted), self.data["serve"].format(**quoted)


def all_recipes(root: Path = RECIPES_DIR) -> dict[str, Recipe]:
    found: dict[str, Recipe] = {}
    for path in sorted(root.glob("*/*.json")):
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON ({err})") from None
        if isinstance(data, dict) and "quantize" in data and "serve" in data:
            found[data.get("name") or f"{path.parent.name}-{path.stem}"] = Recipe(data["name"], path, data)
    return found


def find_recipe(name: str, root: Path = RECIPES_DIR) -> Recipe:
    recipes = all_recipes(root)
    if name in recipes:
        return recipes[name]
    raise ValueError(f"no recipe named {name!r} under {root}; available: {', '.join(sorted(recipes)) or 'none'}")
