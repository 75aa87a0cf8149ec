"""rose.engine.cpu_attention: the CPU decode attention kernels against SDPA, and when the engine uses them."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from engine_helpers import drain, greedy, make_engine

from rose.engine import cpu_attention


def _paged(k_rows: torch.Tensor, block_size: int, seed: int = 0) -> tuple[torch.Tensor, np.ndarray]:
    """Row-major K or V [rows, kv_heads, max_len, dim] as a paged store [blocks, block_size, kv_heads, dim] with the
    blocks shuffled, and each row's block table [rows, max_len / block_size]."""
    rows, heads, max_len, dim = k_rows.shape
    per_row = max_len // block_size
    order = list(range(rows * per_row))
    random.Random(seed).shuffle(order)
    tables = np.array(order, dtype=np.int64).reshape(rows, per_row)
    store = torch.empty(rows * per_row, block_size, heads, dim)
    blocks = k_rows.reshape(rows, heads, per_row, block_size, dim).permute(0, 2, 3, 1, 4)
    store[torch.from_numpy(tables.reshape(-1))] = blocks.reshape(rows * per_row, block_size, heads, dim)
    return store, tables


def _rows(store: torch.Tensor, tables: np.ndarray) -> torch.Tensor:
    """The inverse of `_paged`: [rows, kv_heads, max_len, dim]."""
    rows, per_row = tables.shape
    picked = store[torch.from_numpy(tables.reshape(-1))]
    return picked.reshape(rows, per_row * store.shape[1], *store.shape[2:]).transpose(1, 2)


def _attention(q, k_new, v_new, k_rows, v_rows, rows, starts, ends, scale, block_size=8, **kwargs):
    """The kernels over a paged copy of row-major stores; returns the output and the stores, back in rows."""
    k, tables = _paged(k_rows, block_size)
    v, _ = _paged(v_rows, block_size)
    out = cpu_attention.decode_attention(
        q, k_new, v_new, k, v, np.ascontiguousarray(tables[rows]), starts, ends, scale, **kwargs
    )
    return out, _rows(k, tables), _rows(v, tables)


def _reference(q, k, v, rows, starts, ends, scale):
    out = []
    for i, (row, lo, hi) in enumerate(zip(rows, starts, ends, strict=True)):
        kk, vv = k[row, :, lo:hi], v[row, :, lo:hi]  # [kv_heads, span, head_dim]
        out.append(F.scaled_dot_product_attention(q[i], kk, vv, scale=scale))  # q[i]: [kv_heads, groups, d]
    return torch.stack(out)


@pytest.mark.parametrize(("kv_heads", "groups", "head_dim"), [(4, 2, 32), (2, 1, 16), (1, 4, 64), (3, 3, 8)])
@pytest.mark.parametrize("window", [None, 5])
def test_kernels_match_sdpa_over_each_rows_own_span(kv_heads, groups, head_dim, window):
    gen = torch.Generator().manual_seed(kv_heads * 100 + head_dim)
    rows_total, max_len = 12, 40  # 5 blocks of 8 per row
    k = torch.randn(rows_total, kv_heads, max_len, head_dim, generator=gen)
    v = torch.randn(rows_total, kv_heads, max_len, head_dim, generator=gen)
    rng = random.Random(head_dim)
    rows = np.array(rng.sample(range(rows_total), 7), dtype=np.int64)  # any rows, in any order
    ends = np.array([rng.randint(1, max_len) for _ in rows], dtype=np.int64)
    ends[0] = 1  # a row with one position
    starts = np.zeros_like(ends) if window is None else np.maximum(ends - window, 0)
    q = torch.randn(len(rows), kv_heads, groups, head_dim, generator=gen)
    scale = head_dim**-0.5
    k_new = torch.randn(len(rows), kv_heads, head_dim, generator=gen)
    v_new = torch.randn(len(rows), kv_heads, head_dim, generator=gen)
    want_k, want_v = k.clone(), v.clone()
    for i, (row, end) in enumerate(zip(rows, ends, strict=True)):
        want_k[row, :, end - 1] = k_new[i]
        want_v[row, :, end - 1] = v_new[i]
    want = _reference(q, want_k, want_v, rows.tolist(), starts.tolist(), ends.tolist(), scale)
    got, k, v = _attention(q, k_new, v_new, k, v, rows, starts, ends, scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, want_k)  # the new tokens' K/V are stored, nothing else changes
    torch.testing.assert_close(v, want_v)


