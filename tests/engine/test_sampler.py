"""The sampler against simple, independent references on small logits."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from engine_helpers import fake_seq
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from rose.engine.sampler import Sampler, apply_bad_words, apply_min_p, apply_top_k_top_p, checks_after
from rose.engine.sampling_params import SamplingParams

NEG_INF = float("-inf")


# ----------------------------------------------------------------------------------------------- references


def _softmax(values: list[float]) -> list[float]:
    m = max(values)
    exps = [math.exp(v - m) for v in values]
    total = sum(exps)
    return [e / total for e in exps]


def ref_top_k_top_p_keep(row: list[float], k: int, p: float) -> tuple[set[int], list[float]]:
    """Tokens kept by top-k then top-p (on the top-k renormalized probabilities), and the cumulative masses."""
    order = sorted(range(len(row)), key=lambda i: -row[i])
    if k > 0:
        order = order[:k]
    probs = _softmax([row[i] for i in order])
    kept, cumulative, masses = set(), 0.0, []
    for i, prob in zip(order, probs, strict=True):
        kept.add(i)
        cumulative += prob
        masses.append(cumulative)
        if cumulative >= p:
            break
    return kept, masses


def ref_penalties(
    row: list[float], prompt: list[int], output: list[int], rep: float, pres: float, freq: float
) -> list[float]:
    """vLLM semantics: repetition over prompt + output tokens; presence / frequency over output tokens only."""
    out = list(row)
    for t in set(prompt) | set(output):
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    for t, count in Counter(output).items():
        out[t] -= freq * count + pres
    return out


# ----------------------------------------------------------------------------------------------- top-k / top-p

_distinct_rows = st.lists(st.integers(-400, 400), min_size=2, max_size=12, unique=True).map(
    lambda xs: [x / 50 for x in xs]
)


@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.filter_too_much],
)
@given(
    rows=st.lists(st.tuples(_distinct_rows, st.integers(0, 14), st.floats(0.05, 1.0)), min_size=1, max_size=4)
)
def test_top_k_top_p_mask_matches_reference(rows):
    width = max(len(r) for r, _, _ in rows)
    padded, top_k, top_p, expected = [], [], [], []
    for row, k, p in rows:
        # pad short rows with very unlikely, still distinct, values
        full = row + [-30.0 - j for j in range(width - len(row))]
        kept, masses = ref_top_k_top_p_keep(full, k, p)
        assume(all(abs(m - p) > 1e-4 for m in masses))  # keep clear of float ties at the nucleus boundary
        padded.append(full)
        top_k.append(k)
        top_p.append(p)
        expected.append(kept)
    logits = torch.tensor(padded, dtype=torch.float32)
    out = apply_top_k_top_p(logits.clone(), top_k, top_p)
    for i, kept in enumerate(expected):
        got = {j for j in range(width) if out[i, j] != NEG_INF}
        assert got == kept, f"row {i}: top_k={top_k[i]} top_p={top_p[i]} logits={padded[i]}"
        for j in kept:
            assert out[i, j].item() == logits[i, j].item()  # kept logits are untouched


def test_top_k_top_p_examples():
    logits = torch.tensor(
        [[1.0, 3.0, 2.0, 0.0], [1.0, 3.0, 2.0, 0.0], [1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 0.0]]
    )
    out = apply_top_k_top_p(logits, [2, 0, 1, 0], [1.0, 0.9, 1.0, 0.01])
    finite = (out != NEG_INF).tolist()
    assert finite[0] == [False, True, True, False]  # top-2
    # softmax([3, 2, 1, 0]) = .644 .237 .087 .032: the 0.9 nucleus needs the three largest
    assert finite[1] == [True, True, True, False]
    assert finite[2] == [False, True, False, False]
    assert finite[3] == [False, False, True, False]  # the most likely token is always kept


def test_top_k_larger_than_vocab_keeps_everything():
    logits = torch.tensor([[0.5, -1.0, 2.0]])
    assert torch.equal(apply_top_k_top_p(logits, [10], [1.0]), logits)


# ----------------------------------------------------------------------------------------------- min-p


@settings(max_examples=100, deadline=None, derandomize=True, database=None)
@given(rows=st.lists(st.tuples(_distinct_rows, st.floats(0.0, 1.0)), min_size=1, max_size=4))
def test_min_p_matches_reference(rows):
    width = max(len(r) for r, _ in rows)
    logits, min_p, expected = [], [], []
    for row, m in rows:
        full = [float(x) for x in row] + [-30.0 - j for j in range(width - len(row))]
        pr = _softmax(full)
        threshold = m * max(pr)
        assume(all(abs(x - threshold) > 1e-6 for x in pr))
        logits.append(full)
        min_p.append(m)
        expected.append([x if p >= threshold else NEG_INF for x, p in zip(full, pr, strict=True)])
    out = apply_min_p(torch.tensor(logits, dtype=torch.float64), min_p)
    torch.testing.assert_close(out, torch.tensor(expected, dtype=torch.float64))


# ----------------------------------------------------------------------------------------------- penalties

PENALTY_CASES = [
    pytest.param(dict(repetition_penalty=1.7), id="repetition"),
    pytest.param(dict(repetition_penalty=0.6), id="repetition<1"),
    pytest.param(dict(presence_penalty=1.3), id="presence"),
    pytest.param(dict(presence_penalty=-0.7), id="presence<0"),
    pytest.param(dict(frequency_penalty=0.9), id="frequency"),
    pytest.param(dict(frequency_penalty=-0.4), id="frequency<0"),
    pytest.param(dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25), id="all"),
]


@pytest.mark.parametrize("kwargs", PENALTY_CASES)
def test_penalties_match_reference(kwargs):
    gen = torch.Generator().manual_seed(5)
    vocab = 12
    logits = torch.randn((3, vocab), generator=gen) * 2
    prompts = [[1, 4, 4, 7], [0, 2], [3]]
    outputs = [[4, 5, 5, 5, 9], [], [11, 11]]
    penalized = SamplingParams(temperature=0.0, **kwargs)
    plain = SamplingParams(temperature=0.0)
    seqs = [
        fake_seq(penalized, prompts[0], outputs[0]),
        fake_seq(plain, prompts[1], outputs[1]),  # a row without penalties must stay as it is
        fake_seq(penalized, prompts[2], outputs[2]),
    ]
    sampler = Sampler(vocab, torch.device("cpu"), eos_token_ids=set())
    got = sampler._apply_penalties(logits.clone(), seqs)
    rep = kwargs.get("repetition_penalty", 1.0)
    pres = kwargs.get("presence_penalty", 0.0)
    freq = kwargs.get("frequency_penalty", 0.0)
    expected = [
        ref_penalties(logits[0].tolist(), prompts[0], outputs[0], rep, pres, freq),
        logits[1].tolist(),
        ref_penalties(logits[2].tolist(), prompts[2], outputs[2], rep, pres, freq),
    ]
    torch.testing.assert_close(got, torch.tensor(expected))


@pytest.mark.parametrize(
    ("kwargs", "prompt", "output", "expected_token"),
    [
        # token 0 is the argmax (3.0); token 1 is next (2.5)
        (dict(repetition_penalty=1.5), [0], [], 1),  # 3.0 / 1.5 = 2.0 < 2.5
        (dict(repetition_penalty=1.1), [0], [], 0),  # 2.73 > 2.5
        (dict(repetition_penalty=1.5), [2], [0], 1),  # output tokens count for repetition too
        (dict(presence_penalty=0.6), [], [0], 1),  # 3.0 - 0.6 = 2.4
        (dict(presence_penalty=0.6), [0], [], 0),  # presence ignores prompt tokens
        (dict(frequency_penalty=0.2), [], [0, 0, 0], 1),  # 3.0 - 0.6
        (dict(frequency_penalty=0.2), [], [0, 0], 0),  # 3.0 - 0.4
        (dict(repetition_penalty=2.0), [3], [], 0),  # a negative logit goes further down, not up
    ],
)
def test_penalties_through_greedy_sampling(kwargs, prompt, output, expected_token):
    logits = torch.tensor([[3.0, 2.5, 0.0, -4.0, 1.0]])
    sampler = Sampler(5, torch.device("cpu"), eos_token_ids=set())
    seq = fake_seq(SamplingParams(temperature=0.0, **kwargs), prompt or [4], output)
    assert sampler(logits, [seq]).token_ids == [expected_token]


def test_negative_logit_repetition_penalty_direction():
    logits = torch.tensor([[-4.0, -3.0, -10.0]])
    sampler = Sampler(3, torch.device("cpu"), eos_token_ids=set())
    # token 1 (-3.0) becomes -6.0 with penalty 2: token 0 (-4.0) wins
    assert sampler(
        logits, [fake_seq(SamplingParams(temperature=0.0, repetition_penalty=2.0), [1])]
    ).token_ids == [0]


# ----------------------------------------------------------------------------------------------- min_tokens


def test_min_tokens_bans_eos_and_stop_tokens_until_reached():
    logits = torch.tensor([[5.0, 1.0, 4.0, 0.0]])
    sampler = Sampler(4, torch.device("cpu"), eos_token_ids={0})
    params = SamplingParams(temperature=0.0, min_tokens=3, max_tokens=8, stop_token_ids=[2])
    assert sampler(logits, [fake_seq(params, output=[1, 1])]).token_ids == [1]
    assert sampler(logits, [fake_seq(params, output=[1, 1, 1])]).token_ids == [0]
    ignore = SamplingParams(temperature=0.0, min_tokens=3, max_tokens=8, stop_token_ids=[2], ignore_eos=True)
    assert sampler(logits, [fake_seq(ignore, output=[])]).token_ids == [0]  # EOS is not a stop: not banned
    no_stops = SamplingParams(temperature=0.0, min_tokens=3, max_tokens=8)
    assert sampler(logits[:, [2, 1, 0, 3]], [fake_seq(no_stops, output=[])]).token_ids == [2]


# ----------------------------------------------------------------------------------------------- distribution

LOGITS = [1.0, 0.5, 0.0, -0.5, -1.2, 2.0]
N_DRAWS = 20_000


def _chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs, strict=True) if p > 0)


def _draw(params: SamplingParams, seed: int = 0) -> list[int]:
    sampler = Sampler(len(LOGITS), torch.device("cpu"), eos_token_ids=set(), seed=seed)
    logits = torch.tensor([LOGITS]).expand(N_DRAWS, -1)
    seq = fake_seq(params)
    tokens = sampler(logits, [seq] * N_DRAWS).token_ids
    return [tokens.count(t) for t in range(len(LOGITS))]


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.6])
def test_sampling_follows_softmax_of_logits_over_temperature(temperature):
    counts = _draw(SamplingParams(temperature=temperature))
    expected = _softmax([x / temperature for x in LOGITS])
    # 5 degrees of freedom: P(chi2 > 25) is about 1e-4
    assert _chi_square(counts, expected) < 25, (counts, expected)
    wrong_t = 1.0 if temperature != 1.0 else 0.5
    assert _chi_square(counts, _softmax([x / wrong_t for x in LOGITS])) > 100


def test_sampling_with_top_k_and_min_p_follows_the_truncated_distribution():
    counts = _draw(SamplingParams(temperature=1.0, top_k=3))
    kept = [_softmax(LOGITS)[i] if i in (5, 0, 1) else 0.0 for i in range(len(LOGITS))]
    total = sum(kept)
    assert counts[2] == counts[3] == counts[4] == 0
    assert _chi_square(counts, [k / total for k in kept]) < 20
    counts = _draw(SamplingParams(temperature=1.0, min_p=0.3))
    probs = _softmax(LOGITS)
    kept = [p if p >= 0.3 * max(probs) else 0.0 for p in probs]
    assert [c > 0 for c in counts] == [k > 0 for k in kept]
    assert _chi_square(counts, [k / sum(kept) for k in kept]) < 20


def ref_min_p_then_top_p(probs: list[float], min_p: float, top_p: float) -> list[float]:
    """vLLM V1: min-p on the temperature-scaled distribution, then top-p on what it kept (renormalized)."""
    kept = [p if p >= min_p * max(probs) else 0.0 for p in probs]
    total = sum(kept)
    kept = [p / total for p in kept]
    out, before = [0.0] * len(kept), 0.0
    for i in sorted(range(len(kept)), key=lambda i: -kept[i]):
        if kept[i] == 0.0 or before >= top_p:
            break
        out[i], before = kept[i], before + kept[i]
    total = sum(out)
    return [p / total for p in out]


def test_min_p_applies_before_top_p_as_in_vllm_v1():
    # one likely token, ten middling ones, a long tail: min-p drops the tail first, so top-p=0.6 then keeps three
    # tokens; top-p first (vLLM V0, and rose before) would keep eleven
    probs = [0.30] + [0.035 - 0.001 * i for i in range(10)] + [1e-4] * 3950
    logits = torch.tensor(probs, dtype=torch.float64).log().float()
    v1 = ref_min_p_then_top_p(probs, min_p=0.05, top_p=0.6)
    v0_support = set(ref_top_k_top_p_keep(logits.tolist(), 0, 0.6)[0])
    assert {i for i, p in enumerate(v1) if p} == {0, 1, 2} and len(v0_support) == 11

    n = 4000
    sampler = Sampler(len(probs), torch.device("cpu"), eos_token_ids=set(), seed=0)
    seq = fake_seq(SamplingParams(temperature=1.0, top_p=0.6, min_p=0.05))
    tokens = sampler(logits[None, :].expand(n, -1), [seq] * n).token_ids
    counts = Counter(tokens)
    assert set(counts) == {0, 1, 2}, counts  # none of the eight tokens only V0's order keeps
    # 2 degrees of freedom: P(chi2 > 20) is about 5e-5
    assert _chi_square([counts[i] for i in range(3)], v1[:3]) < 20, (counts, v1[:3])


def test_top_p_sampling_stays_in_the_nucleus():
    counts = _draw(SamplingParams(temperature=1.0, top_p=0.75))
    kept, _ = ref_top_k_top_p_keep(LOGITS, 0, 0.75)
    assert {t for t, c in enumerate(counts) if c} == kept


def test_greedy_rows_mixed_with_sampled_rows_take_the_argmax():
    logits = torch.tensor([LOGITS] * 4)
    sampler = Sampler(len(LOGITS), torch.device("cpu"), eos_token_ids=set())
    seqs = [fake_seq(SamplingParams(temperature=t)) for t in (0.0, 5.0, 0.0, 5.0)]
    for _ in range(20):
        tokens = sampler(logits, seqs).token_ids
        assert tokens[0] == tokens[2] == 5


# ----------------------------------------------------------------------------------------------- seeds, logprobs


def test_seeded_row_draws_the_same_alone_and_in_any_batch():
    gen = torch.Generator().manual_seed(0)
    vocab = 50
    steps = [torch.randn((4, vocab), generator=gen) for _ in range(8)]
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, seed=42)

    alone_seq = fake_seq(params, seed=42)
    alone = Sampler(vocab, torch.device("cpu"), set(), seed=1)
    alone_tokens = [alone(logits[2:3], [alone_seq]).token_ids[0] for logits in steps]

    mixed_seq = fake_seq(params, seed=42)
    others = [
        fake_seq(SamplingParams(temperature=1.3)),
        fake_seq(SamplingParams(temperature=0.5, seed=7), seed=7),
    ]
    mixed = Sampler(vocab, torch.device("cpu"), set(), seed=2)
    mixed_tokens = []
    for i, logits in enumerate(steps):
        rows = [others[0], mixed_seq, others[1]] if i % 2 else [mixed_seq, others[1], others[0]]
        batch = torch.stack([logits[0], logits[2], logits[1]]) if i % 2 else logits[[2, 1, 0]]
        mixed_tokens.append(mixed(batch, rows).token_ids[rows.index(mixed_seq)])
    assert mixed_tokens == alone_tokens

    other_seed = fake_seq(SamplingParams(temperature=0.9, top_k=20, top_p=0.95, seed=43), seed=43)
    other_tokens = [alone(logits[2:3], [other_seed]).token_ids[0] for logits in steps]
    assert other_tokens != alone_tokens


def test_logprobs_are_raw_log_softmax_with_top_n():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.5], [3.0, 0.0, 0.0, 1.0]])
    sampler = Sampler(4, torch.device("cpu"), set())
    seqs = [
        fake_seq(SamplingParams(temperature=0.0, logprobs=2, repetition_penalty=5.0), prompt=[1]),
        fake_seq(SamplingParams(temperature=0.0)),
    ]
    out = sampler(logits, seqs)
    assert out.token_ids == [3, 0]  # the penalty moved row 0 off token 1
    expected = torch.log_softmax(logits[0], dim=-1)
    lp = out.logprobs[0]
    assert lp is not None and lp.token_id == 3
    assert lp.logprob == pytest.approx(expected[3].item(), abs=1e-6)
    assert list(lp.top) == [1, 3]
    assert lp.top[1] == pytest.approx(expected[1].item(), abs=1e-6)
    assert out.logprobs[1] is None


@settings(max_examples=150, deadline=None)
@given(
    rows=st.integers(1, 6),
    vocab=st.sampled_from([256, 300, 640, 1000, 1031]),
    levels=st.integers(1, 4),
    specials=st.lists(st.sampled_from(["nan", "inf", "-inf"]), max_size=3),
    seed=st.integers(0, 2**16),
)
def test_blocked_argmax_is_torch_argmax(rows, vocab, levels, specials, seed):
    """Ties resolve to the first index and NaN wins, in the blocks and in the tail, exactly as torch.argmax."""
    from unittest.mock import patch

    import rose.engine.sampler as sampler_mod

    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, levels, (rows, vocab), generator=g).float()  # few distinct values: many ties
    for i, value in enumerate(specials):
        r = int(torch.randint(0, rows, (1,), generator=g))
        c = int(torch.randint(0, vocab, (1,), generator=g)) if i % 2 else vocab - 1 - i  # tail and blocks
        x[r, c] = float(value)
    with patch.object(sampler_mod, "_ARGMAX_MIN_NUMEL", 0):
        got = sampler_mod.argmax(x)
        sliced = sampler_mod.argmax(x[:, : vocab - 7])  # a vocab slice: rows are strided, as in the sampler
    assert torch.equal(got, x.argmax(dim=-1))
    assert torch.equal(sliced, x[:, : vocab - 7].argmax(dim=-1))


def test_blocked_argmax_on_a_large_batch_matches_torch():
    from rose.engine.sampler import argmax

    x = torch.randn(64, 8192 + 37, generator=torch.Generator().manual_seed(0))
    x[3, 100] = x[3, 4000] = x[3].max() + 1  # a tie across blocks
    x[5, -1] = x[5].max() + 1  # the maximum in the tail
    assert torch.equal(argmax(x), x.argmax(dim=-1))


# ----------------------------------------------------------------------------------------------- checked after the draw


class AllowedSets:
    """A TokenCheck over fixed allowed sets (one bool row per sampled row; None: not checked), which records the
    rows it was asked to mask."""

    def __init__(self, allowed: list[torch.Tensor | None]) -> None:
        self.allowed = allowed
        self.masked_rows: list[int] = []

    def refused(self, token_ids: list[int]) -> list[int]:
        return [i for i, a in enumerate(self.allowed) if a is not None and not bool(a[token_ids[i]])]

    def mask(self, logits: torch.Tensor, rows: list[int]) -> None:
        self.masked_rows += rows
        for j, i in enumerate(rows):
            logits[j].masked_fill_(~self.allowed[i], NEG_INF)


def test_a_token_checked_after_the_draw_is_what_masking_first_draws():
    """Greedy rows and plain temperature draws (seeded or not) may be checked after the draw: a refused token is
    masked and drawn again with the same q, so every row gets the token masking first gives it."""
    gen = torch.Generator().manual_seed(3)
    vocab = 40
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, seed=11),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.5, seed=12),
        SamplingParams(temperature=1.0),  # not constrained
    ]
    first = Sampler(vocab, torch.device("cpu"), set(), seed=5)
    after = Sampler(vocab, torch.device("cpu"), set(), seed=5)
    first_seqs = [fake_seq(p, seed=p.seed) for p in params]
    after_seqs = [fake_seq(p, seed=p.seed) for p in params]
    refused = 0
    for _ in range(60):
        logits = torch.randn((len(params), vocab), generator=gen) * 3
        # each constrained row allows a random quarter to three quarters of the vocabulary
        share = torch.rand((len(params), 1), generator=gen) * 0.5 + 0.25
        allowed = list(torch.rand((len(params), vocab), generator=gen) < share)
        allowed[-1] = None
        masked = logits.clone()
        for i, a in enumerate(allowed[:-1]):
            masked[i].masked_fill_(~a, NEG_INF)
        expected = first(masked, first_seqs).token_ids
        check = AllowedSets(allowed)
        got = after(logits, after_seqs, check).token_ids
        assert got == expected
        assert all(allowed[i][t] for i, t in enumerate(got[:-1]))
        refused += len(check.masked_rows)
        assert (
            len(set(check.masked_rows)) == len(check.masked_rows) and len(params) - 1 not in check.masked_rows
        )
    assert 0 < refused < 60 * (len(params) - 1)  # some rows were masked, not all


def test_rows_that_need_their_mask_before_the_draw():
    assert checks_after(SamplingParams(temperature=0.0))
    assert checks_after(SamplingParams(temperature=0.0, top_k=5, top_p=0.5))  # greedy: the argmax
    assert checks_after(SamplingParams(temperature=0.8, seed=1, repetition_penalty=1.2))
    # truncation keeps a different set from masked logits; logprobs are reported from the masked logits
    assert not checks_after(SamplingParams(temperature=0.8, top_p=0.9))
    assert not checks_after(SamplingParams(temperature=0.8, top_k=40))
    assert not checks_after(SamplingParams(temperature=0.8, min_p=0.05))
    assert not checks_after(SamplingParams(temperature=0.0, logprobs=0))


# ----------------------------------------------------------------------------------------------- logit_bias


def test_logit_bias_is_added_per_row_before_the_penalties_and_raw_logprobs_ignore_it():
    logits = torch.tensor([[3.0, 2.5, 0.0, -4.0, 1.0]] * 3)
    sampler = Sampler(5, torch.device("cpu"), eos_token_ids=set())
    seqs = [
        fake_seq(SamplingParams(temperature=0.0, logit_bias={"1": 0.6}, logprobs=1)),  # 3.1 > 3.0
        fake_seq(SamplingParams(temperature=0.0)),  # no bias: its batchmates' do not reach it
        # vLLM V1: bias, then penalties: (2.5 + 2.5) / 2 = 2.5 < 3.0, where penalty-then-bias gives 3.75
        fake_seq(SamplingParams(temperature=0.0, logit_bias={1: 2.5}, repetition_penalty=2.0), prompt=[1]),
    ]
    out = sampler(logits, seqs)
    assert out.token_ids == [1, 0, 0]
    assert out.logprobs[0].logprob == pytest.approx(torch.log_softmax(logits[0], -1)[1].item())


def test_a_bias_of_minus_100_bans_a_token_from_sampled_rows_and_100_forces_one():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn((64, 10), generator=gen)
    sampler = Sampler(10, torch.device("cpu"), eos_token_ids=set(), seed=1)
    banned = SamplingParams(temperature=1.5, logit_bias={t: -100 for t in range(9)})
    forced = SamplingParams(temperature=1.0, logit_bias={"3": 100})
    out = sampler(logits, [fake_seq(banned)] * 32 + [fake_seq(forced)] * 32)
    assert out.token_ids == [9] * 32 + [3] * 32


@pytest.mark.parametrize(
    ("bias", "message"),
    [
        ({"x": 1}, "'x' is no token id"),
        ({-1: 1}, "-1 is no token id"),
        ({"1": 101}, r"logit_bias\[1\] must be a number in \[-100, 100\]"),
        ({"1": float("nan")}, r"logit_bias\[1\]"),
        ([1, 2], "must be a dict"),
    ],
)
def test_bad_logit_bias_is_refused_naming_it(bias, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(logit_bias=bias)


def test_allowed_token_ids_restrict_their_rows_alone_before_the_bias():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn((48, 10), generator=gen)
    sampler = Sampler(10, torch.device("cpu"), eos_token_ids=set(), seed=3)
    allowed = SamplingParams(temperature=2.0, allowed_token_ids=[2, 7])
    # the bias cannot reopen a token outside the allowed ones (vLLM V1: allowed ids first, then logit_bias)
    biased = SamplingParams(temperature=0.0, allowed_token_ids=[4], logit_bias={5: 100})
    plain = SamplingParams(temperature=0.0)
    out = sampler(logits, [fake_seq(allowed)] * 32 + [fake_seq(biased)] * 8 + [fake_seq(plain)] * 8)
    assert set(out.token_ids[:32]) == {2, 7}  # both drawn at this temperature over 32 rows
    assert out.token_ids[32:40] == [4] * 8
    assert out.token_ids[40:] == logits[40:].argmax(-1).tolist()
    with pytest.raises(ValueError, match="allowed_token_ids must be a non-empty list"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[1, -2])


def _banning(seq, words: list[list[int]]):
    """`seq` with the token sequences the engine would have made of its bad_words."""
    seq.bad_words_token_ids = words
    return seq


def test_bad_words_ban_a_last_token_only_right_after_the_rest_of_the_word():
    words = [[1, 2, 3], [4]]  # a three-token word ending in 3; a one-token word
    greedy = SamplingParams(temperature=0.0)
    seqs = [
        _banning(fake_seq(greedy, prompt=[1, 2], output=[]), words),  # 1, 2 in the prompt: not looked at
        _banning(fake_seq(greedy, output=[9, 1, 2]), words),  # ends with 1, 2: 3 banned (and 4, always)
        _banning(fake_seq(greedy, output=[2, 1]), words),  # not in this order
        _banning(fake_seq(greedy, output=[1, 2, 5]), words),  # not at the end
        _banning(fake_seq(greedy, output=[2]), words),  # shorter than the rest of the word
        fake_seq(greedy, output=[1, 2]),  # no bad words: untouched
        _banning(fake_seq(greedy, output=[]), [[3]]),  # a one-token word: banned from the first token on
    ]
    logits = torch.zeros((len(seqs), 10))
    logits[:, 3], logits[:, 4], logits[:, 7] = 5.0, 4.0, 3.0
    expected = logits.clone()
    expected[:, 4] = NEG_INF  # the one-token word, in every row that has it
    expected[1, 3] = NEG_INF
    expected[5, 4] = 4.0
    expected[6, 3], expected[6, 4] = NEG_INF, 4.0
    assert torch.equal(apply_bad_words(logits.clone(), seqs), expected)

    sampler = Sampler(10, torch.device("cpu"), eos_token_ids=set(), seed=0)
    before = logits.clone()
    out = sampler(logits, seqs)
    assert out.token_ids == [3, 7, 3, 3, 3, 3, 4]
    assert torch.equal(logits, before)  # the caller's logits (the raw ones, for logprobs) are left alone


def test_bad_words_come_after_allowed_token_ids_and_before_the_bias_and_penalties():
    logits = torch.zeros((3, 10))
    logits[:, 3], logits[:, 7] = 5.0, 1.0
    sampler = Sampler(10, torch.device("cpu"), eos_token_ids=set(), seed=0)
    # a bias of 100 cannot reopen a banned token, nor a repetition penalty below 1 (vLLM V1: bad words first)
    biased = SamplingParams(temperature=0.0, allowed_token_ids=[3, 7], logit_bias={3: 100})
    rewarded = SamplingParams(temperature=0.0, repetition_penalty=0.01)
    sampled = SamplingParams(temperature=1.0, allowed_token_ids=[3, 7])
    seqs = [
        _banning(fake_seq(biased), [[3]]),
        _banning(fake_seq(rewarded, prompt=[3]), [[3]]),
        _banning(fake_seq(sampled, output=[5]), [[5, 7]]),  # the only other allowed token is banned: 3
    ]
    assert sampler(logits, seqs).token_ids == [7, 7, 3]
    assert sampler(logits[:2], [fake_seq(biased), fake_seq(rewarded, prompt=[3])]).token_ids == [3, 3]


def test_bad_words_must_be_a_list_of_non_empty_strings():
    assert SamplingParams(bad_words=["a", "b", "a"]).bad_words == ["a", "b"]  # duplicates dropped, as vLLM
    assert SamplingParams(bad_words=[]).bad_words is None
    words = ["x"]
    params = SamplingParams(bad_words=words)
    words.append("y")
    assert params.bad_words == ["x"]  # a copy
    for bad in ("word", [""], ["a", 3], [["a"]]):
        with pytest.raises(ValueError, match="bad_words must be a list of non-empty strings"):
            SamplingParams(bad_words=bad)
