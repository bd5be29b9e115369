"""ChatGLM2/3 and Baichuan SentencePiece tokenizers (``tokenizer.model``), without remote code.

Knows (families.md (b), (c)): both encode text with the SentencePiece model as is
(transformers' ``SentencePieceBackend`` in legacy mode calls ``sp.encode`` per text segment).
ChatGLM appends its commands after the model's pieces, in a fixed order ([MASK], [gMASK],
[sMASK], sop, eop, then ChatGLM3's <|system|>, <|user|>, <|assistant|>, <|observation|>), starts
every prompt with ``[gMASK]sop``, and formats chats as ChatGLM2's "[Round n]" text or ChatGLM3's
role tokens (each role token, then ``metadata + "\\n"`` and the content, encoded separately);
ChatGLM3 stops on eos, <|user|> and <|observation|>. Baichuan2's chat marks user turns with
``<reserved_106>`` (id 195) and assistant turns with ``<reserved_107>`` (196), no BOS. Must not
know: models or the engine.
"""

from __future__ import annotations

from pathlib import Path

CHATGLM_COMMANDS = ["[MASK]", "[gMASK]", "[sMASK]", "sop", "eop"]
CHATGLM3_ROLES = ["<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]

CHATGLM3_TEMPLATE = (
    "[gMASK]sop"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message.get('metadata', '') + '\\n' + message['content'] }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
CHATGLM2_TEMPLATE = (
    "[gMASK]sop"
    "{% set ns = namespace(round=0) %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{% set ns.round = ns.round + 1 %}"
    "{{ ('\\n\\n' if ns.round > 1 else '') + '[Round ' + ns.round|string + ']\\n\\n问：' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ '\\n\\n答：' + message['content'] }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '\\n\\n答：' }}{% endif %}"
)
BAICHUAN_USER, BAICHUAN_ASSISTANT = "<reserved_106>", "<reserved_107>"
BAICHUAN_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}{{ '<reserved_106>' + message['content'] }}"
    "{% else %}{{ '<reserved_107>' + message['content'] }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<reserved_107>' }}{% endif %}"
)


def check_model_file(path: Path) -> None:
    """Refuse a ``tokenizer.model`` that SentencePiece cannot read, e.g. GLM-4's remote-code
    release, whose file of that name holds tiktoken ranks."""
    import sentencepiece as spm

    try:
        spm.SentencePieceProcessor(model_file=str(path))
    except (RuntimeError, OSError) as err:
        raise ValueError(
            f"{path}: not a SentencePiece model ({err}); for GLM-4 use its -hf release, which ships a "
            "tokenizer.json (or LLM(..., tokenizer=DIR) with one)"
        ) from None


def _classes():  # noqa: ANN202 - (SentencePiece tokenizer class, ChatGLM tokenizer class)
    from transformers import SentencePieceBackend

    class SentencePieceTokenizer(SentencePieceBackend):
        """Decodes runs of pieces with SentencePiece itself (byte-fallback pieces become their
        bytes, the dummy-prefix space is dropped only at the start), special tokens verbatim,
        as ``sp.decode`` would; the base class only joins piece strings and strips spaces."""

        def convert_tokens_to_string(self, tokens: list[str]) -> str:
            special = set(self.all_special_tokens) | set(self.added_tokens_encoder)
            parts: list[str] = []
            run: list[str] = []
            for token in tokens:
                if token in special:
                    if run:
                        parts.append(self._decode_run(run, first=not parts))
                        run = []
                    parts.append(token)
                else:
                    run.append(token)
            if run:
                parts.append(self._decode_run(run, first=not parts))
            return "".join(parts)

        def _decode_run(self, pieces: list[str], first: bool) -> str:
            if first:
                return self.sp_model.decode_pieces(pieces)
            # SentencePiece drops a leading space only at the start of a text: decode after an
            # anchor so that a run following a special token keeps its space, as sp.decode does.
            anchor = self.sp_model.encode("a", out_type=str)
            return self.sp_model.decode_pieces(anchor + pieces)[len(self.sp_model.decode_pieces(anchor)) :]

    class ChatGLMSentencePieceTokenizer(SentencePieceTokenizer):
        """Prefixes ``[gMASK]sop`` when special tokens are added (ChatGLM's ``get_prefix_tokens``),
        and encodes the text after a ChatGLM3 role token as ChatGLM3 does: ``metadata + "\\n"``
        and the content as two separate SentencePiece calls (with a dummy prefix they differ from
        one call over both)."""

        def tokenize(self, text, **kwargs):  # noqa: ANN001, ANN201
            segments = self.tokens_trie.split(text)
            if not any(seg in CHATGLM3_ROLES for seg in segments):
                return super().tokenize(text, **kwargs)
            tokens: list[str] = []
            previous = None
            for seg in segments:
                if previous in CHATGLM3_ROLES and seg not in self.all_special_tokens and "\n" in seg:
                    head, _, rest = seg.partition("\n")
                    tokens += super().tokenize(head + "\n", **kwargs)
                    if rest:
                        tokens += super().tokenize(rest, **kwargs)
                elif seg:
                    tokens += super().tokenize(seg, **kwargs)
                previous = seg
            return tokens

        def build_inputs_with_special_tokens(self, token_ids_0, token_ids_1=None):  # noqa: ANN001, ANN201
            prefix = self.convert_tokens_to_ids(["[gMASK]", "sop"])
            ids = prefix + list(token_ids_0)
            if token_ids_1 is not None:
                ids += list(token_ids_1) + [self.eos_token_id]
            return ids

    return SentencePieceTokenizer, ChatGLMSentencePieceTokenizer


def load_chatglm(root: str | Path, chatglm3: bool | None = None):  # noqa: ANN201
    """ChatGLM2 / ChatGLM3. ``chatglm3`` None: ChatGLM3 if the directory's tokenizer_config.json
    or config.json mentions it, else ChatGLM2 (no role tokens)."""
    root = Path(root)
    if chatglm3 is None:
        texts = [(root / f).read_text() for f in ("tokenizer_config.json", "config.json") if (root / f).is_file()]
        chatglm3 = any("chatglm3" in t.lower() for t in texts)
    commands = CHATGLM_COMMANDS + (CHATGLM3_ROLES if chatglm3 else [])
    tokenizer = _classes()[1](
        vocab_file=str(root / "tokenizer.model"),
        legacy=True,
        unk_token="<unk>",
        eos_token="</s>",
        pad_token="<unk>",
        chat_template=CHATGLM3_TEMPLATE if chatglm3 else CHATGLM2_TEMPLATE,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": commands})
    if chatglm3:
        tokenizer.qserve_stop_token_ids = tuple(tokenizer.convert_tokens_to_ids(["<|user|>", "<|observation|>"]))
    return tokenizer


def load_baichuan(root: str | Path):  # noqa: ANN201
    tokenizer = _classes()[0](
        vocab_file=str(Path(root) / "tokenizer.model"),
        legacy=True,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<unk>",
        chat_template=BAICHUAN_TEMPLATE,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": [BAICHUAN_USER, BAICHUAN_ASSISTANT]})
    return tokenizer
