"""The outputs' text off the engine thread: `OutputProcessor` (detokenisation, stop strings) and
the engine loop's output thread, against the engine adding text itself (`inline_text`)."""

import queue
import threading
from pathlib import Path

import pytest

from pdserve.engine import LLMEngine, RequestOutput, SamplingParams
from pdserve.engine.loop import EngineLoop
from pdserve.engine.output import OutputProcessor
from pdserve.model.loader import load_model
from pdserve.model.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return load_model(tiny_model_dir).tokenizer


def token(request_id: str, token_id: int, **fields: object) -> RequestOutput:
    settings: dict[str, object] = {
        "new_text": "", "finished": False, "kv_ready": False, "finish_reason": None,
        "stop_reason": None, "num_prompt_tokens": 3, "num_output_tokens": 1,
        "num_cached_tokens": 0, **fields,
    }  # fmt: skip
    return RequestOutput(request_id=request_id, new_token_ids=(token_id,), **settings)  # type: ignore[arg-type]


def test_a_stop_string_across_tokens_ends_the_request_and_drops_what_follows(
    tokenizer: Tokenizer,
) -> None:
    processor = OutputProcessor(tokenizer)
    processor.register("a", ("cd",))
    ids = tokenizer.encode("abcdef")[-6:]  # after the BOS token
    out, stopped = processor.process([token("a", ids[0]), token("a", ids[1])])
    assert "".join(o.new_text for o in out) == "a"  # "b" is held back: it could begin "cd"
    assert stopped == []
    out, stopped = processor.process([token("a", ids[2]), token("a", ids[3])])
    assert stopped == ["a"]
    assert [o.finished for o in out] == [False, True]
    assert out[-1].finish_reason == "stop" and out[-1].stop_reason == "cd"
    assert "".join(o.new_text for o in out) == "b"
    out, _ = processor.process([token("a", ids[4])])  # the engine has not finished it yet
    assert out == []
    processor.process([], ended=["a"])
    assert len(processor) == 0


def test_a_stop_token_is_not_shown_and_other_outputs_pass_through(tokenizer: Tokenizer) -> None:
    processor = OutputProcessor(tokenizer)
    processor.register("a", ())
    x, y = tokenizer.encode("xy")[-2:]
    final = token("a", y, finished=True, finish_reason="stop", stop_reason=y)
    kv_ready = token("p", x, kv_ready=True)
    failed = token("a", x, finished=True, finish_reason="abort", error="boom")
    out, stopped = processor.process([token("a", x), kv_ready, final, failed])
    assert [o.new_text for o in out] == ["x", "", "", ""]
    assert out[1] is kv_ready and out[3] is failed and stopped == []
    assert len(processor) == 0  # a final output ends the request's text


def test_the_loop_thread_never_detokenizes_and_the_text_is_the_same(
    make_engine: "object", tiny_model_dir: Path
) -> None:
    prompt = [(5 * i + 3) % 90 + 3 for i in range(20)]
    plain = make_engine().generate([prompt], SamplingParams(max_tokens=40, ignore_eos=True))[0]  # type: ignore[operator]
    stop = plain.text[12:15]
    params = SamplingParams(max_tokens=40, ignore_eos=True, stop=(stop,))
    expected = make_engine().generate([prompt], params)[0]  # type: ignore[operator]
    assert expected.finish_reason == "stop" and len(expected.token_ids) < 40
    engine: LLMEngine = make_engine()  # type: ignore[operator]
    threads: list[str] = []
    decode = engine.loaded.tokenizer.decode

    def spied(*args: object, **kwargs: object) -> str:
        threads.append(threading.current_thread().name)
        return decode(*args, **kwargs)  # type: ignore[arg-type]

    engine.loaded.tokenizer.decode = spied  # type: ignore[method-assign]
    delivered: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
    loop = EngineLoop(engine, lambda outputs: [delivered.put(o) for o in outputs])
    loop.start()
    try:
        loop.call(lambda e: e.add_request(prompt, params, request_id="r"))
        outputs = [delivered.get(timeout=30)]
        while not outputs[-1].finished:
            outputs.append(delivered.get(timeout=30))
        assert loop.call(lambda e: e.has_unfinished_requests()) is False  # stopped by the loop
    finally:
        loop.stop()
    assert delivered.empty()  # nothing after the final output
    assert "".join(o.new_text for o in outputs) == expected.text
    assert [t for o in outputs for t in o.new_token_ids] == list(expected.token_ids)
    assert outputs[-1].stop_reason == stop
    assert threads and set(threads) == {"engine-outputs"}
    engine.check_integrity()
