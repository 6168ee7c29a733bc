"""A conversation's next turn through a real PD stack: the prefill instance pulls the previous
answer's KV from the decode instance that generated it (the router's index names it) instead of
computing it; the tokens stay those of computing everything. A pull that fails or comes back
short computes the rest."""

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from stacks import Stack
from waiting import wait_for

from pdserve.engine import LLMEngine, SamplingParams
from pdserve.transfer.base import PrefixSource

MakeStack = Callable[..., Stack]
ANSWER = SamplingParams(max_tokens=60, ignore_eos=True)
BLOCK = 16  # the tiny model's default block size


def prompt(n: int, offset: int = 0) -> list[int]:
    return [(11 * i + 5 * offset + 1) % 250 for i in range(n)]


def held_by(stack: Stack, member: int, tokens: list[int]) -> int:
    """Blocks of `tokens`' prefix the router's index places on decode instance `member`."""
    router = stack.router
    hashes = router.model.hasher.hash_tokens(tokens)
    address = stack.decode[member].address
    return router.kv_events.index.overlaps(hashes, [address]).get(address, 0)


def test_the_next_turn_pulls_the_answer_from_decode_with_the_same_greedy_tokens(
    make_stack: MakeStack, make_engine: Callable[..., LLMEngine]
) -> None:
    stack = make_stack()
    first = prompt(40)
    answer = stack.generate(first, ANSWER).tokens
    second = first + answer + prompt(9, offset=3)  # the next user message
    context_blocks = (len(first) + len(answer) - 1) // BLOCK  # the KV decode computed
    wait_for(lambda: held_by(stack, 0, second) == context_blocks)
    prefill = stack.prefill[0].instance
    computed_before = prefill.stats().num_computed_tokens

    reply = stack.generate(second, ANSWER)

    result = reply.final.prefill
    assert result is not None
    own = len(first) // BLOCK * BLOCK  # prefill's own cache: the first turn's prompt
    assert result.num_device_hit_tokens == own
    assert result.num_pulled_tokens == context_blocks * BLOCK - own
    computed = prefill.stats().num_computed_tokens - computed_before
    assert computed == len(second) - context_blocks * BLOCK
    assert prefill.stats().peer_hit_tokens == result.num_pulled_tokens
    assert stack.decode[0].instance.stats().kv_blocks_served == context_blocks - own // BLOCK
    reference = make_engine().generate([second], ANSWER)[0]
    assert reply.tokens == list(reference.token_ids)
    assert stack.router.metrics.kv_pulls._value.get() == 1
    # the pulled blocks are published on prefill: a third turn finds them there
    wait_for(lambda: stack.router.kv_events.index.num_blocks(stack.prefill[0].address) >= 6)