def test_positions_past_a_sequences_length_and_other_blocks_are_never_read():
    k = torch.randn(4, 4, 1, 8)  # 4 blocks of 4 positions
    v = torch.randn(4, 4, 1, 8)
    q = torch.randn(1, 1, 2, 8)
    tables, starts, ends = np.array([[3, 1]]), np.array([0]), np.array([6])  # positions 4, 5 in block 1
    k_new, v_new = k[1, 1].clone()[None], v[1, 1].clone()[None]
    before = cpu_attention.decode_attention(q, k_new, v_new, k, v, tables, starts, ends, 0.3)
    k[1, 2:] = float("nan")  # garbage beyond the sequence's length (and in other blocks) changes nothing
    v[1, 2:] = float("nan")
    k[0] = v[0] = k[2] = v[2] = float("nan")
    after = cpu_attention.decode_attention(q, k_new, v_new, k, v, tables, starts, ends, 0.3)
    torch.testing.assert_close(after, before)


def test_enabled_on_cpu_float32_unless_turned_off(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv("ROSE_ATTENTION_BACKEND", raising=False)
    assert cpu_attention.enabled(cpu, torch.float32)
    assert not cpu_attention.enabled(cpu, torch.bfloat16)
    assert not cpu_attention.enabled(cuda, torch.float32)
    monkeypatch.setenv("ROSE_ATTENTION_BACKEND", "sdpa")
    assert not cpu_attention.enabled(cpu, torch.float32)
    monkeypatch.setenv("ROSE_ATTENTION_BACKEND", "flash")
    with pytest.raises(ValueError, match="ROSE_ATTENTION_BACKEND must be auto, sdpa or numba"):
        cpu_attention.enabled(cpu, torch.float32)


def _mixed_outputs() -> tuple[bool, dict[str, list[int]]]:
    # a small step budget: long prompts prefill over several steps while other rows decode beside them
    engine = make_engine("tiny-qwen2", max_num_seqs=5, max_model_len=256, max_num_batched_tokens=24)
    rng = random.Random(7)
    for i in range(9):
        ids = [rng.randrange(3, 8192) for _ in range(rng.choice((4, 9, 60, 110)))]
        engine.add_request(f"r{i}", ids, greedy(rng.randint(2, 25)))
    return engine.cache.use_cpu_kernels, {rid: o.token_ids for rid, o in drain(engine).outputs.items()}


def test_engine_outputs_are_the_same_with_kernels_and_sdpa(monkeypatch):
    monkeypatch.delenv("ROSE_ATTENTION_BACKEND", raising=False)
    used, with_kernels = _mixed_outputs()
    assert used
    monkeypatch.setenv("ROSE_ATTENTION_BACKEND", "sdpa")
    used, with_sdpa = _mixed_outputs()
    assert not used
    assert with_kernels == with_sdpa


def test_without_numba_the_engine_uses_sdpa(monkeypatch):
    monkeypatch.delenv("ROSE_ATTENTION_BACKEND", raising=False)
    monkeypatch.setattr(cpu_attention, "numba", None)
    assert not cpu_attention.enabled(torch.device("cpu"), torch.float32)
    monkeypatch.setenv("ROSE_ATTENTION_BACKEND", "numba")
    with pytest.raises(RuntimeError, match="numba is not installed"):
        cpu_attention.enabled(torch.device("cpu"), torch.float32)


def test_kernels_compile_without_a_writable_cache(monkeypatch, caplog):
    """numba raises at decoration when it finds nowhere to cache: the kernels are then compiled per process."""
    from numba.core.dispatcher import Dispatcher

    def no_locator(self):
        raise RuntimeError("cannot cache function 'f': no locator available for file 'f.py'")

    monkeypatch.setattr(Dispatcher, "enable_caching", no_locator)

    from numba import prange

    def add_one(x, out):
        for i in prange(x.shape[0]):
            out[i] = x[i] + 1.0

    with caplog.at_level("WARNING", logger="rose.engine.cpu_attention"):
        kernel = cpu_attention._jit(add_one)
    out = np.zeros(3, dtype=np.float32)
    kernel(np.arange(3, dtype=np.float32), out)
    assert out.tolist() == [1.0, 2.0, 3.0]
    assert "compiling them in each process" in caplog.text


def _eager_reference(q, k, v, rows, starts, ends, scale, softcap, sinks):
    """transformers' eager math per row: soft-capped scores, the sinks' logits in the softmax, then dropped."""
    out = []
    for i, (row, lo, hi) in enumerate(zip(rows, starts, ends, strict=True)):
        scores = torch.einsum("hgd,hpd->hgp", q[i], k[row, :, lo:hi]) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if sinks is not None:
            sink = sinks.view(q.shape[1], q.shape[2], 1)
            probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
        else:
            probs = torch.softmax(scores, -1)
        out.append(torch.einsum("hgp,hpd->hgd", probs, v[row, :, lo:hi]))
    return torch.stack(out)


@pytest.mark.parametrize(("softcap", "with_sinks"), [(None, True), (2.0, False), (1.5, True)])
def test_kernels_soft_cap_sinks_and_a_value_head_dim_of_its_own(softcap, with_sinks):
    gen = torch.Generator().manual_seed(5)
    kv_heads, groups, head_dim, v_dim, rows_total, max_len = 2, 3, 12, 5, 6, 30
    # scores large enough to be capped
    k = torch.randn(rows_total, kv_heads, max_len, head_dim, generator=gen) * 2
    v = torch.randn(rows_total, kv_heads, max_len, v_dim, generator=gen)
    rows = np.array([4, 0, 2], dtype=np.int64)
    ends = np.array([7, 1, 30], dtype=np.int64)
    starts = np.array([2, 0, 24], dtype=np.int64)
    q = torch.randn(3, kv_heads, groups, head_dim, generator=gen)
    k_new = torch.randn(3, kv_heads, head_dim, generator=gen)
    v_new = torch.randn(3, kv_heads, v_dim, generator=gen)
    sinks = torch.randn(kv_heads * groups, generator=gen) if with_sinks else None
    # the new tokens written where the reference already has them (it reads the stores as given)
    for i, (row, end) in enumerate(zip(rows, ends, strict=True)):
        k_new[i], v_new[i] = k[row, :, end - 1], v[row, :, end - 1]
    got, _, _ = _attention(
        q, k_new, v_new, k, v, rows, starts, ends, 0.4, block_size=5, softcap=softcap, sinks=sinks
    )
    want = _eager_reference(q, k, v, rows.tolist(), starts.tolist(), ends.tolist(), 0.4, softcap, sinks)
    assert got.shape == (3, kv_heads, groups, v_dim)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    plain, _, _ = _attention(q, k_new, v_new, k, v, rows, starts, ends, 0.4, block_size=5)
    assert not torch.allclose(plain, got, atol=1e-3)  # the cap / the sinks changed the result


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("store_heads", "KV-head groups"),
        ("head_dim", "head dim"),
        ("block", "out of the store's bounds"),
        ("length", "out of the store's bounds"),
        ("count", "queries but"),
    ],
)
def test_kernels_refuse_shapes_that_do_not_fit_the_store(case, message):
    """The kernels index without bounds checks: a mismatch must raise, never read another row's memory."""
    k = torch.zeros(8, 4, 2, 8)  # 8 blocks of 4 positions, 2 KV heads
    v = torch.zeros(8, 4, 2, 8)
    q = torch.zeros(2, 2, 2, 8)
    tables, starts, ends = np.array([[0, 1, 2], [3, 4, 5]]), np.array([0, 0]), np.array([4, 9])
    if case == "store_heads":
        q = torch.zeros(2, 4, 1, 8)  # 4 KV-head groups over a store of 2 KV heads
    elif case == "head_dim":
        q = torch.zeros(2, 2, 2, 16)
    elif case == "block":
        tables = np.array([[0, 1, 2], [3, 8, 5]])
    elif case == "length":
        ends = np.array([4, 13])  # past its table's 12 positions
    elif case == "count":
        tables, starts, ends = tables[:1], starts[:1], ends[:1]
    k_new = torch.zeros(q.shape[0], q.shape[1], q.shape[3])
    with pytest.raises(ValueError, match=message):
        cpu_attention.decode_attention(q, k_new, k_new, k, v, tables, starts, ends, 1.0)


