"""Batched sampling with per-row parameters, following vLLM V1's semantics (vLLM >= 0.10.1; its V0 differs).

Order of operations, as in vLLM V1's sampler: a structured-output grammar's mask (by the engine, or after the draw:
below), `allowed_token_ids`, `bad_words` (-inf for the last token of each banned word whose other tokens end the
generated ones), `logit_bias`, penalties and min_tokens masking on the logits; greedy rows take the argmax; the
others are divided by their temperature, then min-p drops the tokens less likely than min_p times the most likely one
(an argmax-invariant logits processor in V1, so it comes before top-k / top-p, unlike V0), then top-k and top-p (on
what min-p kept, renormalized), then an exponential-race draw: the token maximizing p / q with q ~ Exp(1), computed
as the argmax of logits / temperature - log q (the same winner, vLLM's distribution; each score depends on its own
token only, so no softmax is needed and no probability underflows to a tie). Seeded rows draw q from their own
generator, so they yield the same tokens alone or in any batch.

A grammar's mask may also come after the draw, for the rows where that cannot change the outcome (`checks_after`:
greedy rows and plain temperature draws, without logprobs): a token's score does not depend on the others, so the
race's winner among the allowed tokens is the overall winner whenever that one is allowed. The sampler draws from the
unmasked logits, asks a `TokenCheck` which tokens the grammar refuses, and only for those rows masks the logits and
draws again with the same q: every token is the one masking first gives, at the cost of a mask only where the model
strays (llama.cpp samples grammars this way).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from rose.engine.logprobs import token_logprobs
from rose.engine.outputs import TokenLogprob
from rose.engine.sampling_params import SamplingParams
from rose.engine.sequence import Sequence

_NEG_INF = float("-inf")
_ARGMAX_BLOCK = 128
_ARGMAX_MIN_NUMEL = 1 << 16


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax of a 2-D tensor, exactly torch.argmax(x, -1): the first index of the maximum (or of a NaN).

    On CPU, torch's argmax kernel is several times slower than its max reduction (6x on [128, 8192] float32, 5x on
    [128, 151936]), so large inputs take the max of each block of columns, the argmax over the block maxima, then
    the argmax inside the winning block.
    """
    rows, vocab = x.shape
    if x.device.type != "cpu" or x.numel() < _ARGMAX_MIN_NUMEL or vocab < 2 * _ARGMAX_BLOCK:
        return x.argmax(dim=-1)
    n = vocab // _ARGMAX_BLOCK
    blocks = x[:, : n * _ARGMAX_BLOCK].view(rows, n, _ARGMAX_BLOCK)
    block_max = blocks.amax(dim=-1)
    block = block_max.argmax(dim=-1)
    row = torch.arange(rows, device=x.device)
    index = blocks[row, block].argmax(dim=-1) + block * _ARGMAX_BLOCK
    if vocab % _ARGMAX_BLOCK:
        best = block_max[row, block]
        tail_max, tail_index = x[:, n * _ARGMAX_BLOCK :].max(dim=-1)
        # the tail wins only with a strictly larger value, or a NaN where the blocks have none
        tail_wins = (tail_max > best) | (tail_max.isnan() & ~best.isnan())
        index = torch.where(tail_wins, tail_index + n * _ARGMAX_BLOCK, index)
    return index


def checks_after(params: SamplingParams) -> bool:
    """Whether a row drawn with `params` may be checked against its grammar after the draw instead of masked before
    it (see the module's docstring): greedy, or a temperature draw without min-p / top-k / top-p (which would keep
    a different set of tokens from masked logits), and no logprobs (reported from the masked logits)."""
    if params.logprobs is not None:
        return False
    return params.greedy or (params.min_p == 0 and params.top_k == 0 and params.top_p == 1.0)


