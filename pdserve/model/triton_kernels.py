"""Triton kernels for attention over pdserve's paged KV cache, launched by `triton_attention`.

Importing this module imports triton and decorates the kernels, which is why only
`triton_attention.TritonBackend` imports it, and only when a backend is made: with
``TRITON_INTERPRET=1`` in the environment at that moment the kernels run in triton's interpreter
(on CPU tensors: the unit tests), otherwise they compile for the GPU.

Layout: ``kv_layer`` is ``[num_blocks, 2, page, kv_heads, head_dim]`` with any strides (a layer's
view of the cache); token ``n`` of a sequence is in block ``table[n // PAGE]`` at slot
``n % PAGE``. Both kernels share one inner loop (`_attend`): a tile of query rows, each with its
absolute position, against ``BLOCK_N`` cached tokens at a time (looked up token by token in the
block table, so ``BLOCK_N`` need not match the page size), with an online softmax in float32
(exp2, the scale folded with log2 e) and the causal mask by position. `varlen_prefill`'s rows are a
sequence's new tokens for one head; `paged_decode`'s rows are the query heads that share one kv
head (GQA), for one new token, optionally over one split of the context (`decode_reduce` merges
the splits). K/V tiles take the queries' type as they are loaded: an FP8 cache
(``float8_e4m3fn``) is read as its values, its scales folded by the caller.

`latent_decode` is the latent-attention (MLA) decode: the cache holds one latent per token
(``[num_blocks, 1, page, 1, dim]``), shared by every query head, whose first ``VALUE_DIM``
values are also its value. A program takes ``BLOCK_H`` heads of one decode row, so each tile of
``BLOCK_N`` latents is loaded once for all of them; its scores are two dots (the value part, a
power of two wide in DeepSeek's 512 + 64, and the rest), and the value part's tile, already
loaded, is the values. It splits the context as `paged_decode` does and shares its merge and
the online-softmax step (`_online_softmax`). An FP8 cache is upcast as it is loaded and its
scale applied to the scores' scale and to the output (real value = stored * ``kv_scale``).
"""
# mypy: ignore-errors
# (triton ships neither type stubs nor a py.typed marker; this module is triton's kernel language)

import triton
import triton.language as tl

INTERPRET = bool(triton.knobs.runtime.interpret)


@triton.jit
def _scores_update(q, k, v, mask, m, denom, acc, qk_scale):
    """One online-softmax step of rows `q` [M, D] against tokens `k`, `v` [N, D] as loaded:
    they take `q`'s type (an FP8 cache's upcast exactly; in the interpreter, float32)."""
    k = k.to(q.dtype)
    v = v.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
    return _online_softmax(s, mask, v, m, denom, acc)


