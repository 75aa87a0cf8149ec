"""Decode attention on CPU: numba kernels that read each sequence's K/V through its block table, up to its length.

torch's CPU attention kernels reach 12-20 GB/s on decode's shape (a couple of query rows per KV head and sequence,
one small matrix product per sequence and head). These kernels compute each sequence's scores over exactly its
positions, read straight from the blocks of the paged store (rose.engine.kv_cache: no gather, no copy), let torch
take the softmax (its exp is vectorized), then accumulate the values: faster than SDPA per layer on this project's
machine, with no padding to read and no mask to build. float32 only (numba has no
bfloat16); other dtypes and devices use SDPA. `ROSE_ATTENTION_BACKEND=sdpa` turns the kernels off.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import torch

logger = logging.getLogger(__name__)

try:
    import numba
    from numba import njit, prange
except ImportError:  # pragma: no cover - numba is a dependency; this keeps SDPA working without it
    numba = None

# reassociation (vectorized dot products) but no "no-inf" assumption: the scores beyond a row's length are -inf
_FASTMATH = {"reassoc", "contract", "nsz", "arcp"}
_ROWS_PER_CHUNK = 4


def enabled(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether decode attention on this device and dtype uses the kernels."""
    backend = os.environ.get("ROSE_ATTENTION_BACKEND", "auto").lower()
    if backend not in ("auto", "sdpa", "numba"):
        raise ValueError(f"ROSE_ATTENTION_BACKEND must be auto, sdpa or numba, got {backend!r}")
    if backend == "sdpa" or device.type != "cpu" or dtype != torch.float32:
        return False
    if numba is None:
        if backend == "numba":
            raise RuntimeError("ROSE_ATTENTION_BACKEND=numba, but numba is not installed")
        return False
    return True


def _jit(fn):
    """Compile in parallel, without the GIL; cache the machine code on disk where numba finds a writable place
    (next to this module, else its user cache; NUMBA_CACHE_DIR), otherwise compile once per process."""
    try:
        return njit(parallel=True, fastmath=_FASTMATH, nogil=True, cache=True)(fn)
    except RuntimeError as exc:  # "cannot cache function ...: no locator available"
        logger.warning("numba cannot cache the decode kernels (%s); compiling them in each process", exc)
        return njit(parallel=True, fastmath=_FASTMATH, nogil=True)(fn)


