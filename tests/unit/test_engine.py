"""LLMEngine behaviour: batching, chunking, preemption, abort, stop conditions, validation."""

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from pdserve.engine import LLMEngine, RequestStatus, SamplingParams
from pdserve.errors import (
    DuplicateRequestError,
    InvalidRequestError,
    PromptTooLongError,
    RequestNotFoundError,
)
from pdserve.kvcache.hashing import BlockHash, PromptHashes

MakeEngine = Callable[..., LLMEngine]


def prompt(n: int, offset: int = 0) -> list[int]:
    return [(5 * i + 7 * offset + 3) % 250 for i in range(n)]


def greedy(max_tokens: int, **kwargs: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kwargs)  # type: ignore[arg-type]


def run_to_completion(engine: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def solo_outputs(
    make_engine: MakeEngine, prompts: list[list[int]], n: int
) -> list[tuple[int, ...]]:
    engine = make_engine(enable_prefix_caching=False)
    return [engine.generate([p], greedy(n))[0].token_ids for p in prompts]


def test_batched_output_equals_solo_output(make_engine: MakeEngine) -> None:
    prompts = [prompt(n, offset=n) for n in (3, 17, 33, 64)]
    batched = make_engine().generate(prompts, greedy(12))
    assert [c.token_ids for c in batched] == solo_outputs(make_engine, prompts, 12)


def test_request_joining_a_running_batch_gets_the_same_output(make_engine: MakeEngine) -> None:
    engine = make_engine()
    engine.add_request(prompt(20), greedy(30), request_id="early")
    for _ in range(5):
        engine.step()
    engine.add_request(prompt(25, offset=1), greedy(10), request_id="late")
    tokens = run_to_completion(engine)
    expected = solo_outputs(make_engine, [prompt(25, offset=1)], 10)[0]
    assert tuple(tokens["late"]) == expected


def test_chunked_prefill_shares_steps_with_decode(make_engine: MakeEngine) -> None:
    engine = make_engine(max_num_batched_tokens=16)
    engine.add_request(prompt(4), greedy(40), request_id="decoding")
    engine.step()
    engine.add_request(prompt(100, offset=3), greedy(5), request_id="long")
    scheduled = engine.scheduler.schedule()
    sizes = {c.request.request_id: c.num_new_tokens for c in scheduled.chunks}
    assert sizes == {"decoding": 1, "long": 15}
    assert sum(chunk.num_new_tokens for chunk in scheduled.chunks) <= 16
    engine._update(scheduled, engine._run(scheduled))
    tokens = run_to_completion(engine)
    assert tuple(tokens["long"]) == solo_outputs(make_engine, [prompt(100, offset=3)], 5)[0]


def test_preemption_keeps_output_identical_and_counts_once(make_engine: MakeEngine) -> None:
    prompts = [prompt(30, offset=i) for i in range(4)]
    expected = solo_outputs(make_engine, prompts, 40)
    # 4 requests x (30 + 40) tokens need 20 blocks of 16; 12 blocks force preemption.
    engine = make_engine(num_kv_blocks=12, enable_prefix_caching=False)
    ids = [engine.add_request(p, greedy(40)) for p in prompts]
    preempted_per_step = []
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        before = engine.scheduler.stats.num_preemptions
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        preempted_per_step.append(engine.scheduler.stats.num_preemptions - before)
        engine.check_integrity()
    assert [tuple(tokens[i]) for i in ids] == expected
    assert engine.scheduler.stats.num_preemptions > 0
    assert sum(preempted_per_step) == engine.scheduler.stats.num_preemptions
    assert engine.kv_cache.num_free_blocks == 12
    assert len(engine.runner.block_tables) == 0  # every row went with its allocation


def test_preemption_victim_is_the_newest_request(make_engine: MakeEngine) -> None:
    engine = make_engine(num_kv_blocks=6, enable_prefix_caching=False)
    old = engine.add_request(prompt(30), greedy(60))
    new = engine.add_request(prompt(30, offset=1), greedy(60))
    victims: list[str] = []
    while engine.has_unfinished_requests() and not victims:
        scheduled = engine.scheduler.schedule()
        victims = [r.request_id for r in scheduled.preempted]
        engine._update(scheduled, engine._run(scheduled))
    assert victims == [new]
    assert engine.scheduler.requests[new].num_preemptions == 1
    assert engine.scheduler.requests[old].status == RequestStatus.RUNNING
    run_to_completion(engine)


def test_resumed_request_reuses_its_published_blocks(make_engine: MakeEngine) -> None:
    engine = make_engine(num_kv_blocks=8)
    engine.add_request(prompt(40), greedy(50), request_id="a")
    engine.add_request(prompt(40, offset=2), greedy(50), request_id="b")
    resumed_with_hit = False
    while engine.has_unfinished_requests():
        scheduled = engine.scheduler.schedule()
        for chunk in scheduled.chunks:
            request = chunk.request
            if request.num_preemptions and request.num_computed_tokens >= 16:
                resumed_with_hit = True
        engine._update(scheduled, engine._run(scheduled))
    assert engine.scheduler.stats.num_preemptions > 0
    assert resumed_with_hit


def test_abort_frees_blocks_and_reports_unknown_ids(make_engine: MakeEngine) -> None:
    engine = make_engine(num_kv_blocks=32)
    request_id = engine.add_request(prompt(50), greedy(100))
    for _ in range(3):
        engine.step()
    assert engine.kv_cache.num_free_blocks < 32
    engine.abort_request(request_id)
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache.num_free_blocks == 32
    with pytest.raises(RequestNotFoundError):
        engine.abort_request(request_id)


def test_abort_of_a_waiting_request(make_engine: MakeEngine) -> None:
    engine = make_engine()
    request_id = engine.add_request(prompt(10), greedy(5))
    engine.abort_request(request_id)
    assert engine.step() == []
    assert not engine.has_unfinished_requests()


def test_max_tokens_finishes_with_length(make_engine: MakeEngine) -> None:
    [completion] = make_engine().generate([prompt(10)], greedy(7))
    assert len(completion.token_ids) == 7
    assert completion.finish_reason == "length"


def test_steps_are_counted_with_their_time(make_engine: MakeEngine) -> None:
    engine = make_engine()
    engine.add_request(prompt(10), greedy(5))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    stats = engine.scheduler.stats
    assert stats.num_steps == steps >= 5  # a prefill step, then one per further token
    assert stats.step_seconds > 0


def test_stop_token_id_ends_generation_and_is_not_in_text(make_engine: MakeEngine) -> None:
    engine = make_engine()
    [free_run] = engine.generate([prompt(12)], greedy(20))
    stop_token = free_run.token_ids[5]
    first = free_run.token_ids.index(stop_token)
    [stopped] = engine.generate([prompt(12)], greedy(20, stop_token_ids=(stop_token,)))
    assert stopped.token_ids == free_run.token_ids[: first + 1]
    assert stopped.finish_reason == "stop"
    assert stopped.text == engine.tokenizer.decode(free_run.token_ids[:first])


def test_eos_from_config_stops_unless_ignored(
    make_engine: MakeEngine, tiny_model_dir: Path, tmp_path: Path
) -> None:
    [free_run] = make_engine().generate([prompt(12)], greedy(20))
    eos = free_run.token_ids[3]
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).symlink_to(tiny_model_dir / name)
    config = json.loads((tiny_model_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "eos_token_id": [999, eos]}))
    engine = make_engine(model=str(tmp_path))
    [stopped] = engine.generate([prompt(12)], SamplingParams(max_tokens=20))
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free_run.token_ids[: free_run.token_ids.index(eos) + 1]
    [ignored] = engine.generate([prompt(12)], greedy(20))
    assert ignored.token_ids == free_run.token_ids


