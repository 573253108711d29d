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

from engine.messages import SamplingParams, TokenLogprobs
from engine.sequence import Sequence

GREEDY_EPS = 1e-5  # temperatures below this are greedy, as in vLLM
MAX_CANDIDATES = 1024  # top_k up to this runs on the topk candidates only
REJECTION_ROUNDS = 8  # top_p draws per row before falling back to a sort
BIG = 1e30  # +inf logits become this: still the max, but arithmetic stays finite


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def _needs_processing(seq: Sequence, p: SamplingParams) -> bool:
    return bool(p.allowed_token_ids or p.logit_bias or p.presence_penalty or p.frequency_penalty
                or p.repetition_penalty != 1.0
                or (p.min_tokens and seq.num_output_tokens < p.min_tokens))


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: list[int], device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.device = torch.device(device)
        # reused [rows, V] scratch: a fresh 150k-wide tensor per op costs more in page faults
        # than the op itself on CPU
        self._scratch: dict[str, torch.Tensor] = {}

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        """One token per row of `logits` [len(seqs), V]; `logits` is not modified."""
        params = [s.params for s in seqs]
        greedy = [p.temperature < GREEDY_EPS for p in params]
        process = [i for i, (s, p) in enumerate(zip(seqs, params)) if _needs_processing(s, p)]
        want_lp = [i for i, p in enumerate(params) if p.logprobs is not None]
        x = logits.float()
        rowmax = x.amax(-1)  # NaN and +inf show here, cheaply
        insane = ~torch.isfinite(rowmax)
        if bool(insane.any()):
            x = x.clone()
            rows = insane.nonzero()[:, 0]
            fixed = torch.nan_to_num(x[rows], nan=-math.inf, posinf=BIG)
            fixed[fixed.amax(-1) == -math.inf] = 0.0  # nothing finite: uniform, not a crash
            x[rows] = fixed
        if all(greedy) and not process and not want_lp:
            return SamplerOutput(x.argmax(-1).tolist(), [None] * len(seqs))
        raw_lp = torch.log_softmax(x[want_lp], -1) if want_lp else None
        if process:
            raw, x = x, self._buffer("processed", x)
            self._process(x, [seqs[i] for i in process], process)
            rows_t = torch.tensor(process, device=x.device)
            dead = x[rows_t].amax(-1) == -math.inf  # contradictory masks: use the raw logits
            if bool(dead.any()):
                x[rows_t[dead]] = raw[rows_t[dead]]
        tokens = torch.empty(len(seqs), dtype=torch.long, device=x.device)
        g_rows = [i for i, g in enumerate(greedy) if g]
        r_rows = [i for i, g in enumerate(greedy) if not g]
        if g_rows:
            tokens[g_rows] = x[g_rows].argmax(-1)
        if r_rows:
            tokens[r_rows] = self._random(x, r_rows, [seqs[i] for i in r_rows])
        token_list = tokens.tolist()
        out_lp: list[TokenLogprobs | None] = [None] * len(seqs)
        if raw_lp is not None:
            sel = [token_list[i] for i in want_lp]
            ns = [params[i].logprobs or 0 for i in want_lp]
            for i, tlp in zip(want_lp, self._logprobs(raw_lp, sel, ns)):
                out_lp[i] = tlp
        return SamplerOutput(token_list, out_lp)

    def prompt_logprobs(self, logits: torch.Tensor, target_ids: list[int], n: int) -> list[TokenLogprobs]:
        """Per position: the logprob and rank of target_ids[t] under logits[t], and the top n."""
        lp = torch.log_softmax(torch.nan_to_num(logits.float(), nan=-math.inf, posinf=BIG), -1)
        return self._logprobs(lp, target_ids, [n] * len(target_ids))

    def _buffer(self, name: str, like: torch.Tensor, rows: list[int] | None = None) -> torch.Tensor:
        """A scratch copy of like[rows] (all rows when None), reusing memory across steps."""
        n = like.shape[0] if rows is None else len(rows)
        buf = self._scratch.get(name)
        if buf is None or buf.shape[0] < n or buf.shape[1] != like.shape[1] or buf.device != like.device:
            buf = torch.empty(max(n, 8), like.shape[1], dtype=torch.float32, device=like.device)
            self._scratch[name] = buf
        out = buf[:n]
        if rows is None:
            out.copy_(like)
        else:
            torch.index_select(like, 0, torch.tensor(rows, device=like.device), out=out)
        return out

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
            x.index_put_((torch.tensor(bias_r, device=dev), torch.tensor(bias_c, device=dev)),
                         torch.tensor(bias_v, dtype=x.dtype, device=dev), accumulate=True)
        if ban_r:
            x[torch.tensor(ban_r, device=dev), torch.tensor(ban_c, device=dev)] = -math.inf
        pen_seqs = [(r, s) for r, s in zip(rows, seqs)
                    if s.params.presence_penalty or s.params.frequency_penalty
                    or s.params.repetition_penalty != 1.0]
        if pen_seqs:
            self._penalize(x, pen_seqs)

    def _penalize(self, x: torch.Tensor, pen: list[tuple[int, Sequence]]) -> None:
        V, dev = x.shape[1], x.device
        rows = torch.tensor([r for r, _ in pen], device=dev)
        xs = x[rows]
        rep = [s.params.repetition_penalty for _, s in pen]
        if any(v != 1.0 for v in rep):  # HF: over prompt + output, divide positives, multiply negatives
            seen = _token_matrix([s.token_ids for _, s in pen], V, dev) > 0
            rp = torch.tensor(rep, dtype=x.dtype, device=dev)[:, None]
            xs = torch.where(seen, torch.where(xs > 0, xs / rp, xs * rp), xs)
        freq = [s.params.frequency_penalty for _, s in pen]
        pres = [s.params.presence_penalty for _, s in pen]
        if any(freq) or any(pres):  # OpenAI: over output tokens only
            counts = _token_matrix([s.output_token_ids for _, s in pen], V, dev)
            xs = xs - torch.tensor(freq, dtype=x.dtype, device=dev)[:, None] * counts
            xs = xs - torch.tensor(pres, dtype=x.dtype, device=dev)[:, None] * (counts > 0)
        x[rows] = xs

    # ---- random draws ------------------------------------------------------------------
    def _random(self, x: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        V, dev = x.shape[1], x.device
        params = [s.params for s in seqs]
        temp = torch.tensor([p.temperature for p in params], dtype=x.dtype, device=dev)
        x = x / temp[:, None]
        min_p = [p.min_p for p in params]
        if any(min_p):  # prob < min_p * max prob  <=>  logit < max logit + log(min_p)
            mp = torch.tensor(min_p, dtype=x.dtype, device=dev)
            thr = x.amax(-1) + torch.log(mp)  # log(0) = -inf keeps everything
            x = x.masked_fill(x < thr[:, None], -math.inf)
        ks = [p.top_k if 0 < p.top_k < V else 0 for p in params]
        tokens = torch.empty(len(seqs), dtype=torch.long, device=dev)
        cand = [i for i, k in enumerate(ks) if 0 < k <= MAX_CANDIDATES]
        full = [i for i, k in enumerate(ks) if not 0 < k <= MAX_CANDIDATES]
        if cand:
            tokens[cand] = self._draw_candidates(x[cand], [seqs[i] for i in cand], [ks[i] for i in cand])
        if full:
            tokens[full] = self._draw_full(x[full], [seqs[i] for i in full], [ks[i] for i in full])
        return tokens

    def _draw_candidates(self, x: torch.Tensor, seqs: list[Sequence], ks: list[int]) -> torch.Tensor:
        dev = x.device
        vals, idx = x.topk(max(ks), dim=-1)  # sorted, largest first
        k = torch.tensor(ks, device=dev)
        vals = vals.masked_fill(torch.arange(vals.shape[1], device=dev)[None, :] >= k[:, None],
                                -math.inf)
        probs = torch.softmax(vals, -1)
        top_p = torch.tensor([s.params.top_p for s in seqs], dtype=x.dtype, device=dev)
        ahead = probs.cumsum(-1) - probs  # mass of the tokens ranked before each one
        probs = probs.masked_fill(ahead >= top_p[:, None], 0.0)
        pick = _inverse_cdf(probs, _uniforms(seqs, dev))
        return idx.gather(1, pick[:, None])[:, 0]

    def _draw_full(self, x: torch.Tensor, seqs: list[Sequence], ks: list[int]) -> torch.Tensor:
        dev = x.device
        if any(ks):  # large top_k: mask below each row's k-th largest logit
            k = torch.tensor([k or 1 for k in ks], device=dev)
            kth = x.topk(max(ks), dim=-1).values.gather(1, (k - 1)[:, None])
            on = torch.tensor([k > 0 for k in ks], device=dev)[:, None]
            x = x.masked_fill(on & (x < kth), -math.inf)
        probs = torch.softmax(x, -1)
        cdf = probs.cumsum(-1)
        pick = _search(cdf, probs, _uniforms(seqs, dev))
        nucleus = [i for i, s in enumerate(seqs) if s.params.top_p < 1.0]
        for _ in range(REJECTION_ROUNDS):
            if not nucleus:
                return pick
            rows = torch.tensor(nucleus, device=dev)
            pr = probs[rows]
            p_tok = pr.gather(1, pick[rows][:, None])
            ahead = (pr * (pr > p_tok)).sum(-1)  # mass of tokens more likely than the draw
            top_p = torch.tensor([seqs[i].params.top_p for i in nucleus], dtype=x.dtype, device=dev)
            missed = (ahead >= top_p * cdf[rows, -1]).tolist()
            nucleus = [i for i, m in zip(nucleus, missed) if m]
            if nucleus:  # redraw the misses from their own streams
                rows = torch.tensor(nucleus, device=dev)
                pick[rows] = _search(cdf[rows], probs[rows], _uniforms([seqs[i] for i in nucleus], dev))
        if nucleus:  # still missing: the nucleus is a sliver of a flat distribution; sort
            rows = torch.tensor(nucleus, device=dev)
            sp, si = probs[rows].sort(-1, descending=True)
            top_p = torch.tensor([seqs[i].params.top_p for i in nucleus], dtype=x.dtype, device=dev)
            sp = sp.masked_fill(sp.cumsum(-1) - sp >= top_p[:, None] * sp.sum(-1, keepdim=True), 0.0)
            pick[rows] = si.gather(1, _inverse_cdf(sp, _uniforms([seqs[i] for i in nucleus], dev))[:, None])[:, 0]
        return pick

    # ---- logprobs ----------------------------------------------------------------------
    def _logprobs(self, lp: torch.Tensor, token_ids: list[int], ns: list[int]) -> list[TokenLogprobs]:
        dev = lp.device
        tok = torch.tensor(token_ids, dtype=torch.long, device=dev)[:, None]
        tok_lp = lp.gather(1, tok)
        ranks = ((lp > tok_lp).sum(-1) + 1).tolist()
        n_max = min(max(ns, default=0), lp.shape[1])
        top_v, top_i = (lp.topk(n_max, dim=-1) if n_max else (lp[:, :0], tok[:, :0]))
        top_v_l, top_i_l = top_v.tolist(), top_i.tolist()
        return [TokenLogprobs(t, v, r, ti[:n], tv[:n])
                for t, v, r, ti, tv, n in zip(token_ids, tok_lp[:, 0].tolist(), ranks, top_i_l,
                                              top_v_l, ns)]


def _token_matrix(lists: list[list[int]], V: int, dev: torch.device) -> torch.Tensor:
    """[len(lists), V] occurrence counts of each token id."""
    counts = torch.zeros(len(lists), V, device=dev)
    lengths = torch.tensor([len(t) for t in lists], device=dev)
    flat = torch.tensor(list(itertools.chain.from_iterable(lists)), dtype=torch.long, device=dev)
    rows = torch.repeat_interleave(torch.arange(len(lists), device=dev), lengths)
    counts.index_put_((rows, flat), torch.ones_like(flat, dtype=counts.dtype), accumulate=True)
    return counts


def _uniforms(seqs: list[Sequence], dev: torch.device) -> torch.Tensor:
    """One U[0, 1) per row; a seeded request's comes from its own generator (created lazily)."""
    u = torch.rand(len(seqs))
    for i, s in enumerate(seqs):
        if s.params.seed is not None:
            if s.generator is None:
                s.generator = torch.Generator().manual_seed(s.params.seed)
            u[i] = torch.rand(1, generator=s.generator)[0]
    return u.to(dev)


def _search(cdf: torch.Tensor, probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index of the first cdf entry above u * total; never a zero-probability token."""
    target = (u.to(cdf.dtype) * cdf[:, -1])[:, None]
    pick = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[1] - 1)
    bad = probs.gather(1, pick) <= 0  # float edge: u * total rounded up to the total
    if bool(bad.any()):
        pick = torch.where(bad, probs.argmax(-1, keepdim=True), pick)
    return pick[:, 0]


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return _search(probs.cumsum(-1), probs, u)