_FIRST_COMPILE_PROBE = """
import logging
import numpy as np, torch
from rose.engine import cpu_attention as ca
logging.basicConfig(level=logging.INFO, format="LOG %(name)s %(message)s")
print("cached before:", ca.kernels_cached(), flush=True)
n, h, g, d, length = 2, 1, 2, 8, 16
for _ in range(2):
    ca.decode_attention(
        torch.randn(n, h, g, d), torch.randn(n, h, d), torch.randn(n, h, d),
        torch.zeros(n, length, h, d), torch.zeros(n, length, h, d),
        np.arange(n, dtype=np.int64)[:, None], np.zeros(n, dtype=np.int64), np.full(n, 3, dtype=np.int64), 0.1,
    )
print("cached after:", ca.kernels_cached(), flush=True)
"""


def test_a_cold_numba_cache_is_reported_once_then_the_kernels_are_cached(tmp_path) -> None:
    """The kernels are cached on disk (cache=True): a process with a cold NUMBA_CACHE_DIR logs one line saying it
    compiles them; the next process finds them cached and logs nothing."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}

    def run() -> str:
        res = subprocess.run(
            [sys.executable, "-c", _FIRST_COMPILE_PROBE], capture_output=True, text=True, env=env, timeout=300
        )
        assert res.returncode == 0, res.stderr
        return res.stdout + res.stderr

    cold = run()
    assert "cached before: False" in cold and "cached after: True" in cold, cold
    assert cold.count("compiling the CPU decode-attention kernels") == 1, cold
    warm = run()
    assert "cached before: True" in warm and "compiling" not in warm, warm


def _fake_flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    softmax_scale,
    causal,
    window_size,
    block_table,
    softcap=0.0,
):
    """flash-attn's documented semantics in plain torch: paged K/V through `block_table`, each sequence's queries the
    last of its keys (causal mask aligned bottom right), a query at key position i sees [i - window_size[0], i]."""
    assert causal and block_table.dtype == cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
    out = []
    for b in range(len(cu_seqlens_q) - 1):
        q_b = q[cu_seqlens_q[b] : cu_seqlens_q[b + 1]]  # [Lq, heads, d]
        lq, lk = q_b.shape[0], int(cu_seqlens_k[b + 1] - cu_seqlens_k[b])
        assert lq <= max_seqlen_q and lk <= max_seqlen_k
        blocks = block_table[b, : -(-lk // k.shape[1])].long()
        groups = q.shape[1] // k.shape[2]
        k_b = k[blocks].flatten(0, 1)[:lk].repeat_interleave(groups, dim=1).transpose(0, 1)  # [heads, Lk, d]
        v_b = v[blocks].flatten(0, 1)[:lk].repeat_interleave(groups, dim=1).transpose(0, 1)
        scores = q_b.transpose(0, 1) @ k_b.transpose(1, 2) * softmax_scale  # [heads, Lq, Lk]
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        pos = torch.arange(lq)[:, None] + lk - lq
        keys = torch.arange(lk)[None, :]
        visible = (keys <= pos) & ((keys >= pos - window_size[0]) if window_size[0] >= 0 else True)
        scores = scores.masked_fill(~visible, float("-inf"))
        out.append((scores.softmax(-1) @ v_b).transpose(0, 1))  # [Lq, heads, d]
    return torch.cat(out)


@pytest.mark.parametrize(("window", "softcap"), [(None, None), (5, None), (None, 3.0)])
def test_the_flash_attn_path_computes_a_mixed_step_as_the_torch_path(window, softcap, monkeypatch):
    """flash-attn's paged varlen kernel cannot run here (no GPU): a torch stand-in with its documented semantics
    checks that rose hands it the store, every sequence's block table, query and context lengths and the window
    as the torch path reads them, for decode tokens and prefill chunks (from position 0, and a later one) in one
    step."""
    from rose.engine import attention, flash_attention
    from rose.engine.kv_budget import default_block_size
    from rose.engine.kv_cache import AttentionMetadata, KVCache, PrefillSegment
    from rose.engine.layer_spec import LayerSpec

    monkeypatch.setenv("ROSE_ATTENTION_BACKEND", "sdpa")  # the reference: SDPA, decode over gathered blocks
    spec = LayerSpec(6, 2, 8, 8, window=window, softcap=softcap)
    cache = KVCache([spec], 16, 4, torch.float32, torch.device("cpu"))
    monkeypatch.delenv("ROSE_ATTENTION_BACKEND")
    gen = torch.Generator().manual_seed(1)
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=gen))
    cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=gen))
    decode_tables = np.array([[3, 7, 1], [0, 5, 0], [11, 2, 9]], dtype=np.int64)
    decode_lengths = [10, 6, 12]
    # prefill: positions 0..4 of a new sequence, then positions 6..8 of one whose first 6 are stored
    segments = [PrefillSegment([4, 6], 0, 5, 3), PrefillSegment([8, 10, 12], 6, 3, 8)]
    slots = [int(decode_tables[i, (n - 1) // 4]) * 4 + (n - 1) % 4 for i, n in enumerate(decode_lengths)]
    for seg in segments:
        slots += [seg.blocks[p // 4] * 4 + p % 4 for p in range(seg.start, seg.start + seg.length)]
    tokens = len(slots)
    query = torch.randn(1, 6, tokens, 8, generator=gen)
    key, value = torch.randn(1, 2, tokens, 8, generator=gen), torch.randn(1, 2, tokens, 8, generator=gen)

    def step() -> torch.Tensor:
        meta = AttentionMetadata(
            torch.tensor(slots),
            3,
            4,
            decode_tables=decode_tables,
            decode_lengths=decode_lengths,
            prefills=segments,
        )
        return attention.attend_layer(cache, 0, meta, query, key, value, 0.3, None)

    want = step()
    cache.flash = _fake_flash_attn_varlen_func
    got = step()  # the same K/V written again, then one varlen call
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    def old_flash_attn(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal, window_size, block_table):
        return _fake_flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal, window_size, block_table
        )

    # flash-attn < 2.6 has no softcap= argument: soft-capped layers keep the torch path, the others use it
    assert flash_attention.supports(spec, _fake_flash_attn_varlen_func)
    assert flash_attention.supports(spec, old_flash_attn) == (softcap is None)
    cache.flash = old_flash_attn
    torch.testing.assert_close(step(), want, rtol=1e-5, atol=1e-5)
    assert not flash_attention.enabled(torch.device("cpu"), torch.bfloat16, 256)  # CUDA only
    monkeypatch.setattr(flash_attention, "kernel", lambda: _fake_flash_attn_varlen_func)
    assert flash_attention.enabled(torch.device("cuda"), torch.bfloat16, 256)
    assert not flash_attention.enabled(torch.device("cuda"), torch.bfloat16, 16)  # flash-attn 2's page rule
    plain, sinks = LayerSpec(6, 2, 8, 8), LayerSpec(6, 2, 8, 8, sinks=True)
    cuda = torch.device("cuda")
    assert flash_attention.serves_any([sinks, plain], "sdpa", cuda, torch.float16)
    assert not flash_attention.serves_any([sinks], "sdpa", cuda, torch.float16)  # no layer would take it
    assert not flash_attention.serves_any([plain], "eager", cuda, torch.float16)  # every layer runs eager
    assert not flash_attention.serves_any([plain], "sdpa", cuda, torch.float32)
    assert default_block_size(cuda, flash=True) == 256
    assert default_block_size(cuda, flash=False) == 16
    assert default_block_size(torch.device("cpu"), flash=False) == 64
    monkeypatch.setenv("ROSE_ATTENTION_BACKEND", "sdpa")
    assert not flash_attention.enabled(torch.device("cuda"), torch.bfloat16, 256)