def test_without_pulls_the_answer_is_computed_again_with_the_same_tokens(
    make_stack: MakeStack,
) -> None:
    stack = make_stack(router={"kv_pull_min_tokens": None})
    first = prompt(40, offset=1)
    answer = stack.generate(first, ANSWER).tokens
    second = first + answer + prompt(9, offset=4)
    wait_for(lambda: held_by(stack, 0, second) > len(first) // BLOCK)
    reply = stack.generate(second, ANSWER)
    result = reply.final.prefill
    assert result is not None and result.num_pulled_tokens == 0
    assert result.num_cached_tokens == len(first) // BLOCK * BLOCK
    assert stack.decode[0].instance.stats().kv_blocks_served == 0


def test_a_pull_from_an_instance_that_lacks_the_blocks_computes_them(
    make_stack: MakeStack, make_engine: Callable[..., LLMEngine]
) -> None:
    """The source evicted the blocks (or never had them): the pull comes back short, is counted,
    and the prompt is computed; the tokens are unchanged."""
    stack = make_stack()
    runtime = stack.prefill[0].instance.runtime
    tokens = prompt(70, offset=2)
    request = runtime.make_request(tokens, ANSWER, "short-pull", prefill_only=True)
    runtime.read_ahead(request, PrefixSource(stack.decode[0].address, 4))
    assert runtime.engine.admission.staged.of(request) is None  # decode held none of them
    assert runtime.stats().kv_pull_failures == 1
    runtime.loop.call(lambda engine: engine.release("short-pull"))

    unreachable = runtime.make_request(tokens, ANSWER, "lost-pull", prefill_only=True)
    runtime.read_ahead(unreachable, PrefixSource("127.0.0.1:9", 4))  # nothing listens there
    assert runtime.stats().kv_pull_failures == 2
    runtime.loop.call(lambda engine: engine.release("lost-pull"))
    assert stack.generate(tokens, ANSWER).tokens == list(
        make_engine().generate([tokens], ANSWER)[0].token_ids
    )


def test_a_pull_stops_at_the_first_block_the_source_lacks(make_stack: MakeStack) -> None:
    """The source holds the first turn's blocks only: those arrive (and are loaded), the rest
    is computed; the short pull is counted."""
    stack = make_stack()
    first = prompt(48, offset=5)
    stack.generate(first, SamplingParams(max_tokens=1, ignore_eos=True))  # 3 blocks on decode
    wait_for(lambda: held_by(stack, 0, [*first, 1]) == 3)
    runtime = stack.prefill[0].instance.runtime
    runtime.flush_device_cache()  # prefill holds nothing of it now
    longer = first + prompt(40, offset=6)
    request = runtime.make_request(longer, ANSWER, "partial", prefill_only=True)
    runtime.read_ahead(request, PrefixSource(stack.decode[0].address, 5))  # claims 5, holds 3
    staged = runtime.engine.admission.staged.of(request)
    assert staged is not None and (staged.first_block, len(staged.blocks)) == (0, 3)
    assert staged.pulled == 3
    assert runtime.stats().kv_pull_failures == 1
    runtime.loop.call(lambda engine: engine.release("partial"))


def test_streams_on_a_drained_decode_move_with_their_context_read_back(
    make_stack: MakeStack, make_engine: Callable[..., LLMEngine]
) -> None:
    """Draining a decode instance moves its running streams to the other one: each ends there
    at a block boundary of its context, the prefill reads that context back from the drained
    instance and computes the newest token only; the tokens are an undisturbed run's."""
    stack = make_stack(decode=2)
    drained = stack.decode[0]
    stack.router.membership.set_drained(stack.decode[1].address, True)  # all start on decode 0
    params = SamplingParams(max_tokens=150, ignore_eos=True)
    prompts = [prompt(37 + 9 * n, offset=10 + n) for n in range(4)]
    prefill = stack.prefill[0].instance
    with ThreadPoolExecutor(len(prompts)) as pool:
        streams = [pool.submit(lambda p=p: stack.generate(p, params).tokens) for p in prompts]
        wait_for(lambda: drained.instance.stats().num_running == len(prompts))
        before = prefill.stats()
        stack.router.membership.set_drained(stack.decode[1].address, False)
        stack.router.membership.set_drained(drained.address, True)
        wait_for(lambda: drained.instance.stats().num_running == 0)  # moved, not finished
        tokens = [s.result() for s in streams]
    after = prefill.stats()
    expected = make_engine().generate(prompts, params)
    assert tokens == [list(e.token_ids) for e in expected]
    moved = stack.router.metrics.migrations.labels("moved")._value.get()
    assert moved == len(prompts)
    context = stack.router.metrics.moved_context_tokens._value.get()
    device = after.device_hit_tokens - before.device_hit_tokens  # the prompts, still cached
    pulled = after.peer_hit_tokens - before.peer_hit_tokens  # the answers so far
    recomputed = after.num_computed_tokens - before.num_computed_tokens
    assert device + pulled + recomputed == context and pulled > 0
    assert recomputed <= len(prompts) * 2 * BLOCK  # the newest token each, or two blocks' worth
    assert stack.decode[1].instance.stats().num_running == 0
