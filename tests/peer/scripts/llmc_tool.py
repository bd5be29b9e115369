"""llm-compressor side of the peer checks (run with the llm-compressor venv's python).

``llmc_tool.py quantize SRC DST SCHEME``: ``oneshot`` + ``GPTQModifier`` and save compressed-tensors
``pack-quantized``. SCHEME is a preset (``W4A16``, ``W4A16_ASYM``: group 128) or ``g32-sym`` /
``g32-asym`` (group 32, ``actorder="weight"``: compressed-tensors 0.19 removed ``"group"``, so no
``weight_g_idx`` is written any more). Saves ``DST/ref_logits_reload.pt``: DST reloaded by
transformers + compressed-tensors (decompressed), fp32 forward.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import CALIB_TEXTS, PROMPTS, print_json, save_logits  # noqa: E402


def _forward(model) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(torch.tensor([ids])).logits[0].float() for ids in PROMPTS]


def _modifier(scheme: str):
    from llmcompressor.modifiers.quantization import GPTQModifier

    if scheme.upper().startswith("W4A16"):
        return GPTQModifier(targets="Linear", scheme=scheme.upper(), ignore=["lm_head"], dampening_frac=0.05)
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    group, sym = scheme.split("-")
    weights = QuantizationArgs(
        num_bits=4, type="int", symmetric=sym == "sym", strategy="group", group_size=int(group[1:]), actorder="weight"
    )
    return GPTQModifier(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
        ignore=["lm_head"],
        dampening_frac=0.05,
    )


def quantize(src: str, dst: str, scheme: str) -> None:
    import compressed_tensors
    import llmcompressor
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(src)
    ids = [tokenizer(text)["input_ids"] for text in CALIB_TEXTS * 4]
    dataset = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids]})
    oneshot(model=model, dataset=dataset, recipe=_modifier(scheme), max_seq_length=64, num_calibration_samples=len(ids))
    model.save_pretrained(dst, save_compressed=True)
    tokenizer.save_pretrained(dst)
    meta = {"tool": "llmcompressor", "version": llmcompressor.__version__, "ct": compressed_tensors.__version__}
    reloaded = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()
    save_logits(Path(dst) / "ref_logits_reload.pt", _forward(reloaded), meta)
    print_json({"ckpt": dst, **meta})


if __name__ == "__main__":
    if sys.argv[1] != "quantize":
        raise SystemExit(__doc__)
    quantize(sys.argv[2], sys.argv[3], sys.argv[4])