if numba is not None:
    # One task per sequence, its positions walked in order: a position's heads are contiguous in the store, so each
    # block is one sequential stream however many KV heads there are.

    @_jit
    def _scores(q, k, k_new, tables, starts, lengths, scale, softcap, scores):  # pragma: no cover - compiled
        """Store k_new[i] at position lengths[i] - 1 of block table tables[i], then scores[i, h, g, p] = scale *
        q[i, h, g] . K[p, h] for the table's positions p in [starts[i], lengths[i]) (soft-capped when softcap > 0);
        -inf elsewhere."""
        n, kv_heads, groups, head_dim = q.shape
        block = k.shape[1]
        width = scores.shape[3]
        for i in prange(n):
            lo, hi = starts[i], lengths[i]
            last_block, last_offset = tables[i, (hi - 1) // block], (hi - 1) % block
            for h in range(kv_heads):
                for d in range(head_dim):  # written here, not by a separate scatter: it is about to be read
                    k[last_block, last_offset, h, d] = k_new[i, h, d]
                for g in range(groups):
                    for p in range(lo):
                        scores[i, h, g, p] = -np.inf
                    for p in range(hi, width):
                        scores[i, h, g, p] = -np.inf
            for j in range(lo // block, (hi - 1) // block + 1):  # block by block: no division per position
                b, base = tables[i, j], j * block
                for o in range(max(lo - base, 0), min(hi - base, block)):
                    for h in range(kv_heads):
                        for g in range(groups):
                            acc = np.float32(0.0)
                            for d in range(head_dim):
                                acc += q[i, h, g, d] * k[b, o, h, d]
                            if softcap > 0:
                                scores[i, h, g, base + o] = np.tanh(acc * scale / softcap) * softcap
                            else:
                                scores[i, h, g, base + o] = acc * scale

    @_jit
    def _weighted_values(probs, v, v_new, tables, starts, lengths, out):  # pragma: no cover - compiled
        """Store v_new[i] at position lengths[i] - 1 of block table tables[i], then out[i, h, g] = sum over p in
        [starts[i], lengths[i]) of probs[i, h, g, p] * V[p, h]."""
        n, kv_heads, groups, head_dim = out.shape  # head_dim: V's
        block = v.shape[1]
        for i in prange(n):
            lo, hi = starts[i], lengths[i]
            last_block, last_offset = tables[i, (hi - 1) // block], (hi - 1) % block
            for h in range(kv_heads):
                for d in range(head_dim):
                    v[last_block, last_offset, h, d] = v_new[i, h, d]
                for g in range(groups):
                    for d in range(head_dim):
                        out[i, h, g, d] = 0.0
            for j in range(lo // block, (hi - 1) // block + 1):
                b, base = tables[i, j], j * block
                for o in range(max(lo - base, 0), min(hi - base, block)):
                    for h in range(kv_heads):
                        for g in range(groups):
                            w = probs[i, h, g, base + o]
                            for d in range(head_dim):
                                out[i, h, g, d] += w * v[b, o, h, d]


def kernels_cached() -> bool | None:
    """Whether numba's on-disk cache already holds both decode kernels compiled for this machine's CPU (then the
    first decode step is fast; otherwise it compiles them first: tens of seconds, once per machine and rose
    version). None when that cannot be told (numba missing, caching off, a numba whose cache layout differs)."""
    if numba is None:
        return None
    try:
        for kernel in (_scores, _weighted_values):
            cache = (
                kernel._cache
            )  # numba's FunctionCache; its index maps (signature, target CPU) -> object file
            if not getattr(cache, "_enabled", False):
                return None
            magic = kernel.targetctx.codegen().magic_tuple()
            # _load_index() is {} when the index is missing or older than this source file
            if not any(key[1] == magic for key in cache._cache_file._load_index()):
                return False
        return True
    except Exception:  # private numba API: never let a layout change break attention
        logger.debug("cannot inspect numba's cache", exc_info=True)
        return None


_first_call_checked = False


def _note_first_compile() -> None:
    """Once per process: say that a slow first step is numba compiling, not the model."""
    global _first_call_checked
    _first_call_checked = True
    if kernels_cached() is False:
        # INFO, not WARNING: nothing is wrong (rose demo says it in its own view)
        logger.info(
            "compiling the CPU decode-attention kernels (numba; first run only, then cached in %s): "
            "the first decode step takes a while",
            getattr(_scores._cache, "cache_path", "numba's cache"),
        )


def decode_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tables: np.ndarray,
    starts: np.ndarray,
    lengths: np.ndarray,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    spans_checked: bool = False,
) -> torch.Tensor:
    """One decode step's attention, the new tokens' K/V written into the store on the way.

    q: [n, kv_heads, groups, head_dim]; k_new: [n, kv_heads, head_dim], v_new: [n, kv_heads, v_head_dim], token i's
    K/V, stored at position lengths[i] - 1 of its sequence; k, v: the layer's store [num_blocks, block_size,
    kv_heads, head_dim / v_head_dim]; tables: int64 [n, max_blocks], token i's block table (position p in block
    tables[i, p // block_size]). Token i attends over positions [starts[i], lengths[i]); scores are soft-capped when
    `softcap` is given; `sinks` ([kv_heads * groups]) join each softmax. Returns [n, kv_heads, groups, v_head_dim].
    `spans_checked`: the caller already ran `check_spans` on these arrays against this store's blocks (once per
    step for all layers); the shapes are checked at every call."""
    _check_shapes(q, k_new, v_new, k, v)
    if not _first_call_checked:
        _note_first_compile()
    if not spans_checked:
        check_spans(tables, starts, lengths, n=q.shape[0], num_blocks=k.shape[0], block_size=k.shape[1])
    threads = min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)
    if numba.get_num_threads() != threads:
        numba.set_num_threads(threads)
    # rows differ in length, and a thread may lose its core for a while (the worker's publisher): hand rows out in
    # small chunks instead of one static share per thread
    numba.set_parallel_chunksize(_ROWS_PER_CHUNK)
    q = q.contiguous()
    n, kv_heads, groups, _ = q.shape
    width = int(lengths.max()) if n else 0
    scores = torch.empty((n, kv_heads, groups, width), dtype=torch.float32)
    k_new = k_new.to(torch.float32).contiguous()
    v_new = v_new.to(torch.float32).contiguous()
    cap = np.float32(softcap or 0.0)
    _scores(
        q.numpy(), k.numpy(), k_new.numpy(), tables, starts, lengths, np.float32(scale), cap, scores.numpy()
    )
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        sink = sinks.to(torch.float32).view(1, kv_heads, groups, 1).expand(n, -1, -1, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1].contiguous()
    out = torch.empty((n, kv_heads, groups, v.shape[3]), dtype=torch.float32)
    _weighted_values(probs.numpy(), v.numpy(), v_new.numpy(), tables, starts, lengths, out.numpy())
    return out


def check_spans(
    tables: np.ndarray, starts: np.ndarray, lengths: np.ndarray, n: int, num_blocks: int, block_size: int
) -> None:
    """The kernels index without bounds checks: each of the n tokens' block table and span must lie inside the
    store (every table entry a block of the pool, every span within its table)."""
    if not (len(tables) == len(starts) == len(lengths) == n):
        raise ValueError(
            f"CPU decode attention: {n} queries but {len(tables)} block tables / {len(starts)} starts / "
            f"{len(lengths)} lengths"
        )
    if tables.ndim != 2 or tables.dtype != np.int64 or not tables.flags.c_contiguous:
        raise ValueError("CPU decode attention: block tables must be a C-contiguous int64 [n, blocks] array")
    if n and (
        tables.min() < 0
        or tables.max() >= num_blocks
        or lengths.min() < 1
        or lengths.max() > tables.shape[1] * block_size
        or (starts < 0).any()
        or (starts >= lengths).any()
    ):
        raise ValueError("CPU decode attention: a block, start or length is out of the store's bounds")


def _check_shapes(q, k_new, v_new, k, v) -> None:
    """Every shape the kernels read must agree with the store's (they index without bounds checks)."""
    n, kv_heads, _, head_dim = q.shape
    num_blocks, block_size, store_heads, store_dim = k.shape
    v_dim = v.shape[3]
    problems = []
    if store_heads != kv_heads or v.shape[2] != kv_heads:
        problems.append(
            f"the query has {kv_heads} KV-head groups, the store {store_heads} / {v.shape[2]} KV heads"
        )
    if store_dim != head_dim:
        problems.append(f"query head dim {head_dim} != stored key head dim {store_dim}")
    if tuple(k_new.shape) != (n, kv_heads, head_dim) or tuple(v_new.shape) != (n, kv_heads, v_dim):
        problems.append(f"new K/V {tuple(k_new.shape)} / {tuple(v_new.shape)} do not fit the store")
    if v.shape[0] != num_blocks or v.shape[1] != block_size:
        problems.append(
            f"K store {tuple(k.shape)} and V store {tuple(v.shape)} differ in blocks or block size"
        )
    if k.dtype != torch.float32 or v.dtype != torch.float32 or q.dtype != torch.float32:
        problems.append("the kernels read float32 only")
    if problems:
        raise ValueError("CPU decode attention: " + "; ".join(problems))