def test_stop_string_truncates_and_never_streams_part_of_it(make_engine: MakeEngine) -> None:
    engine = make_engine()
    [free_run] = engine.generate([prompt(12)], greedy(40))
    stop = free_run.text[10:13]
    index = free_run.text.index(stop)
    deltas = []
    finish = None
    for out in engine.stream(prompt(12), greedy(40, stop=(stop,))):
        deltas.append(out.new_text)
        finish = (out.finish_reason, out.stop_reason)
    assert "".join(deltas) == free_run.text[:index]
    assert finish == ("stop", stop)


def test_seeded_sampling_is_reproducible_across_batches(make_engine: MakeEngine) -> None:
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=1234, ignore_eos=True)
    engine = make_engine()
    [alone] = engine.generate([prompt(9)], params)
    together = engine.generate([prompt(9), prompt(20, offset=1)], params)
    assert together[0].token_ids == alone.token_ids
    other_seed = SamplingParams(max_tokens=24, temperature=1.0, seed=99, ignore_eos=True)
    assert engine.generate([prompt(9)], other_seed)[0].token_ids != alone.token_ids


def test_top_k_one_and_tiny_top_p_are_greedy(make_engine: MakeEngine) -> None:
    engine = make_engine()
    [expected] = engine.generate([prompt(15)], greedy(16))
    for params in (
        SamplingParams(max_tokens=16, temperature=1.5, top_k=1, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=1.0, top_p=1e-6, seed=3, ignore_eos=True),
    ):
        assert engine.generate([prompt(15)], params)[0].token_ids == expected.token_ids


