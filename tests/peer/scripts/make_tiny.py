"""Build a tiny random fp16 model (Llama or Qwen2) with the test tokenizer: ``make_tiny.py OUT [llama|qwen2]``.

Also writes ``calib.txt`` (the calibration texts) next to it for ``qserve quantize --calib``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import CALIB_TEXTS, build_tiny_model, print_json  # noqa: E402

if __name__ == "__main__":
    out = build_tiny_model(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "llama")
    (out / "calib.txt").write_text("\n".join(CALIB_TEXTS * 4) + "\n")
    print_json({"model": str(out)})
