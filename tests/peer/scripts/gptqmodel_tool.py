"""GPTQModel side of the peer checks (run with the GPTQModel venv's python).

``gptqmodel_tool.py quantize SRC DST GROUP sym|asym``: GPTQ 4-bit, ``desc_act=True``, format
``gptq`` (v1); saves DST and ``DST/ref_logits.pt`` from GPTQModel's own forward pass after
reloading DST (torch kernel, CPU). ``gptqmodel_tool.py logits CKPT OUT``: load a GPTQ checkpoint
(e.g. qserve's) with GPTQModel and save its logits for the fixed prompts.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import torch  # noqa: E402
from common import CALIB_TEXTS, PROMPTS, print_json, save_logits  # noqa: E402


def _load_logits(ckpt: str, weights_out: str | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(GPTQModel's fp16 forward, fp32 forward of a transformers model holding the weights that
    GPTQModel's own ``dequantize_weight`` produces). Its torch kernel refuses float32."""
    import json

    import transformers
    from gptqmodel import BACKEND, GPTQModel
    from gptqmodel.nn_modules.qlinear import BaseQuantLinear

    model = GPTQModel.load(ckpt, device="cpu", backend=BACKEND.TORCH, dtype=torch.float16)
    with torch.no_grad():
        fp16 = [model.model(torch.tensor([ids])).logits[0].float() for ids in PROMPTS]
        state = {}
        for name, module in model.model.named_modules():
            if isinstance(module, BaseQuantLinear):
                state[f"{name}.weight"] = module.dequantize_weight().t().float().contiguous()  # [N, K]
                if getattr(module, "bias", None) is not None:
                    state[f"{name}.bias"] = module.bias.float()
        for name, value in model.model.state_dict().items():
            if not name.endswith((".qweight", ".qzeros", ".scales", ".g_idx")) and name not in state:
                state[name] = value.float()
    if weights_out:
        torch.save({k: v for k, v in state.items() if k.endswith(".weight")}, weights_out)
    cfg = json.loads((Path(ckpt) / "config.json").read_text())
    cfg.pop("quantization_config", None)
    ref = getattr(transformers, cfg["architectures"][0])(transformers.AutoConfig.for_model(**cfg)).float().eval()
    missing, unexpected = ref.load_state_dict(state, strict=False)
    if [m for m in missing if "rotary" not in m]:
        raise RuntimeError(f"missing {missing}")
    with torch.no_grad():
        fp32 = [ref(torch.tensor([ids])).logits[0].float() for ids in PROMPTS]
    return fp16, fp32


def quantize(src: str, dst: str, group: int, sym: bool) -> None:
    from gptqmodel import GPTQModel, QuantizeConfig

    torch.manual_seed(0)
    qcfg = QuantizeConfig(
        bits=4, group_size=group, desc_act=True, act_group_aware=False, sym=sym, format="gptq", damp_percent=0.05
    )
    model = GPTQModel.load(src, qcfg, device="cpu")
    model.quantize(CALIB_TEXTS * 4, batch_size=1)
    model.save(dst)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (Path(src) / name).is_file() and not (Path(dst) / name).is_file():
            shutil.copyfile(Path(src) / name, Path(dst) / name)
    import gptqmodel

    fp16, fp32 = _load_logits(dst, str(Path(dst) / "ref_weights.pt"))
    meta = {"tool": "gptqmodel", "version": gptqmodel.__version__}
    save_logits(Path(dst) / "ref_logits.pt", fp16, meta)
    save_logits(Path(dst) / "ref_logits_dequant.pt", fp32, meta)
    print_json({"ckpt": dst, "tool": "gptqmodel", "version": gptqmodel.__version__})


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "quantize":
        quantize(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5] == "sym")
    elif cmd == "logits":
        fp16, fp32 = _load_logits(sys.argv[2], sys.argv[3].replace(".pt", "_weights.pt"))
        save_logits(sys.argv[3], fp16, {"tool": "gptqmodel", "mode": "fp16 forward"})
        save_logits(sys.argv[3].replace(".pt", "_dequant.pt"), fp32, {"tool": "gptqmodel", "mode": "dequantize_weight"})
        print_json({"out": sys.argv[3]})
    else:
        raise SystemExit(__doc__)
