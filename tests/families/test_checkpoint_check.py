"""``qserve serve`` / ``qserve inspect`` run ``check_checkpoint`` first: it must pass every family's
checkpoint (its tensors checked under the decoder's names, as the loader reads them) and still
refuse a broken one."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file, save_file

from qserve.model.checkpoint_check import check_checkpoint
from tests.helpers.family_models import (
    glm_oracle,
    qwen2_oracle,
    save_baichuan,
    save_chatglm,
    save_qwen_v1,
    save_qwen_v1_gptq,
)


def _families(root):
    yield "qwen-v1", save_qwen_v1(qwen2_oracle(seed=1), root / "qwen-v1")
    yield "qwen-v1-gptq", save_qwen_v1_gptq(qwen2_oracle(seed=2), root / "qwen-v1-gptq")
    yield "baichuan-rope", save_baichuan(qwen2_oracle(seed=3), root / "baichuan-rope", "rope")
    yield "baichuan-alibi", save_baichuan(qwen2_oracle(seed=4), root / "baichuan-alibi", "alibi")
    yield "chatglm", save_chatglm(glm_oracle(seed=5), root / "chatglm", rope_ratio=1.0)


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    return dict(_families(tmp_path_factory.mktemp("families")))


@pytest.mark.parametrize("name", ["qwen-v1", "qwen-v1-gptq", "baichuan-rope", "baichuan-alibi", "chatglm"])
def test_every_family_passes_the_checks_serve_and_inspect_run(family_dirs, name):
    checked = check_checkpoint(family_dirs[name], tokenizer=False, tensors=True)
    assert checked.path == family_dirs[name]


def test_a_family_checkpoint_missing_a_tensor_is_refused_by_its_stored_name(family_dirs, tmp_path):
    import shutil

    broken = tmp_path / "qwen-v1-broken"
    shutil.copytree(family_dirs["qwen-v1"], broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["transformer.h.1.mlp.c_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match="missing"):
        check_checkpoint(broken, tokenizer=False)
