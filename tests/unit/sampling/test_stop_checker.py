from __future__ import annotations

from transformers import PreTrainedTokenizerFast

from qserve.engine.detokenizer import IncrementalDetokenizer
from qserve.engine.stop_checker import StopResult, check_stop, find_stop_string, stop_buffer_len
from qserve.sampling_params import SamplingParams

EOS = 0


def _run(
    deltas: list[str],
    params: SamplingParams,
    token_ids: list[int] | None = None,
    num_prompt_tokens: int = 3,
    max_model_len: int | None = None,
) -> tuple[StopResult | None, int]:
    """Feed text deltas one token at a time; return the first stop and after how many tokens."""
    token_ids = token_ids or [100 + i for i in range(len(deltas))]
    text = ""
    for n, (tok, delta) in enumerate(zip(token_ids, deltas), start=1):
        text += delta
        res = check_stop(
            params=params,
            new_token_id=tok,
            num_output_tokens=n,
            num_prompt_tokens=num_prompt_tokens,
            output_text=text,
            new_char_count=len(delta),
            eos_token_ids={EOS},
            max_model_len=max_model_len,
        )
        if res is not None:
            return res, n
    return None, len(deltas)


def test_stop_string_split_across_tokens_is_truncated() -> None:
    res, n = _run(["Hel", "lo E", "N", "D more", "x"], SamplingParams(stop=["END"]))
    assert n == 4 and res == StopResult("stop", "END", "Hello ")


def test_include_stop_str_in_output() -> None:
    res, _ = _run(["Hel", "lo E", "N", "D more"], SamplingParams(stop="END", include_stop_str_in_output=True))
    assert res == StopResult("stop", "END", "Hello END")


def test_earliest_stop_string_wins() -> None:
    res, _ = _run(["a", "bXcY"], SamplingParams(stop=["Y", "X"]))
    assert res == StopResult("stop", "X", "ab")


def test_stop_string_never_matches_prompt(tokenizer: PreTrainedTokenizerFast) -> None:
    prompt = tokenizer.encode("say the magic word: EN")
    params = SamplingParams(stop=["END"], max_tokens=100)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    for n, tok in enumerate(tokenizer.encode("D is not here"), start=1):
        delta = detok.add_token(tok)
        res = check_stop(
            params=params,
            new_token_id=tok,
            num_output_tokens=n,
            num_prompt_tokens=len(prompt),
            output_text=detok.output_text,
            new_char_count=len(delta),
            eos_token_ids={tokenizer.eos_token_id},
        )
        assert res is None


def test_real_tokens_stop_string_and_streaming(tokenizer: PreTrainedTokenizerFast) -> None:
    params = SamplingParams(stop=["中文", "world!"], max_tokens=100)
    ids = tokenizer.encode("Hello 中文 and more")
    assert len(ids) > 4
    detok = IncrementalDetokenizer(tokenizer, [], stop_buffer_len=stop_buffer_len(params))
    streamed = ""
    res = None
    for n, tok in enumerate(ids, start=1):
        delta = detok.add_token(tok)
        res = check_stop(
            params=params,
            new_token_id=tok,
            num_output_tokens=n,
            num_prompt_tokens=0,
            output_text=detok.output_text,
            new_char_count=len(delta),
            eos_token_ids={tokenizer.eos_token_id},
        )
        if res is not None:
            detok.truncate(len(res.output_text))
        streamed += detok.get_next_output_text(finished=res is not None)
        if res is not None:
            break
    assert res == StopResult("stop", "中文", "Hello ")
    assert streamed == "Hello "  # no piece of the stop string was ever streamed


def test_stop_token_ids() -> None:
    res, n = _run(["a", "b", "<x>"], SamplingParams(stop_token_ids=[7]), token_ids=[5, 6, 7])
    assert n == 3 and res == StopResult("stop", 7, "ab")
    res, _ = _run(["a", "b", "<x>"], SamplingParams(stop_token_ids=[7], include_stop_str_in_output=True), [5, 6, 7])
    assert res == StopResult("stop", 7, "ab<x>")


def test_eos() -> None:
    res, n = _run(["a", "b", ""], SamplingParams(), token_ids=[5, 6, EOS])
    assert n == 3 and res == StopResult("stop", None, "ab")
    res, n = _run(["a", "b", "<eos>"], SamplingParams(), token_ids=[5, 6, EOS])
    assert res == StopResult("stop", None, "ab")  # eos text never shown
    res, n = _run(["a", "b", "", "c"], SamplingParams(ignore_eos=True, max_tokens=4), token_ids=[5, 6, EOS, 8])
    assert n == 4 and res == StopResult("length", None, "abc")


def test_min_tokens_defers_all_stops() -> None:
    params = SamplingParams(min_tokens=3, stop=["b"], stop_token_ids=[9])
    res, n = _run(["a", "", "b", "", "c"], params, token_ids=[EOS, 9, 5, EOS, 6])
    assert n == 4 and res == StopResult("stop", None, "ab")
    # A stop string in the first min_tokens tokens' text does not count; later ones do.
    res, n = _run(["b", "x", "y", "zb"], SamplingParams(min_tokens=3, stop=["b"]))
    assert n == 4 and res == StopResult("stop", "b", "bxyz")


def test_length_caps() -> None:
    res, n = _run(["a"] * 10, SamplingParams(max_tokens=4))
    assert n == 4 and res == StopResult("length", None, "aaaa")
    res, n = _run(["a"] * 10, SamplingParams(max_tokens=None), num_prompt_tokens=5, max_model_len=8)
    assert n == 3 and res == StopResult("length", None, "aaa")
    # max_model_len applies even before min_tokens is reached.
    res, n = _run(["a"] * 10, SamplingParams(max_tokens=None, min_tokens=9), num_prompt_tokens=5, max_model_len=8)
    assert n == 3 and res is not None and res.finish_reason == "length"
    # A stop on the last allowed token is a "stop", not "length".
    res, _ = _run(["a", "b"], SamplingParams(max_tokens=2, stop="b"))
    assert res == StopResult("stop", "b", "a")


def test_find_stop_string_window() -> None:
    # The stop string lies entirely before the window: not searched again.
    assert find_stop_string("xxSTOPxxyy", 2, ["STOP"], False) is None
    assert find_stop_string("xxSTOPyy", 4, ["STOP"], False) == ("STOP", 2)
    assert find_stop_string("xxSTOP", 1, ["STOP"], True) == ("STOP", 6)
    assert stop_buffer_len(SamplingParams(stop=["ab", "abcd"])) == 3
    assert stop_buffer_len(SamplingParams(stop=["abcd"], include_stop_str_in_output=True)) == 0
