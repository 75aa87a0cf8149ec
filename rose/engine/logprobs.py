"""Log-probabilities of given tokens with each row's top-k, from raw logits (vLLM V1's default `raw_logprobs`):
the sampler's `logprobs` (the drawn tokens) and the engine's `prompt_logprobs` (each prompt token given the ones
before it) are both this computation.

Only the values reported are computed with log-softmax's formula, (x - max) - log(sum(exp(x - max))): the row's max
and log-sum come first, then the chosen token's and the top k's logits are shifted by them (the top k of the logits
are the top k of the log-softmax, in the same order). On CPU this goes a few rows at a time: 64 rows x 151k columns
at once is a 39 MB temporary, above glibc's 32 MiB mmap threshold, so every step faulted in fresh pages and read it
back from memory; a chunk is reused from malloc and stays in cache for the gather and the top-k (`top_k`). A row
picked out of the logits is copied a chunk at a time too, never when every row is wanted. 64 rows x 151,665 columns
on 2 cores, k=5: 75 ms (one log_softmax) -> 19 ms (chunked) -> ~7 ms (no log-softmax written; benchmarks/logprobs.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rose.engine.outputs import TokenLogprob

if TYPE_CHECKING:
    from rose.engine.sequence import Sequence

_NEG_INF = float("-inf")
# log-softmax elements held at once: 8 MiB of float32 on CPU (stays in cache), 256 MiB elsewhere (a prompt's 2,048
# positions x 151k logits at once would take several GB of temporaries beside the KV pool)
_CHUNK = 1 << 21
_CHUNK_GPU = 1 << 26


def token_logprobs(
    logits: torch.Tensor,
    tokens: list[int],
    num_top: list[int],
    rows: list[int] | None = None,
    *,
    ranks: bool = False,
) -> list[TokenLogprob]:
    """For each row j of `logits` (any float dtype, taken in float32 a chunk of rows at a time; or row `rows[j]`,
    `rows` sorted and distinct): the log-softmax at `tokens[j]` and
    its `num_top[j]` most likely tokens (-inf ones left out: a token a grammar masked could never be drawn). `ranks`:
    also each token's rank, vLLM's (1 + how many tokens are at least as likely, the token itself not counted)."""
    vocab = logits.shape[-1]
    count = len(tokens)
    k = min(max(num_top, default=0), vocab)
    chosen = torch.tensor(tokens, device=logits.device)[:, None]
    every = rows is None or len(rows) == logits.shape[0]  # sorted and distinct: every row, in order
    if logits.device.type == "cpu":
        step = max(torch.get_num_threads(), _CHUNK // vocab)
    else:
        step = max(1, _CHUNK_GPU // vocab)
    parts_lp, parts_rank, parts_vals, parts_ids = [], [], [], []
    for a in range(0, count, step):
        b = min(a + step, count)
        rows_ab = (logits[a:b] if every else logits[rows[a:b]]).float()
        # log_softmax's own formula, (x - max) - log(sum(exp(x - max))), for the values read only: the whole
        # log-softmax is never written (a pass over the rows saved), the top k taken from the logits (same order)
        top = rows_ab.amax(dim=1, keepdim=True)
        log_sum = (rows_ab - top).exp_().sum(dim=1, keepdim=True).log_()
        x = rows_ab.gather(1, chosen[a:b])
        lp = (x - top) - log_sum
        parts_lp.append(lp[:, 0])
        if ranks:  # vLLM's, counted over the log-softmax (logits that differ may round to one logprob)
            parts_rank.append((((rows_ab - top) - log_sum) >= lp).sum(dim=1))
        if k:
            vals, ids = top_k(rows_ab, k)
            parts_vals.append((vals - top) - log_sum)
            parts_ids.append(ids)
    if not count:
        return []
    chosen_lp = torch.cat(parts_lp).tolist()
    rank_list = torch.cat(parts_rank).tolist() if ranks else [None] * count
    top_vals, top_ids = (torch.cat(parts_vals).tolist(), torch.cat(parts_ids).tolist()) if k else ([], [])
    out = []
    for j in range(count):
        n = min(num_top[j], k)
        top = (
            {t: v for t, v in zip(top_ids[j][:n], top_vals[j][:n], strict=True) if v != _NEG_INF} if n else {}
        )
        out.append(TokenLogprob(token_id=tokens[j], logprob=chosen_lp[j], top=top, rank=rank_list[j]))
    return out


def prompt_logprobs(seq: Sequence, first: int, logits: torch.Tensor, vocab_size: int) -> list[TokenLogprob]:
    """The entries of `seq`'s prompt tokens from `first` on, one per row of `logits` (the positions before them:
    rose.engine.model_runner.PromptLogits), its `prompt_logprobs` top-N each, with vLLM's ranks."""
    n = logits.shape[0]
    tokens = seq.prompt_token_ids[first : first + n]
    return token_logprobs(logits[:, :vocab_size], tokens, [seq.params.prompt_logprobs] * n, ranks=True)


def top_k(logp: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(logp, k, dim=-1) (k >= 1), cheaper on wide CPU rows (151k columns: 12-25 -> ~5 ms at 64 rows).

    The k+1 largest values of a row lie in the k+1 blocks of 128 columns with the largest maxima (the maxima of
    those blocks are k+1 values at least as large as anything in a block left out), so the top-k+1 of those
    blocks and the tail has torch.topk's values. Without a tie among them the order is unique, hence
    torch.topk's; a row whose k+1 best hold a tie (other than -inf, never reported) or a NaN, where only
    torch.topk's own order is the answer, is given torch.topk over the whole row."""
    rows, vocab = logp.shape
    block = 128
    n = vocab // block
    if logp.device.type != "cpu" or n < 4 * (k + 1):
        return logp.topk(k, dim=-1)
    body = n * block
    best = logp[:, :body].view(rows, n, block).amax(dim=-1).topk(k + 1, dim=-1).indices
    cols = (best[:, :, None] * block + torch.arange(block)).flatten(1)
    if body < vocab:
        cols = torch.cat([cols, torch.arange(body, vocab).expand(rows, -1)], dim=1)
    vals, pos = logp.gather(1, cols).topk(k + 1, dim=-1)
    ids = cols.gather(1, pos)
    tied = (vals[:, :-1] == vals[:, 1:]) & (vals[:, :-1] != _NEG_INF)
    tied = tied.any(dim=1) | vals.isnan().any(dim=1)
    vals, ids = vals[:, :k], ids[:, :k]
    if tied.any():
        again = tied.nonzero()[:, 0]
        vals[again], ids[again] = logp[again].topk(k, dim=-1)
    return vals, ids