def test_prefix_cache_counts_hits_once_at_admission(make_engine: MakeEngine) -> None:
    engine = make_engine()
    engine.generate([prompt(40)], greedy(3))
    [second] = engine.generate([prompt(40)], greedy(3))
    stats = engine.scheduler.stats
    assert second.num_cached_tokens == 32  # 2 full blocks; the last token is always computed
    assert (stats.prefix_cache_queries, stats.device_hit_tokens) == (80, 32)


def test_second_request_does_not_hit_blocks_still_being_prefilled(make_engine: MakeEngine) -> None:
    engine = make_engine(max_num_batched_tokens=32)
    engine.add_request(prompt(96), greedy(2), request_id="first")
    engine.step()  # first chunk of 32 tokens computed and published
    engine.add_request(prompt(96), greedy(2), request_id="second")
    scheduled = engine.scheduler.schedule()
    second = engine.scheduler.requests["second"]
    assert [c.request.request_id for c in scheduled.chunks] == ["first"]
    assert engine.kv_cache.match_prefix(second).num_tokens == 32
    engine._update(scheduled, engine._run(scheduled))
    assert engine.kv_cache.match_prefix(second).num_tokens == 64


def test_prompt_longer_than_context_is_rejected(make_engine: MakeEngine) -> None:
    engine = make_engine(max_model_len=64)
    with pytest.raises(PromptTooLongError, match="64 tokens"):
        engine.add_request(prompt(64))
    assert not engine.has_unfinished_requests()


def test_prompt_larger_than_kv_pool_is_rejected(make_engine: MakeEngine) -> None:
    engine = make_engine(num_kv_blocks=4)
    with pytest.raises(PromptTooLongError):
        engine.add_request(prompt(64))


def test_generation_stops_at_context_window(make_engine: MakeEngine) -> None:
    [completion] = make_engine(max_model_len=40).generate([prompt(30)], greedy(100))
    assert len(completion.token_ids) == 10
    assert completion.finish_reason == "length"


@pytest.mark.parametrize(
    ("bad_prompt", "message"), [([], "empty"), ([1, 2, 99999], "outside the vocabulary")]
)
def test_bad_prompts_are_rejected(
    make_engine: MakeEngine, bad_prompt: list[int], message: str
) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        make_engine().add_request(bad_prompt)


def test_duplicate_request_id_is_rejected(make_engine: MakeEngine) -> None:
    engine = make_engine()
    engine.add_request(prompt(5), request_id="x")
    with pytest.raises(DuplicateRequestError):
        engine.add_request(prompt(5), request_id="x")
    run_to_completion(engine)


def test_prompt_token_ids_are_never_mutated(make_engine: MakeEngine) -> None:
    tokens = prompt(33)
    snapshot = list(tokens)
    engine = make_engine(num_kv_blocks=5)
    engine.generate([tokens, tokens], greedy(30))
    assert tokens == snapshot


def test_text_prompt_is_tokenized_with_bos(make_engine: MakeEngine) -> None:
    engine = make_engine()
    request_id = engine.add_request("héllo", greedy(2))
    request = engine.scheduler.requests[request_id]
    assert request.prompt_token_ids == (256, 104, 195, 169, 108, 108, 111)
    run_to_completion(engine)


def test_a_request_takes_the_hash_chain_it_came_with_after_a_sampled_check(
    make_engine: MakeEngine,
) -> None:
    engine = make_engine()
    tokens = prompt(64)  # 4 blocks of 16
    chain = engine.hasher.hash_tokens(tokens)
    forged = [*chain[:1], BlockHash(bytes(32)), *chain[2:]]  # caught only by the random check
    sent = PromptHashes(engine.hasher.root, engine.hasher.block_size, tuple(forged))
    built = [engine.make_request(tokens, greedy(2), block_hashes=sent) for _ in range(40)]
    assert {tuple(r.block_hashes) for r in built} == {tuple(forged), tuple(chain)}  # taken as sent
    other = PromptHashes(BlockHash(bytes(32)), engine.hasher.block_size, tuple(forged))
    assert engine.make_request(tokens, greedy(2), block_hashes=other).block_hashes == chain