@triton.jit
def _online_softmax(s, mask, v, m, denom, acc):
    """Scores `s` [M, N] (scaled, in log2 units) where `mask`, and values `v` [N, D], into the
    running (row max `m`, row sum `denom`, unnormalised output `acc` [M, D])."""
    s = tl.where(mask, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing to attend yet
    alpha = tl.exp2(m - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    denom = denom * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
    return m_new, denom, acc


@triton.jit
def _attend(
    q, pos, kv_ptr, table_ptr, kv_head, n_start, n_end, qk_scale, kv_st, t_st,
    PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Rows `q` [M, D] at positions `pos` [M] over cached tokens n_start..n_end-1 of one kv head:
    (row max, row sum, unnormalised output). `kv_st`: the layer view's 5 strides, `t_st`: the
    block table row's column stride."""
    BLOCK_M: tl.constexpr = q.shape[0]
    BLOCK_D: tl.constexpr = q.shape[1]
    d = tl.arange(0, BLOCK_D)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(n_start, n_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        valid = n < n_end
        block = tl.load(table_ptr + (n // PAGE) * t_st, mask=valid, other=0).to(tl.int64)
        rows = block * kv_st[0] + (n % PAGE) * kv_st[2] + kv_head * kv_st[3]
        ptrs = kv_ptr + rows[:, None] + d[None, :] * kv_st[4]
        kv_mask = valid[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(ptrs, mask=kv_mask, other=0.0)
        v = tl.load(ptrs + kv_st[1], mask=kv_mask, other=0.0)
        mask = valid[None, :] & (n[None, :] <= pos[:, None])
        m, denom, acc = _scores_update(q, k, v, mask, m, denom, acc, qk_scale)
    return m, denom, acc


@triton.jit
def varlen_prefill(
    q_ptr, out_ptr, kv_ptr, tables_ptr, tiles_ptr, qk_scale, q_st, o_st, kv_st, t_st,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """Grid (query tile, head). A tile (`tiles` row: sequence, first batch row, rows, first
    position) is up to BLOCK_M consecutive new tokens of one sequence; it attends causally to the
    sequence's cached tokens 0..its last position (prefix hits and earlier chunks included)."""
    tile = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.load(tiles_ptr + tile * 4).to(tl.int64)
    row0 = tl.load(tiles_ptr + tile * 4 + 1).to(tl.int64)
    count = tl.load(tiles_ptr + tile * 4 + 2)
    pos0 = tl.load(tiles_ptr + tile * 4 + 3)
    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    io_mask = (r < count)[:, None] & (d < HEAD_DIM)[None, :]
    rows = row0 + r
    q = tl.load(
        q_ptr + rows[:, None] * q_st[0] + head * q_st[1] + d[None, :] * q_st[2],
        mask=io_mask,
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    table = tables_ptr + seq * t_st[0]
    _, denom, acc = _attend(
        q, pos0 + r, kv_ptr, table, head // GROUP, 0, pos0 + count, qk_scale, kv_st, t_st[1],
        PAGE, HEAD_DIM, BLOCK_N,
    )  # fmt: skip
    out = acc / denom[:, None]
    o_ptrs = out_ptr + rows[:, None] * o_st[0] + head * o_st[1] + d[None, :] * o_st[2]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit
def paged_decode(
    q_ptr, out_ptr, kv_ptr, tables_ptr, lens_ptr, seqs_ptr, rows_ptr, part_ptr, qk_scale,
    split_tokens, q_st, o_st, kv_st, t_st,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """Grid (decode row, kv head, split): the GROUP query heads of one kv head (padded to
    BLOCK_H rows) for one new token, over context tokens split*split_tokens.. of the sequence.
    With one split the result is written to `out`; else (max, sum, output) to `part_ptr`."""
    i = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(seqs_ptr + i).to(tl.int64)
    row = tl.load(rows_ptr + i).to(tl.int64)
    context = tl.load(lens_ptr + seq)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + h
    io_mask = (h < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q_ptrs = q_ptr + row * q_st[0] + heads[:, None] * q_st[1] + d[None, :] * q_st[2]
    q = tl.load(q_ptrs, mask=io_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    start = split * split_tokens
    end = tl.minimum(context, start + split_tokens)
    pos = tl.zeros([BLOCK_H], tl.int64) + context - 1
    table = tables_ptr + seq * t_st[0]
    m, denom, acc = _attend(
        q, pos, kv_ptr, table, kv_head, start, end, qk_scale, kv_st, t_st[1],
        PAGE, HEAD_DIM, BLOCK_N,
    )  # fmt: skip
    if SPLITS == 1:
        o_ptrs = out_ptr + row * o_st[0] + heads[:, None] * o_st[1] + d[None, :] * o_st[2]
        tl.store(o_ptrs, (acc / denom[:, None]).to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        _store_split(
            part_ptr, i, heads, split, m, denom, acc, h < GROUP, GROUP * tl.num_programs(1)
        )


@triton.jit
def _store_split(part_ptr, i, heads, split, m, denom, acc, h_mask, num_heads):
    """Partials of row `i`: `part` is [rows, heads, splits, BLOCK_D + 2] float32 (the
    unnormalised output, then the max, then the sum)."""
    BLOCK_D: tl.constexpr = acc.shape[1]
    width = BLOCK_D + 2
    base = ((i * num_heads + heads) * tl.num_programs(2) + split).to(tl.int64) * width
    d = tl.arange(0, BLOCK_D)
    tl.store(part_ptr + base[:, None] + d[None, :], acc, mask=h_mask[:, None])
    tl.store(part_ptr + base + BLOCK_D, m, mask=h_mask)
    tl.store(part_ptr + base + BLOCK_D + 1, denom, mask=h_mask)


@triton.jit
def latent_decode(
    q_ptr, out_ptr, kv_ptr, tables_ptr, lens_ptr, seqs_ptr, part_ptr, qk_scale, kv_scale,
    split_tokens, num_heads, q_st, o_st, kv_st, t_st,
    VALUE_DIM: tl.constexpr, ROPE_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr, SPLITS: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    """Grid (decode row, head block, split): BLOCK_H query heads of decode row `i` (of
    sequence `seqs[i]`) against its latents split*split_tokens.. . A latent is VALUE_DIM values
    (padded to BLOCK_V; also the value) then ROPE_DIM more (padded to BLOCK_R). `qk_scale`
    includes log2 e and `kv_scale`. With one split the result is written to `out` row `i`;
    else (max, sum, output) to `part_ptr`."""
    i = tl.program_id(0).to(tl.int64)
    split = tl.program_id(2)
    seq = tl.load(seqs_ptr + i).to(tl.int64)
    context = tl.load(lens_ptr + seq)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < num_heads
    dv = tl.arange(0, BLOCK_V)
    dr = VALUE_DIM + tl.arange(0, BLOCK_R)
    v_mask = dv < VALUE_DIM
    r_mask = dr < VALUE_DIM + ROPE_DIM
    q_row = q_ptr + i * q_st[0] + heads[:, None] * q_st[1]
    q_v = tl.load(q_row + dv[None, :] * q_st[2], mask=h_mask[:, None] & v_mask[None, :], other=0.0)
    q_r = tl.load(q_row + dr[None, :] * q_st[2], mask=h_mask[:, None] & r_mask[None, :], other=0.0)
    if UPCAST:  # the interpreter's tl.dot mishandles bfloat16 (stored as uint16 in numpy)
        q_v = q_v.to(tl.float32)
        q_r = q_r.to(tl.float32)
    start = split * split_tokens
    end = tl.minimum(context, start + split_tokens)
    table = tables_ptr + seq * t_st[0]
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_V], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        valid = n < end
        block = tl.load(table + (n // PAGE) * t_st[1], mask=valid, other=0).to(tl.int64)
        latent = kv_ptr + (block * kv_st[0] + (n % PAGE) * kv_st[2])[:, None]
        value_mask = valid[:, None] & v_mask[None, :]
        # an FP8 cache upcasts exactly to the queries' 16- or 32-bit type
        value = tl.load(latent + dv[None, :] * kv_st[4], mask=value_mask, other=0.0)
        value = value.to(q_v.dtype)
        s = tl.dot(q_v, tl.trans(value), input_precision="ieee")
        if ROPE_DIM > 0:
            rope_mask = valid[:, None] & r_mask[None, :]
            rope = tl.load(latent + dr[None, :] * kv_st[4], mask=rope_mask, other=0.0)
            s = tl.dot(q_r, tl.trans(rope.to(q_r.dtype)), s, input_precision="ieee")
        m, denom, acc = _online_softmax(s * qk_scale, valid[None, :], value, m, denom, acc)
    acc = acc * kv_scale
    if SPLITS == 1:
        o_ptrs = out_ptr + i * o_st[0] + heads[:, None] * o_st[1] + dv[None, :] * o_st[2]
        o_mask = h_mask[:, None] & v_mask[None, :]
        tl.store(o_ptrs, (acc / denom[:, None]).to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        _store_split(part_ptr, i, heads, split, m, denom, acc, h_mask, num_heads)


@triton.jit
def decode_reduce(
    out_ptr, rows_ptr, part_ptr, o_st,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr,
):  # fmt: skip
    """Grid (decode row, head): merges the SPLITS partials of `paged_decode` or `latent_decode`
    into `out` row `rows[i]` (`rows_ptr` None: row `i`), up to 8192 // BLOCK_D splits at a time
    (all of a latent's 512 by 64 splits would not fit in registers)."""
    TILE: tl.constexpr = min(SPLITS, 8192 // BLOCK_D)
    i = tl.program_id(0)
    head = tl.program_id(1)
    row = (i if rows_ptr is None else tl.load(rows_ptr + i)).to(tl.int64)
    width = BLOCK_D + 2
    base = ((i * tl.num_programs(1) + head) * SPLITS).to(tl.int64) * width
    top = tl.max(tl.load(part_ptr + base + tl.arange(0, SPLITS) * width + BLOCK_D), axis=0)
    d = tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_D], tl.float32)
    denom = tl.zeros([], tl.float32)
    for first in range(0, SPLITS, TILE):
        parts = part_ptr + base + (first + tl.arange(0, TILE)) * width
        weight = tl.exp2(tl.load(parts + BLOCK_D) - top)  # an empty split (max -inf) weighs 0
        acc += tl.sum(tl.load(parts[:, None] + d[None, :]) * weight[:, None], axis=0)
        denom += tl.sum(tl.load(parts + BLOCK_D + 1) * weight, axis=0)
    o_ptrs = out_ptr + row * o_st[0] + head * o_st[1] + d * o_st[2]
    tl.store(o_ptrs, (acc / denom).to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)
