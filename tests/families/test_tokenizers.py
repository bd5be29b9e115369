"""Family tokenizers loaded without remote code, checked token by token against references
built from the families' own rules (families.md): Qwen v1's tiktoken file through ``tiktoken``
itself, ChatGLM's / Baichuan's SentencePiece model through ``sentencepiece``."""

from __future__ import annotations

import json
import unicodedata

import pytest

from qserve.tokenization import load_tokenizer
from qserve.tokenization import qwen as qwen_tok
from tests.helpers.family_tokenizers import TEXT, bpe_ranks, write_tiktoken

SAMPLES = [
    "Hello world! The quick brown fox.",
    "12345 and 2026: digits split one by one",
    "你好，世界。",
    "Cafe\u0301 cre\u0300me",  # decomposed accents: NFC-normalized first
    "  leading spaces\n\nand newlines\n",
    "<|im_end|> written as text",
]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen-tok")
    write_tiktoken(root / "qwen.tiktoken", bpe_ranks(TEXT, qwen_tok.PAT_STR, 150))
    (root / "config.json").write_text(json.dumps({"architectures": ["QWenLMHeadModel"]}))
    (root / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "QWenTokenizer",
                "auto_map": {"AutoTokenizer": ["tokenization_qwen.QWenTokenizer", None]},
            }
        )
    )
    return root


def _reference(root):
    """Qwen's own tokenizer logic: tiktoken.Encoding over the ranks, specials after them, NFC."""
    import tiktoken

    ranks = qwen_tok.read_ranks(root / "qwen.tiktoken")
    specials = {tok: len(ranks) + i for i, tok in enumerate(qwen_tok.SPECIAL_TOKENS)}
    return tiktoken.Encoding("qwen-test", pat_str=qwen_tok.PAT_STR, mergeable_ranks=ranks, special_tokens=specials)


def test_qwen_ids_match_tiktoken(qwen_dir):
    tok, ref = load_tokenizer(qwen_dir), _reference(qwen_dir)
    for text in SAMPLES[:-1]:
        expected = ref.encode(unicodedata.normalize("NFC", text), allowed_special=set(), disallowed_special=())
        assert tok.encode(text, add_special_tokens=False) == expected, text
        assert tok.decode(expected) == unicodedata.normalize("NFC", text)
    assert tok.encode("12345", add_special_tokens=False) == [ref.encode_single_token(d) for d in "12345"]


def test_qwen_special_ids_and_stop_tokens(qwen_dir):
    tok, ref = load_tokenizer(qwen_dir), _reference(qwen_dir)
    num_ranks = ref.n_vocab - len(qwen_tok.SPECIAL_TOKENS)
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|extra_204|>"]) == [
        num_ranks,
        num_ranks + 1,
        num_ranks + 2,
        num_ranks + 207,
    ]
    assert tok.eos_token_id == num_ranks


def test_qwen_chatml_template_token_by_token(qwen_dir):
    """apply_chat_template + encode == Qwen's make_context: each turn built from the special ids
    and separately encoded role / content segments."""
    tok, ref = load_tokenizer(qwen_dir), _reference(qwen_dir)
    start, end = ref.encode_single_token("<|im_start|>"), ref.encode_single_token("<|im_end|>")
    nl = ref.encode("\n")

    def turn(role, content):
        return [start] + ref.encode(role) + nl + ref.encode(content) + [end] + nl

    messages = [{"role": "user", "content": "Hello world!"}, {"role": "assistant", "content": "你好，世界。"}]
    messages.append({"role": "user", "content": "The quick brown fox 123"})
    expected = turn("system", qwen_tok.DEFAULT_SYSTEM)
    for m in messages:
        expected += turn(m["role"], m["content"])
    expected += [start] + ref.encode("assistant") + nl
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tok.encode(text, add_special_tokens=False) == expected
    custom = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    text = tok.apply_chat_template(custom, add_generation_prompt=True, tokenize=False)
    assert tok.encode(text, add_special_tokens=False) == (
        turn("system", "Be brief.") + turn("user", "Hello") + [start] + ref.encode("assistant") + nl
    )


