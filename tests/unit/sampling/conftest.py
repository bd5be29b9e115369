from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerFast

from tests.helpers.tokenizer import make_tokenizer


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    return make_tokenizer()
