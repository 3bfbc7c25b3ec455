"""The detokenizer's request table: routing per frontend, stop strings, logprob strings."""

from __future__ import annotations

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from kvflow.proto.engine import AbortRequests, AddRequest, EngineOutputs, TokenDelta
from kvflow.proto.step import TokenLogprobs
from kvflow.sampling_params import SamplingParams
from kvflow.services.detokenizer.streams import DetokenizerStreams


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """One token per character (plus '▁' for spaces), SentencePiece-style decoding."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for piece in ["▁", *"abcdefghijklmnopqrstuvwxyz.!"]:
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never", split=False)
    tok.decoder = decoders.Metaspace(prepend_scheme="never", split=False)
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")


def ids(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def add(req_id: str, frontend: str, **params: object) -> AddRequest:
    return AddRequest(req_id, [1, 3], SamplingParams(**params), 0.0, frontend_id=frontend)  # type: ignore[arg-type]


def test_deltas_are_batched_per_frontend(tokenizer: PreTrainedTokenizerFast) -> None:
    streams = DetokenizerStreams(tokenizer)
    streams.add(add("a", "fe1"))
    streams.add(add("b", "fe2"))
    streams.add(add("c", "fe1"))
    routed = streams.process(
        EngineOutputs(
            [
                TokenDelta("a", ids(tokenizer, "hi"), num_prompt_tokens=2, queued_time=1.5),
                TokenDelta("b", ids(tokenizer, "yo")),
                TokenDelta("c", ids(tokenizer, "x"), finish_reason="length"),
                TokenDelta("zz", [5]),  # unknown: finished before, dropped
            ],
            timestamp=0.0,
        )
    )
    assert sorted(routed.by_frontend) == ["fe1", "fe2"]
    fe1 = routed.by_frontend["fe1"]
    assert [(d.req_id, d.text, d.finish_reason) for d in fe1] == [
        ("a", "hi", None),
        ("c", "x", "length"),
    ]
    assert (fe1[0].num_prompt_tokens, fe1[0].num_output_tokens, fe1[0].queued_time) == (2, 2, 1.5)
    assert routed.by_frontend["fe2"][0].text == "yo"
    assert routed.aborts == []
    assert sorted(streams.streams) == ["a", "b"]  # "c" finished


def test_stop_string_ends_the_stream_and_aborts_it(tokenizer: PreTrainedTokenizerFast) -> None:
    streams = DetokenizerStreams(tokenizer)
    streams.add(add("a", "fe", stop=["cd"]))
    first = streams.process(EngineOutputs([TokenDelta("a", ids(tokenizer, "abc"))], 0.0))
    assert first.by_frontend["fe"][0].text == "ab"  # "c" may start "cd": held back
    second = streams.process(EngineOutputs([TokenDelta("a", ids(tokenizer, "de"))], 0.0))
    (delta,) = second.by_frontend["fe"]
    assert (delta.text, delta.finish_reason, delta.stop_reason) == ("", "stop", "cd")
    assert second.aborts == [AbortRequests(["a"], "stop", "cd")]
    late = streams.process(EngineOutputs([TokenDelta("a", ids(tokenizer, "f"))], 0.0))
    assert late.by_frontend == {}


def test_finish_releases_held_back_text(tokenizer: PreTrainedTokenizerFast) -> None:
    streams = DetokenizerStreams(tokenizer)
    streams.add(add("a", "fe", stop=["cd"]))
    streams.process(EngineOutputs([TokenDelta("a", ids(tokenizer, "abc"))], 0.0))
    routed = streams.process(
        EngineOutputs([TokenDelta("a", ids(tokenizer, "x"), finish_reason="length")], 0.0)
    )
    (delta,) = routed.by_frontend["fe"]
    assert (delta.text, delta.finish_reason, delta.num_output_tokens) == ("cx", "length", 4)
    assert routed.aborts == []


def test_logprob_token_strings_align(tokenizer: PreTrainedTokenizerFast) -> None:
    streams = DetokenizerStreams(tokenizer)
    streams.add(add("a", "fe", logprobs=1, prompt_logprobs=0))
    a, b, space = ids(tokenizer, "a")[0], ids(tokenizer, "b")[0], ids(tokenizer, " ")[0]
    routed = streams.process(
        EngineOutputs(
            [
                TokenDelta(
                    "a",
                    [a],
                    logprobs=[TokenLogprobs([a, b], [-0.1, -2.0], 1)],
                    prompt_logprobs=[TokenLogprobs([space], [-1.0], 3)],
                )
            ],
            0.0,
        )
    )
    (delta,) = routed.by_frontend["fe"]
    assert delta.logprob_tokens == [["a", "b"]]
    assert delta.prompt_logprob_tokens == [[" "]]
    assert delta.logprobs[0].logprobs == [-0.1, -2.0]


def test_engine_error_passes_through(tokenizer: PreTrainedTokenizerFast) -> None:
    streams = DetokenizerStreams(tokenizer)
    streams.add(add("a", "fe"))
    routed = streams.process(
        EngineOutputs([TokenDelta("a", [], finish_reason="error", error="too long")], 0.0)
    )
    (delta,) = routed.by_frontend["fe"]
    assert (delta.finish_reason, delta.error, delta.text) == ("error", "too long", "")
    assert streams.streams == {}


def test_fail_all_and_drop_frontend(tokenizer: PreTrainedTokenizerFast) -> None:
    streams = DetokenizerStreams(tokenizer)
    for req_id, frontend in (("a", "fe1"), ("b", "fe2"), ("c", "fe1")):
        streams.add(add(req_id, frontend))
    assert streams.drop_frontend("fe1") == ["a", "c"]
    assert list(streams.streams) == ["b"]
    assert streams.fail_all() == {"fe2"}
    assert streams.streams == {}


def test_a_resumed_request_sends_its_text_so_far_once(tokenizer: PreTrainedTokenizerFast) -> None:
    """AddRequest.output_token_ids (a request moved or resumed): their text, as streamed
    (a possible stop-string start held back), comes with the first delta only."""
    streams = DetokenizerStreams(tokenizer)
    resumed = add("a", "fe", stop=["cd"])
    resumed.output_token_ids = ids(tokenizer, "abc")
    streams.add(resumed)
    first = streams.process(EngineOutputs([TokenDelta("a", ids(tokenizer, "x"))], 0.0))
    (delta,) = first.by_frontend["fe"]
    assert (delta.resumed_text, delta.text) == ("ab", "cx")  # "c" was held back, as before
    second = streams.process(EngineOutputs([TokenDelta("a", ids(tokenizer, "y"))], 0.0))
    assert second.by_frontend["fe"][0].resumed_text == ""
    streams.add(add("b", "fe"))  # a new request has none
    plain = streams.process(EngineOutputs([TokenDelta("b", ids(tokenizer, "z"))], 0.0))
    assert plain.by_frontend["fe"][0].resumed_text == ""