class TokenCheck(Protocol):
    """A grammar's verdict on drawn tokens, for the rows the sampler checks after the draw."""

    def refused(self, token_ids: list[int]) -> list[int]:
        """The rows (indices into `token_ids`, one per sampled row) whose token the grammar does not allow."""
        ...

    def mask(self, logits: torch.Tensor, rows: list[int]) -> None:
        """Mask in place `logits` ([len(rows), vocab], row j for row `rows[j]`) to what each grammar allows."""
        ...


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, eos_token_ids: set[int], seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(
        self, logits: torch.Tensor, seqs: list[Sequence], check: TokenCheck | None = None
    ) -> SamplerOutput:
        """logits: [len(seqs), vocab] for the rows' next tokens. `check`: the grammar of the rows that were not
        masked before the draw (rows for which `checks_after` holds), asked after it."""
        logits = logits[:, : self.vocab_size].float()
        raw = logits
        params = [s.params for s in seqs]
        # vLLM V1's order: allowed ids, bad words, logit_bias, penalties
        if any(p.allowed_token_ids for p in params):
            logits = apply_allowed_token_ids(logits.clone(), params)
        if any(s.bad_words_token_ids for s in seqs):
            logits = apply_bad_words(logits if logits is not raw else logits.clone(), seqs)
        if any(p.logit_bias for p in params):
            logits = apply_logit_bias(logits if logits is not raw else logits.clone(), params)
        if any(p.uses_penalties for p in params):
            logits = self._apply_penalties(logits if logits is not raw else logits.clone(), seqs)
        banned = self._min_tokens_bans(seqs)
        if banned:
            if logits is raw:
                logits = logits.clone()
            rows, cols = zip(*banned, strict=True)
            logits[list(rows), list(cols)] = _NEG_INF

        greedy = [p.greedy for p in params]
        q = None
        if all(greedy):
            tokens = argmax(logits)
        else:
            tokens, q = self._sample(logits, seqs, greedy)
        token_list = tokens.tolist()
        refused = check.refused(token_list) if check is not None else None
        if refused:
            redrawn = self._redraw(logits, seqs, greedy, q, refused, check)
            for i, token in zip(refused, redrawn, strict=True):
                token_list[i] = token

        logprobs: list[TokenLogprob | None] = [None] * len(seqs)
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        if wanted:
            found = token_logprobs(
                raw, [token_list[i] for i in wanted], [params[i].logprobs for i in wanted], wanted
            )
            for i, lp in zip(wanted, found, strict=True):
                logprobs[i] = lp
        return SamplerOutput(token_list, logprobs)

    def _redraw(
        self,
        logits: torch.Tensor,
        seqs: list[Sequence],
        greedy: list[bool],
        q: torch.Tensor | None,
        rows: list[int],
        check: TokenCheck,
    ) -> list[int]:
        """The tokens of `rows` drawn again from their masked logits with the same q: what masking first draws."""
        masked = logits[rows]  # a copy
        check.mask(masked, rows)
        again = [greedy[i] for i in rows]
        if all(again):
            return argmax(masked).tolist()
        redrawn, _ = self._sample(masked, [seqs[i] for i in rows], again, q[rows])
        return redrawn.tolist()

    def _sample(
        self, logits: torch.Tensor, seqs: list[Sequence], greedy: list[bool], q: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The drawn tokens and the race's q (drawn here unless given)."""
        params = [s.params for s in seqs]
        device = logits.device
        temps = torch.tensor(
            [1.0 if g else p.temperature for g, p in zip(greedy, params, strict=True)], device=device
        )
        scaled = logits / temps[:, None]
        min_p = [p.min_p for p in params]
        if any(m > 0 for m in min_p):  # before top-k / top-p, as vLLM V1
            scaled = apply_min_p(scaled, min_p)
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        # only the rows that ask for them: a row's draw does not depend on its batch (a cumulative sum rounding to
        # 1 before the last token would drop tokens from a top_p = 1 row)
        cut = [i for i, (k, p) in enumerate(zip(top_k, top_p, strict=True)) if k > 0 or p < 1.0]
        if len(cut) == len(seqs):
            scaled = apply_top_k_top_p(scaled, top_k, top_p)
        elif cut:
            scaled[cut] = apply_top_k_top_p(scaled[cut], [top_k[i] for i in cut], [top_p[i] for i in cut])
        if q is None:
            q = torch.empty_like(scaled)
            seeded = [i for i, s in enumerate(seqs) if s.generator is not None]
            if len(seeded) < len(seqs):
                q.exponential_(generator=self.generator)
            for i in seeded:
                q[i].exponential_(generator=seqs[i].generator)
        sampled = argmax(scaled - q.log())
        if any(greedy):
            is_greedy = torch.tensor(greedy, device=device)
            sampled = torch.where(is_greedy, argmax(logits), sampled)
        return sampled, q

    def _apply_penalties(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        rows = [i for i, s in enumerate(seqs) if s.params.uses_penalties]
        device = logits.device
        counts = torch.zeros((len(rows), logits.shape[1]), device=device)
        seen = torch.zeros((len(rows), logits.shape[1]), dtype=torch.bool, device=device)
        for j, i in enumerate(rows):
            out = seqs[i].output_token_ids
            if out:
                counts[j].index_add_(0, torch.tensor(out, device=device), torch.ones(len(out), device=device))
            seen[j, torch.tensor(seqs[i].prompt_token_ids, device=device)] = True
        seen |= counts > 0
        p = [seqs[i].params for i in rows]
        rep = torch.tensor([x.repetition_penalty for x in p], device=device)[:, None]
        freq = torch.tensor([x.frequency_penalty for x in p], device=device)[:, None]
        pres = torch.tensor([x.presence_penalty for x in p], device=device)[:, None]
        sub = logits[rows]
        # repetition penalty (prompt and output tokens): shrink positive logits, push negative ones further down
        penalized = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen, penalized, sub)
        sub = sub - freq * counts - pres * (counts > 0).float()
        logits[rows] = sub
        return logits

    def _min_tokens_bans(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        banned = []
        for i, s in enumerate(seqs):
            p = s.params
            # a constrained row ends when its grammar does: banning EOS where only EOS is allowed would mask the
            # whole row (the grammar's mask, applied before, already keeps EOS out until the grammar can end)
            if len(s.output_token_ids) < p.min_tokens and s.structured is None:
                stops = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids)
                banned.extend((i, t) for t in stops if t < self.vocab_size)
        return banned


def apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k and top-p nucleus; 0 / 1.0 disable them."""
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.tensor([min(v, vocab) if v > 0 else vocab for v in top_k], device=logits.device)[:, None]
    drop = ranks >= k
    p = torch.tensor(top_p, device=logits.device)[:, None]
    probs = sorted_logits.masked_fill(drop, _NEG_INF).softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
    drop |= before >= p
    drop[:, 0] = False  # always keep the most likely token
    masked = sorted_logits.masked_fill(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, masked)


def apply_min_p(logits: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Mask (to -inf) tokens whose probability (softmax of `logits`) is below min_p times the row's most likely
    token's; 0 disables it."""
    probs = logits.softmax(dim=-1)
    threshold = torch.tensor(min_p, device=logits.device, dtype=probs.dtype)[:, None]
    threshold = threshold * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, _NEG_INF)


def apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Add each row's `logit_bias` to its logits in place (one scatter for the whole batch); returns `logits`."""
    rows, cols, values = [], [], []
    for i, p in enumerate(params):
        if p.logit_bias:
            rows += [i] * len(p.logit_bias)
            cols += p.logit_bias.keys()
            values += p.logit_bias.values()
    device = logits.device
    index = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
    return logits.index_put_(index, torch.tensor(values, dtype=logits.dtype, device=device), accumulate=True)


def apply_allowed_token_ids(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Set every token outside a row's `allowed_token_ids` to -inf, in place (one mask built with one scatter, then
    one fill); returns `logits`."""
    rows = [i for i, p in enumerate(params) if p.allowed_token_ids]
    flat_rows = [i for i in rows for _ in params[i].allowed_token_ids]
    flat_cols = [t for i in rows for t in params[i].allowed_token_ids]
    device = logits.device
    banned = torch.zeros(logits.shape, dtype=torch.bool, device=device)
    banned[torch.tensor(rows, device=device)] = True
    banned[torch.tensor(flat_rows, device=device), torch.tensor(flat_cols, device=device)] = False
    return logits.masked_fill_(banned, _NEG_INF)


def apply_bad_words(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """vLLM V1's bad words, in place (one index_put for the whole batch); returns `logits`. For each of a row's
    `bad_words_token_ids`, its last token gets -inf when the row's generated tokens (not the prompt) end with the
    tokens before it; a one-token word's always does."""
    rows, cols = [], []
    for i, s in enumerate(seqs):
        if not s.bad_words_token_ids:
            continue
        out = s.output_token_ids
        for ids in s.bad_words_token_ids:
            n = len(ids) - 1
            if n == 0 or (n <= len(out) and out[-n:] == ids[:-1]):
                rows.append(i)
                cols.append(ids[-1])
    if rows:
        device = logits.device
        index = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
        logits.index_put_(index, torch.tensor(_NEG_INF, dtype=logits.dtype, device=device))
    return logits