def test_qwen_changed_file_is_reread(tmp_path):
    """tiktoken caches by path; a file rewritten in place must not be served from that cache."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["QWenLMHeadModel"]}))
    write_tiktoken(tmp_path / "qwen.tiktoken", bpe_ranks(TEXT, qwen_tok.PAT_STR, 20))
    small = len(load_tokenizer(tmp_path))
    write_tiktoken(tmp_path / "qwen.tiktoken", bpe_ranks(TEXT, qwen_tok.PAT_STR, 60))
    assert len(load_tokenizer(tmp_path)) == small + 40


# ------------------------------------------------------------------ SentencePiece: ChatGLM, Baichuan
def _spm_dir(root, architecture, **options):
    import sentencepiece as spm

    from tests.helpers.family_tokenizers import train_sentencepiece

    (root / "tokenizer.model").write_bytes(train_sentencepiece(**options))
    (root / "config.json").write_text(
        json.dumps({"architectures": [architecture], "_name_or_path": "THUDM/chatglm3-6b"})
    )
    return root, spm.SentencePieceProcessor(model_file=str(root / "tokenizer.model"))


def test_chatglm3_specials_prefix_and_template(tmp_path):
    # A dummy prefix (SentencePiece's default): encode("\n") + encode(content) != encode("\n" + content)
    root, sp = _spm_dir(tmp_path, "ChatGLMModel", remove_extra_whitespaces=False)
    tok = load_tokenizer(root)
    n = sp.vocab_size()
    assert sp.encode("\n") + sp.encode("Hello world!") != sp.encode("\nHello world!")
    names = ["[MASK]", "[gMASK]", "[sMASK]", "sop", "eop", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]
    assert tok.convert_tokens_to_ids(names) == list(range(n, n + 9))
    for text in SAMPLES[:4]:
        assert tok.encode(text, add_special_tokens=False) == sp.encode(text)
        assert tok.encode(text) == [n + 1, n + 3] + sp.encode(text)  # [gMASK] sop prefix
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello world!"},
        {"role": "assistant", "content": "你好，世界。"},
        {"role": "user", "content": "12345"},
    ]
    role_id = {"system": n + 5, "user": n + 6, "assistant": n + 7}
    expected = [n + 1, n + 3]  # ChatGLM3's build_chat_input: role token, encode(meta + "\n"), encode(content)
    for m in messages:
        expected += [role_id[m["role"]]] + sp.encode("\n") + sp.encode(m["content"])
    expected.append(n + 7)
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tok.encode(text, add_special_tokens=False) == expected


def test_chatglm2_round_template(tmp_path):
    import sentencepiece as spm

    from tests.helpers.family_tokenizers import train_sentencepiece

    (tmp_path / "tokenizer.model").write_bytes(train_sentencepiece(add_dummy_prefix=False))
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["ChatGLMModel"], "_name_or_path": "chatglm2-6b"})
    )
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "tokenizer.model"))
    tok = load_tokenizer(tmp_path)
    assert len(tok) == sp.vocab_size() + 5  # no ChatGLM3 role tokens
    messages = [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi"},
        {"role": "user", "content": "Bye"},
    ]
    prompt = "[Round 1]\n\n问：Hello\n\n答：Hi\n\n[Round 2]\n\n问：Bye\n\n答："
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    n = sp.vocab_size()
    assert tok.encode(text, add_special_tokens=False) == [n + 1, n + 3] + sp.encode(prompt)


def test_baichuan_template_token_by_token(tmp_path):
    root, sp = _spm_dir(tmp_path, "BaichuanForCausalLM", user_defined_symbols=["<reserved_106>", "<reserved_107>"])
    tok = load_tokenizer(root)
    user, assistant = sp.piece_to_id("<reserved_106>"), sp.piece_to_id("<reserved_107>")
    assert tok.convert_tokens_to_ids(["<reserved_106>", "<reserved_107>"]) == [user, assistant]
    assert len(tok) == sp.vocab_size()  # the reserved tokens are the model's own pieces
    for text in SAMPLES[:4]:
        assert tok.encode(text) == sp.encode(text)  # no BOS
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello world!"},
        {"role": "assistant", "content": "你好"},
        {"role": "user", "content": "The quick brown fox"},
    ]
    expected = sp.encode(messages[0]["content"]) + [user] + sp.encode("Hello world!") + [assistant] + sp.encode("你好")
    expected += [user] + sp.encode("The quick brown fox") + [assistant]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tok.encode(text, add_special_tokens=False) == expected


def test_declared_chat_stop_ids(qwen_dir, tmp_path):
    from qserve.tokenization import stop_token_ids

    tok = load_tokenizer(qwen_dir)
    assert stop_token_ids(tok) == tuple(tok.convert_tokens_to_ids(["<|im_end|>", "<|im_start|>"]))
    root, sp = _spm_dir(tmp_path, "ChatGLMModel", add_dummy_prefix=False)
    n = sp.vocab_size()
    assert stop_token_ids(load_tokenizer(root)) == (n + 6, n + 8)  # <|user|>, <|observation|>


def test_sentencepiece_decoding_matches_sentencepiece(tmp_path):
    """Byte-fallback pieces decode to their bytes and specials stay verbatim (the base class
    would print ``<0xE4>`` and strip spaces)."""
    root, sp = _spm_dir(tmp_path, "BaichuanForCausalLM", user_defined_symbols=["<reserved_106>", "<reserved_107>"])
    tok = load_tokenizer(root)
    for text in ["Hello world!", "模型 生成 🙂 emoji", "  two  spaces"]:
        ids = sp.encode(text)
        assert tok.decode(ids) == sp.decode(ids), text
    ids = sp.encode("Hello") + [sp.piece_to_id("<reserved_107>")] + sp.encode("world")
    assert tok.decode(ids) == sp.decode(ids) == "Hello<reserved_107> world"


def test_non_sentencepiece_tokenizer_model_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["ChatGLMModel"]}))
    write_tiktoken(tmp_path / "tokenizer.model", bpe_ranks(TEXT, qwen_tok.PAT_STR, 5))  # GLM-4's remote format
    with pytest.raises(ValueError, match="tokenizer.model: not a SentencePiece model"):
        load_tokenizer(tmp_path)
