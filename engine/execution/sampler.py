"""Token sampling: logits processing, then greedy or exact random draws, plus logprobs.

Order (as vLLM): raw logprobs -> allowed_token_ids -> logit_bias -> min_tokens -> repetition,
frequency, presence penalties -> greedy argmax | temperature -> min_p, top_k -> top_p -> draw.
Random draws are inverse-CDF (softmax, cumsum, one uniform per row, searchsorted): exact and
far cheaper than torch.multinomial or a full sort on a 150k vocabulary. top_k runs on the topk
candidate set only; top_p without top_k draws from the full distribution and accepts the draw
when it lies in the nucleus (rejection: exact, <= 1/top_p tries expected), falling back to a
sort only for rows that keep missing. Seeded requests draw from their own generator.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from engine.cpu_kernels import argmax as cpu_argmax
from engine.cpu_kernels import topk as cpu_topk
from engine.messages import SamplingParams, TokenLogprobs
from engine.types.sequence import Sequence

GREEDY_EPS = 1e-5  # temperatures below this are greedy, as in vLLM
MAX_CANDIDATES = 1024  # top_k up to this runs on the topk candidates only
EXP_FLOOR = -87.0  # exp(x) below this is under float32's smallest normal (2^-126 ~ exp(-87.3)): taken as 0
EXP_ZERO = math.exp(EXP_FLOOR + 1.0)  # at or below: 0; a margin over exp(EXP_FLOOR) whatever exp's last-bit rounding
FIRST_CANDIDATES = 64  # a top_p draw looks for its nucleus among this many first (one pass), then MAX_CANDIDATES
BIG = 1e30  # +inf logits become this: still the max, but arithmetic stays finite
PROMPT_CHUNK = 64  # prompt positions scored at once
ARGMAX_CHUNK = 1024  # columns per block of the two-level argmax


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def _needs_processing(seq: Sequence, p: SamplingParams) -> bool:
    return bool(
        p.allowed_token_ids
        or p.logit_bias
        or p.presence_penalty
        or p.frequency_penalty
        or p.repetition_penalty != 1.0
        or (p.min_tokens and seq.num_output_tokens < p.min_tokens)
    )


def _masks(seq: Sequence) -> bool:
    p = seq.params
    return bool(p.allowed_token_ids or (p.min_tokens and seq.num_output_tokens < p.min_tokens))


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: list[int], device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.device = torch.device(device)
        # reused [rows, V] scratch: a fresh 150k-wide tensor per op costs more in page faults
        # than the op itself on CPU
        self._scratch: dict[str, torch.Tensor] = {}

    @torch.inference_mode()  # the runner's logits are inference tensors: in-place work needs the mode
    def sample(self, logits: torch.Tensor, seqs: list[Sequence], *, scratch: bool = False) -> SamplerOutput:
        """One token per row of `logits` [len(seqs), V]; `logits` is not modified unless `scratch`
        (the caller's throwaway buffer: penalties then apply in place, saving an [n, V] copy)."""
        if logits.shape[1] > self.vocab_size:  # padded embedding rows are not tokens
            logits = logits[:, : self.vocab_size]
        params = [s.params for s in seqs]
        greedy = [p.temperature < GREEDY_EPS for p in params]
        process = [i for i, (s, p) in enumerate(zip(seqs, params)) if _needs_processing(s, p)]
        want_lp = [i for i, p in enumerate(params) if p.logprobs is not None]
        if all(greedy) and not process and not want_lp and logits.dtype == torch.float32:
            picked = cpu_argmax.argmax(logits, torch.get_num_threads())  # one pass; None: not here, or a bad row
            if picked is not None:
                return SamplerOutput(picked.tolist(), [None] * len(seqs))
            maxima = _chunk_maxima(logits)  # doubles as the NaN / +inf check
            if bool(torch.isfinite(maxima.amax(-1)).all()):
                return SamplerOutput(_argmax(logits, maxima).tolist(), [None] * len(seqs))
        x = _sane(logits.float())
        raw_x = x  # vLLM reports logprobs of the raw distribution
        # masks (allowed ids, min_tokens bans) can contradict and leave a row nothing: keep the raw row
        masks = any(_masks(seqs[i]) for i in process)
        if process and scratch and not want_lp and not masks:
            self._process(x, [seqs[i] for i in process], process)
        elif process:
            raw, x = x, self._buffer("processed", x)
            self._process(x, [seqs[i] for i in process], process)
            if masks:
                rows_t = torch.tensor(process, device=x.device)
                dead = x.amax(-1)[rows_t] == -math.inf
                if bool(dead.any()):
                    x[rows_t[dead]] = raw[rows_t[dead]]
        tokens = torch.empty(len(seqs), dtype=torch.long, device=x.device)
        g_rows = [i for i, g in enumerate(greedy) if g]
        r_rows = [i for i, g in enumerate(greedy) if not g]
        if g_rows:
            tokens[g_rows] = _argmax(x if len(g_rows) == x.shape[0] else x[g_rows])
        if r_rows:
            tokens[r_rows] = self._random(x, r_rows, [seqs[i] for i in r_rows])
        token_list = tokens.tolist()
        out_lp: list[TokenLogprobs | None] = [None] * len(seqs)
        if want_lp:
            sel = [token_list[i] for i in want_lp]
            ns = [params[i].logprobs or 0 for i in want_lp]
            rows = raw_x if len(want_lp) == raw_x.shape[0] else raw_x[want_lp]
            for i, tlp in zip(want_lp, self._logprobs(rows, sel, ns)):
                out_lp[i] = tlp
        return SamplerOutput(token_list, out_lp)

    def prompt_logprobs(self, logits: torch.Tensor, target_ids: list[int], n: int) -> list[TokenLogprobs]:
        """Per position: the logprob and rank of target_ids[t] under logits[t], and the top n."""
        out: list[TokenLogprobs] = []
        for i in range(0, len(target_ids), PROMPT_CHUNK):  # bounded scratch for long prompts
            rows = _sane(logits[i : i + PROMPT_CHUNK, : self.vocab_size].float())
            out += self._logprobs(rows, target_ids[i : i + PROMPT_CHUNK], [n] * rows.shape[0])
        return out

    def _buffer(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """A scratch copy of `like`, reusing memory across steps."""
        return self._empty(name, like.shape[0], like.shape[1], torch.float32, like.device).copy_(like)

    # ---- logits processing (in place on x; rows[j] is seqs[j]'s row) ---------------------
    def _process(self, x: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> None:
        dev = x.device
        allow_r: list[int] = []
        allow_c: list[int] = []
        bias_r: list[int] = []
        bias_c: list[int] = []
        bias_v: list[float] = []
        ban_r: list[int] = []
        ban_c: list[int] = []
        for r, s in zip(rows, seqs):
            p = s.params
            if p.allowed_token_ids:
                allow_r += [r] * len(p.allowed_token_ids)
                allow_c += p.allowed_token_ids
            if p.logit_bias:
                bias_r += [r] * len(p.logit_bias)
                bias_c += p.logit_bias.keys()
                bias_v += p.logit_bias.values()
            if p.min_tokens and s.num_output_tokens < p.min_tokens:
                banned = list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_token_ids)
                ban_r += [r] * len(banned)
                ban_c += banned
        if allow_r:
            keep = torch.zeros_like(x, dtype=torch.bool)
            keep[torch.tensor(allow_r, device=dev), torch.tensor(allow_c, device=dev)] = True
            sel = torch.tensor(sorted(set(allow_r)), device=dev)
            x[sel] = x[sel].masked_fill(~keep[sel], -math.inf)
        if bias_r:
            x.index_put_(
                (torch.tensor(bias_r, device=dev), torch.tensor(bias_c, device=dev)),
                torch.tensor(bias_v, dtype=x.dtype, device=dev),
                accumulate=True,
            )
        if ban_r:
            x[torch.tensor(ban_r, device=dev), torch.tensor(ban_c, device=dev)] = -math.inf
        pen_seqs = [
            (r, s)
            for r, s in zip(rows, seqs)
            if s.params.presence_penalty or s.params.frequency_penalty or s.params.repetition_penalty != 1.0
        ]
        if pen_seqs:
            self._penalize(x, pen_seqs)

    def _penalize(self, x: torch.Tensor, pen: list[tuple[int, Sequence]]) -> None:
        """Touches only the (row, token) pairs that occurred: O(tokens), not O(rows * V)."""
        V, dev = x.shape[1], x.device
        rep = [s.params.repetition_penalty for _, s in pen]
        if any(v != 1.0 for v in rep):  # HF: over prompt + output, divide positives, multiply negatives
            r, t = _pairs([r for r, _ in pen], [s.token_ids for _, s in pen], dev)
            rp = torch.tensor(rep, dtype=x.dtype, device=dev)[_rank_of(pen, r, dev)]
            v = x[r, t]
            x[r, t] = torch.where(v > 0, v / rp, v * rp)  # repeated pairs write the same value
        freq = [s.params.frequency_penalty for _, s in pen]
        pres = [s.params.presence_penalty for _, s in pen]
        if any(freq) or any(pres):  # OpenAI: over output tokens only
            r, t = _pairs([r for r, _ in pen], [s.output_token_ids for _, s in pen], dev)
            if r.numel():
                j = _rank_of(pen, r, dev)
                x.index_put_((r, t), -torch.tensor(freq, dtype=x.dtype, device=dev)[j], accumulate=True)
                key = torch.unique(r * V + t)  # presence counts each token once
                j = _rank_of(pen, key // V, dev)
                x.index_put_((key // V, key % V), -torch.tensor(pres, dtype=x.dtype, device=dev)[j], accumulate=True)

    # ---- random draws (x: processed logits; rows: which of its rows; never modified) -------
    def _random(self, x: torch.Tensor, rows: list[int], seqs: list[Sequence]) -> torch.Tensor:
        V = x.shape[1]
        ks = [s.params.top_k if 0 < s.params.top_k < V else 0 for s in seqs]
        tokens = torch.empty(len(rows), dtype=torch.long, device=x.device)
        cand = [j for j, k in enumerate(ks) if 0 < k <= MAX_CANDIDATES]
        full = [j for j, k in enumerate(ks) if not 0 < k <= MAX_CANDIDATES]
        for group, draw in ((cand, self._draw_candidates), (full, self._draw_full)):
            if group:
                tokens[group] = draw(x, [rows[j] for j in group], [seqs[j] for j in group], [ks[j] for j in group])
        return tokens

    def _draw_candidates(self, x: torch.Tensor, rows: list[int], seqs: list[Sequence], ks: list[int]) -> torch.Tensor:
        """top_k rows: everything happens on the k largest logits (temperature keeps the order)."""
        dev = x.device
        xr = x if len(rows) == x.shape[0] else x[rows]
        found = cpu_topk.topk(xr, max(ks), torch.get_num_threads())  # one pass; None: not here, or too few finite
        vals, idx = found if found is not None else xr.topk(max(ks), dim=-1)
        vals = vals / _column([s.params.temperature for s in seqs], dev)
        vals = vals.masked_fill(
            torch.arange(vals.shape[1], device=dev)[None, :] >= torch.tensor(ks, device=dev)[:, None], -math.inf
        )
        min_p = [s.params.min_p for s in seqs]
        if any(min_p):  # prob < min_p * max prob  <=>  logit < max logit + log(min_p)
            vals = vals.masked_fill(vals < vals[:, :1] + torch.log(_column(min_p, dev)), -math.inf)
        probs = torch.softmax(vals, -1)
        ahead = probs.cumsum(-1) - probs  # mass of the tokens ranked before each one
        probs = probs.masked_fill(ahead >= _column([s.params.top_p for s in seqs], dev), 0.0)
        pick = _inverse_cdf(probs, _uniforms(seqs, dev))
        return idx.gather(1, pick[:, None])[:, 0]

    def _draw_full(self, x: torch.Tensor, rows: list[int], seqs: list[Sequence], ks: list[int]) -> torch.Tensor:
        """Inverse CDF over the whole vocabulary, in place in scratch memory."""
        dev = x.device
        n, V = len(rows), x.shape[1]
        buf = self._empty("work", n, V, torch.float32, dev)
        if n == x.shape[0]:  # shifting by the row max doubles as the copy into scratch
            e = torch.sub(x, x.amax(-1, keepdim=True), out=buf)
        else:
            r = torch.tensor(rows, device=dev)
            e = torch.index_select(x, 0, r, out=buf)
            e.sub_(e.amax(-1, keepdim=True))
        e.div_(_column([s.params.temperature for s in seqs], dev))  # row max is now 0
        _exp_floored_(e)  # unnormalized probabilities, max 1: the draw scales by the row total
        if any(ks):  # large top_k: zero what is below each row's k-th largest probability
            k = torch.tensor([k or 1 for k in ks], device=dev)
            kth = e.topk(max(ks), dim=-1).values.gather(1, (k - 1)[:, None])[:, 0]
            below = torch.nextafter(kth, torch.zeros_like(kth)).tolist()  # keeps ties with the k-th
            _zero_below(e, [t if k else 0.0 for t, k in zip(below, ks)])
        _zero_below(e, [s.params.min_p for s in seqs])  # relative to the max, which is 1
        cdf = _block_cdf(e)  # [n, blocks]: a full-width cumsum would write another [n, V]
        nucleus = [i for i, s in enumerate(seqs) if s.params.top_p < 1.0]
        if not nucleus:
            return _search_blocked(e, cdf, _uniforms(seqs, dev))
        pick = torch.empty(n, dtype=torch.long, device=dev)
        pick[torch.tensor(nucleus, device=dev)] = self._nucleus(e, cdf, [seqs[i] for i in nucleus], nucleus)
        plain = [i for i, s in enumerate(seqs) if s.params.top_p >= 1.0]
        if plain:
            r = torch.tensor(plain, device=dev)
            pick[r] = _search_blocked(e[r], cdf[r], _uniforms([seqs[i] for i in plain], dev))
        return pick

    def _nucleus(self, e: torch.Tensor, cdf: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> torch.Tensor:
        """Exact top_p: a draw among the most likely tokens whose predecessors hold less than top_p of the mass,
        from the top FIRST_CANDIDATES (one pass), else the top MAX_CANDIDATES, else a full sort."""
        dev = e.device
        r = torch.tensor(rows, device=dev)
        er = e if len(rows) == e.shape[0] else e[r]
        need = _column([s.params.top_p for s in seqs], dev) * cdf[r, -1:]
        out = torch.empty(len(rows), dtype=torch.long, device=dev)
        todo = list(range(len(rows)))
        for size in (FIRST_CANDIDATES, MAX_CANDIDATES, er.shape[1]):
            g = torch.tensor(todo, device=dev)
            rows_e = er if len(todo) == er.shape[0] else er[g]
            k = min(size, er.shape[1])
            if k == er.shape[1]:
                v, i = rows_e.sort(-1, descending=True)
            else:
                found = cpu_topk.topk(rows_e, k, torch.get_num_threads())
                v, i = found if found is not None else rows_e.topk(k, dim=-1)
            held = (v.sum(-1, keepdim=True) >= need[g])[:, 0].tolist()
            done = [j for j, h in enumerate(held) if h or k == er.shape[1]]
            if done:
                d = torch.tensor(done, device=dev)
                vd = v[d].masked_fill(v[d].cumsum(-1) - v[d] >= need[g][d], 0.0)  # predecessors hold top_p
                picks = _inverse_cdf(vd, _uniforms([seqs[todo[j]] for j in done], dev))
                out[g[d]] = i[d].gather(1, picks[:, None])[:, 0]
            todo = [todo[j] for j, h in enumerate(held) if not (h or k == er.shape[1])]
            if not todo:
                break
        return out

    def _empty(self, name: str, n: int, V: int, dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
        buf = self._scratch.get(name)
        if buf is None or buf.shape[0] < n or buf.shape[1] != V or buf.device != dev:
            buf = torch.empty(max(n, 8), V, dtype=dtype, device=dev)
            self._scratch[name] = buf
        return buf[:n]

    # ---- logprobs ----------------------------------------------------------------------
    def _logprobs(self, x: torch.Tensor, token_ids: list[int], ns: list[int]) -> list[TokenLogprobs]:
        """From raw (finite-max) logits rows: logprob = logit - logsumexp, rank, top-n."""
        dev, (n, V) = x.device, x.shape
        top = x.amax(-1, keepdim=True)
        exp = torch.sub(x, top, out=self._empty("tmp", n, V, torch.float32, dev)).exp_()
        lse = top + exp.sum(-1, keepdim=True).log()
        tok = torch.tensor(token_ids, dtype=torch.long, device=dev)[:, None]
        tok_x = x.gather(1, tok)
        # exp is spent: its memory counts the logits above the token's
        ranks = (_count_above(x, tok_x.clamp(min=-BIG), exp) + 1).long().tolist()
        n_max = min(max(ns, default=0), V)
        top_v, top_i = x.topk(n_max, dim=-1) if n_max else (x[:, :0], tok[:, :0])
        top_v_l, top_i_l = (top_v - lse).tolist(), top_i.tolist()
        return [
            TokenLogprobs(t, v, r, ti[:k], tv[:k])
            for t, v, r, ti, tv, k in zip(token_ids, (tok_x - lse)[:, 0].tolist(), ranks, top_i_l, top_v_l, ns)
        ]


def _pairs(rows: list[int], lists: list[list[int]], dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Flattened (row, token id) index tensors for each row's token list."""
    lengths = torch.tensor([len(t) for t in lists], device=dev)
    flat = torch.tensor(list(itertools.chain.from_iterable(lists)), dtype=torch.long, device=dev)
    return torch.repeat_interleave(torch.tensor(rows, device=dev), lengths), flat


def _rank_of(pen: list[tuple[int, Sequence]], r: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """Map batch row ids back to positions in `pen` (whose rows ascend)."""
    return torch.searchsorted(torch.tensor([row for row, _ in pen], device=dev), r)


def _sane(x: torch.Tensor) -> torch.Tensor:
    """x, or a copy whose NaN/+inf rows are repaired; one cheap max pass when all is well."""
    insane = ~torch.isfinite(x.amax(-1))  # NaN and +inf show in the row max
    if not bool(insane.any()):
        return x
    x = x.clone()
    rows = insane.nonzero()[:, 0]
    fixed = torch.nan_to_num(x[rows], nan=-math.inf, posinf=BIG)
    fixed[fixed.amax(-1) == -math.inf] = 0.0  # nothing finite: uniform, not a crash
    x[rows] = fixed
    return x


def _chunk_maxima(x: torch.Tensor) -> torch.Tensor:
    """[n, ceil(V / ARGMAX_CHUNK)]: each row's max over consecutive blocks of ARGMAX_CHUNK columns."""
    n, V = x.shape
    full = V // ARGMAX_CHUNK * ARGMAX_CHUNK
    m = torch.unflatten(x[:, :full], 1, (-1, ARGMAX_CHUNK)).amax(-1)
    return torch.cat([m, x[:, full:].amax(-1, keepdim=True)], 1) if full < V else m


def _argmax(x: torch.Tensor, maxima: torch.Tensor | None = None) -> torch.Tensor:
    """x.argmax(-1) (the first maximal column) for rows without NaN, faster on CPU
    (bench/README.md, "Sampler and LM-head micro-optimisations").

    torch's CPU argmax runs scalar; amax vectorizes. So: block maxima, the first block holding
    the row max, then argmax inside that one block only.
    """
    if x.shape[1] <= ARGMAX_CHUNK or x.stride(1) != 1:
        return x.argmax(-1)
    maxima = _chunk_maxima(x) if maxima is None else maxima
    block = maxima.argmax(-1)
    cols = block[:, None] * ARGMAX_CHUNK + torch.arange(ARGMAX_CHUNK, device=x.device)
    # the last block may be short: its overhang repeats the last column, after the real ones
    within = x.gather(1, cols.clamp_(max=x.shape[1] - 1)).argmax(-1)
    return block * ARGMAX_CHUNK + within


def _count_above(x: torch.Tensor, t: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    """Per row: how many entries of x exceed t; sign/clamp in place beats a bool mask's sum."""
    return torch.sub(x, t, out=buf).sign_().clamp_(min=0).sum(-1)


def _exp_floored_(x: torch.Tensor) -> torch.Tensor:
    """exp in place, with arguments under EXP_FLOOR (and -inf: banned tokens) giving exactly 0: torch's exp is ~30x
    slower below float32's normal range (a 262,144-token row at temperature 0.2: 2.4 ms), and a probability under
    2^-124 of the top token's is nothing a draw can tell from 0."""
    x.clamp_(min=EXP_FLOOR).exp_()
    return torch.threshold_(x, EXP_ZERO, 0.0)


def _zero_below(x: torch.Tensor, thresholds: list[float]) -> None:
    """Per row, in place: entries <= its threshold (when > 0) become 0.

    threshold_ on a row view is much cheaper than building a mask
    (bench/README.md, "Sampler and LM-head micro-optimisations").
    """
    for i, t in enumerate(thresholds):
        if t > 0:
            torch.threshold_(x[i], t, 0.0)


def _column(values: list[float], dev: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=dev)[:, None]


def _uniforms(seqs: list[Sequence], dev: torch.device) -> torch.Tensor:
    """One U[0, 1) per row; a seeded request's comes from its own generator (created lazily)."""
    u: list[float] = torch.rand(len(seqs)).tolist()
    for i, s in enumerate(seqs):
        if s.params.seed is not None:
            if s.generator is None:
                s.generator = torch.Generator().manual_seed(s.params.seed)
            u[i] = torch.rand(1, generator=s.generator).item()
    return torch.tensor(u, dtype=torch.float32, device=dev)


def _search(cdf: torch.Tensor, probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index of the first cdf entry above u * total; never a zero-probability token."""
    target = (u.to(cdf.dtype) * cdf[:, -1])[:, None]
    pick = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[1] - 1)
    bad = probs.gather(1, pick) <= 0  # float edge: u * total rounded up to the total
    if bool(bad.any()):
        pick = torch.where(bad, probs.argmax(-1, keepdim=True), pick)
    return pick[:, 0]


def _block_cdf(e: torch.Tensor) -> torch.Tensor:
    """[n, ceil(V / ARGMAX_CHUNK)] cumulative masses of consecutive column blocks; [:, -1] is the total."""
    V = e.shape[1]
    full = V // ARGMAX_CHUNK * ARGMAX_CHUNK
    sums = torch.unflatten(e[:, :full], 1, (-1, ARGMAX_CHUNK)).sum(-1)
    if full < V:
        sums = torch.cat([sums, e[:, full:].sum(-1, keepdim=True)], 1)
    return sums.cumsum_(-1)


def _search_blocked(probs: torch.Tensor, block_cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF in two levels (the block holding u * total, then the token inside it): the same
    draw as a full-width cumsum + search, reading one block per row instead of writing [n, V]."""
    V, C = probs.shape[1], ARGMAX_CHUNK
    if V <= C or probs.stride(1) != 1:
        return _inverse_cdf(probs, u)
    target = (u.to(block_cdf.dtype) * block_cdf[:, -1])[:, None]
    block = torch.searchsorted(block_cdf, target, right=True).clamp_(max=block_cdf.shape[1] - 1)
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    cols = block * C + torch.arange(C, device=probs.device)
    inside = probs.gather(1, cols.clamp(max=V - 1)).masked_fill_(cols >= V, 0.0)  # short last block
    pick = block * C + torch.searchsorted(inside.cumsum(-1), target - before, right=True).clamp_(max=C - 1)
    bad = probs.gather(1, pick.clamp_(max=V - 1)) <= 0  # float edge: rounding past the block's mass
    if bool(bad.any()):
        pick = torch.where(bad, probs.argmax(-1, keepdim=True), pick)
    return pick[:, 0]


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return _search(probs.cumsum(-1), probs, u)
