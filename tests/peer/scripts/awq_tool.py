"""AutoAWQ side of the peer checks (run with the AutoAWQ venv's python).

``awq_tool.py quantize SRC DST [GROUP]``: AutoAWQ GEMM, zero_point=True, 4-bit; saves DST and
``DST/ref_logits.pt`` from AutoAWQ's own forward pass after reloading DST with ``from_quantized``.
``awq_tool.py logits CKPT OUT``: load an AWQ GEMM checkpoint (e.g. qserve's) with AutoAWQ and save
its logits for the fixed prompts; ``--dequant`` instead rebuilds each Linear with AutoAWQ's
``dequantize_gemm`` utility inside a plain transformers model.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import CALIB_TEXTS, PROMPTS, print_json, save_logits  # noqa: E402


def _cpu_fallback() -> None:
    """AutoAWQ picks its Triton kernel whenever triton imports; on a CPU that kernel cannot run,
    so force the pure-torch ``dequantize_gemm`` + matmul path."""
    import awq.models.base as base
    import awq.modules.linear.gemm as gemm

    gemm.TRITON_AVAILABLE = False
    gemm.awq_ext = None
    # from_quantized insists on intel_extension_for_pytorch whenever the best device is "cpu";
    # report another device so it keeps the plain WQLinear_GEMM modules (weights still go to the CPU).
    base.get_best_device = lambda: "cpu-no-ipex"


def _forward(model) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(torch.tensor([ids])).logits[0].float() for ids in PROMPTS]


def _load_logits(ckpt: str) -> list[torch.Tensor]:
    from awq import AutoAWQForCausalLM

    _cpu_fallback()
    model = AutoAWQForCausalLM.from_quantized(
        ckpt, fuse_layers=False, device_map={"": "cpu"}, torch_dtype=torch.float16
    )
    # AutoAWQ's WQLinear_GEMM casts activations to fp16 and needs fp16 scales: run the model in fp16.
    return _forward(model.model.eval())


def _dequant_logits(ckpt: str) -> list[torch.Tensor]:
    import json

    import transformers
    from awq.utils.packing_utils import dequantize_gemm
    from safetensors.torch import load_file

    cfg = json.loads((Path(ckpt) / "config.json").read_text())
    qcfg = cfg.pop("quantization_config")
    group = qcfg.get("group_size", qcfg.get("q_group_size"))
    state = {}
    for f in sorted(Path(ckpt).glob("*.safetensors")):
        state.update(load_file(str(f)))
    out = {}
    for name, value in state.items():
        if name.endswith(".qweight"):
            p = name[: -len(".qweight")]
            w = dequantize_gemm(value, state[f"{p}.qzeros"], state[f"{p}.scales"].float(), 4, group)  # [K, N]
            out[f"{p}.weight"] = w.t().float().contiguous()
        elif not name.endswith((".qzeros", ".scales")):
            out[name] = value.float()
    config = transformers.AutoConfig.for_model(**cfg)
    model = getattr(transformers, cfg["architectures"][0])(config).float().eval()
    model.load_state_dict(out, strict=False)
    return _forward(model)


def quantize(src: str, dst: str, group: int) -> None:
    from awq import AutoAWQForCausalLM
    from transformers import PreTrainedTokenizerFast

    _cpu_fallback()
    torch.manual_seed(0)
    model = AutoAWQForCausalLM.from_pretrained(src, torch_dtype=torch.float16, device_map="cpu")
    # transformers < 4.52 cannot read a tokenizer_config written by transformers 5; the raw
    # tokenizer.json is all calibration needs.
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(Path(src) / "tokenizer.json"), eos_token="<|endoftext|>")
    quant_config = {"zero_point": True, "q_group_size": group, "w_bit": 4, "version": "GEMM"}
    model.quantize(
        tokenizer, quant_config=quant_config, calib_data=CALIB_TEXTS * 8, max_calib_seq_len=64, max_calib_samples=64
    )
    in_memory = _forward(model.model.eval())  # AutoAWQ's WQLinear_GEMM modules, as quantized
    model.save_quantized(dst)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (Path(src) / name).is_file():
            shutil.copyfile(Path(src) / name, Path(dst) / name)
    logits = _load_logits(dst)
    import awq

    save_logits(Path(dst) / "ref_logits.pt", logits, {"tool": "autoawq", "version": awq.__version__})
    save_logits(Path(dst) / "ref_logits_in_memory.pt", in_memory, {"tool": "autoawq", "version": awq.__version__})
    print_json({"ckpt": dst, "tool": "autoawq", "version": awq.__version__})


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "quantize":
        quantize(sys.argv[2], sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else 32)
    elif cmd == "logits":
        dequant = "--dequant" in sys.argv
        ckpt, out = [a for a in sys.argv[2:] if not a.startswith("--")]
        logits = _dequant_logits(ckpt) if dequant else _load_logits(ckpt)
        save_logits(out, logits, {"tool": "autoawq", "mode": "dequantize_gemm" if dequant else "from_quantized"})
        print_json({"out": out})
    else:
        raise SystemExit(__doc__)
