"""Filtered sampling without a sort: top-k / top-p / min-p and Gumbel-max in a few passes over
the logits (core/random_draw.py's apply_filters defines the distribution; this draws from it).

Notation, per row: s = x / T (the scores; bitwise torch.div's), m = max s, thr_k = the k-th
largest s (-inf without top-k), Z = the sum of exp(s - m) over the top-k set {s >= thr_k}, and
S_gt(v) = the same sum over the top-k tokens with s > v.

Top-p without sorting. apply_filters keeps the sorted prefix up to the first position j whose
cumulative mass reaches top_p * Z, and every token tied with it. Claim: token i is kept iff
S_gt(s_i) < top_p * Z. Let v* be the value at position j. If s_i >= v* (kept): every token with
s > s_i sorts before position j, so S_gt(s_i) <= the mass before j, which is < top_p * Z as j is
the first to reach it. If s_i < v* (dropped): positions 0..j all hold values > s_i, so
S_gt(s_i) >= the mass up to j >= top_p * Z. The rule depends on s_i alone, so tied tokens are
kept or dropped together, as apply_filters does; the top token (S_gt = 0) is always kept.

So the kept set K (top-k, top-p and min-p, each a threshold on s) is an upper set of s, and
sampling is rejection with a rising floor, with _gumbel_argmax_kernel's noise: c = argmax of
s + gumbel over a candidate set C that contains K (lowest index on ties); if c is in K, it is
also the argmax over K, as K is in C. If not, every token of K has s > s_c (K is an upper set),
so C shrinks to {s > s_c} and the search repeats. It ends, since the top token is kept; c is
kept with probability the mass of K within C (at least top_p without min-p), so usually at
once. No host sync and a fixed set of launches: CUDA-graph safe.

Launches (each row is split into chunks of CHUNK columns):
- scan, round 0 (B x chunks): per chunk its max, its mass (relative to that max) and its best
  candidate over {s >= thr_k, s >= running max + log(min_p)}: a superset of K, since the
  running max never exceeds m. Greedy rows (T = 0) take the first argmax of x instead.
- mass (B x chunks, with top-p): S_gt(s_c) of the row's candidate c, per chunk; a chunk whose
  max is <= s_c reads nothing.
- decide (B): keeps c (writes the token) or raises the row's floor to s_c. Rounds 1..R repeat
  scan (over {s >= max(thr_k, m + log(min_p)), s > floor}; a chunk whose max is <= floor, or
  too far below m to win, reads nothing), mass and decide for the rows still open; the last
  decide finishes the rare rows left with the same loop over the whole row, in one program
  per row.
A tile whose largest score cannot beat the best one seen (its max s + the largest possible
noise < best) skips its hash and logs: most of the vocabulary under top-k, or when the
distribution is peaked.

Numerics: tokens and thresholds are exact (the same fp32 scores, comparisons and noise as the
sorting route); only the mass sums round differently (tiles and chunks here, a cumsum there),
so a top-p cut within ~1e-6 * Z of a boundary between two values may fall on the other side.
"""

import torch
import triton
import triton.language as tl

from nanovllm.kernels.sampling import _log_exp_noise, _row_key

# Bounds of -log(-log u) over every u the hash makes ((2j + 1) / 2**24: 16.64 at the top, -2.81
# at the bottom), with room for rounding of the logs.
_NOISE_HI = tl.constexpr(17.0)
_NOISE_LO = tl.constexpr(-3.0)
# The kernels' runtime flags (0 / 1): Triton would specialize each on being 1 (a variant per mix).
_FLAGS = ["has_thr", "has_top_p", "has_min_p", "first", "last"]


@triton.jit
def _scaled(x, t, SCALE: tl.constexpr):
    # Correctly rounded like torch.div (a plain `/` is approximate on NVIDIA GPUs).
    if SCALE:
        x = tl.div_rn(x, t)
    return x


@triton.jit
def _tile_scores(x_row, cols, vocab, t, SCALE: tl.constexpr):
    """The fp32 scores of columns cols of a row (-inf past the vocabulary)."""
    return _scaled(tl.load(x_row + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32), t, SCALE)


@triton.jit
def _row_params(row, temp_ptr, thr_ptr, top_p_ptr, log_min_p_ptr, has_thr, has_top_p, has_min_p,
                SCALE: tl.constexpr):
    """(T, divisor, thr_k on the scores, top_p, log(min_p)) of a row; filters off: -inf, 1, -inf.
    (The loads are cast to fp32, so a branch taken or not yields the same type.)"""
    temp = tl.load(temp_ptr + row)
    t = tl.where(temp > 0, temp, 1.0)
    thr_s = tl.full([], float("-inf"), tl.float32)
    if has_thr != 0:
        thr_s = _scaled(tl.load(thr_ptr + row).to(tl.float32), t, SCALE)
    top_p = tl.full([], 1.0, tl.float32)
    if has_top_p != 0:
        top_p = tl.load(top_p_ptr + row).to(tl.float32)
    log_min_p = tl.full([], float("-inf"), tl.float32)
    if has_min_p != 0:
        log_min_p = tl.load(log_min_p_ptr + row).to(tl.float32)
    return temp, t, thr_s, top_p, log_min_p


@triton.jit
def _needs_mass(cs, m, top_p, log_min_p):
    """Whether candidate score cs needs S_gt(cs) to be decided (it passes min-p, is not the
    row's top value and the row has top-p). Every kernel evaluates this same expression."""
    return (cs >= m + log_min_p) & (top_p < 1.0) & (cs < m)


@triton.jit
def _chunk_argmax(x_row, start, vocab, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """(max, first index of it) of x over columns start..start+CHUNK-1, for greedy rows."""
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK], tl.int32) + start
    for off in range(0, CHUNK, BLOCK):
        cols = start + off + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        better = x > best
        best = tl.where(better, x, best)
        best_i = tl.where(better, cols, best_i)
    top = tl.max(best, axis=0)
    return top, tl.min(tl.where(best == top, best_i, 2147483647), axis=0)


@triton.jit
def _chunk_candidate(x_row, start, vocab, t, key, thr_s, log_min_p, lower, floor, top, m_run,
                     need_z, CHUNK: tl.constexpr, BLOCK: tl.constexpr, SCALE: tl.constexpr,
                     ONLINE: tl.constexpr):
    """Best (score, index) of s + gumbel over the chunk's tokens with s >= lower and s > floor.

    ONLINE (round 0): lower is instead max(thr_s, running max + log_min_p), and the chunk's max
    m_run and mass z (exp(s - m_run) summed over s >= thr_s; when need_z) come back too.
    top: a score that some candidate is known to reach (-inf if none): a tile whose max s plus
    _NOISE_HI is below it cannot win and skips the noise. Returns (score, index, top, m_run, z).
    """
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK], tl.int32) + start
    z_lane = tl.zeros([BLOCK], tl.float32)
    for off in range(0, CHUNK, BLOCK):
        cols = start + off + tl.arange(0, BLOCK)
        s = _tile_scores(x_row, cols, vocab, t, SCALE)
        tile_max = tl.max(s, axis=0)
        if ONLINE:
            m_new = tl.maximum(m_run, tile_max)
            if need_z != 0:
                ref = tl.where(m_new > float("-inf"), m_new, 0.0)  # an all -inf prefix adds 0
                z_lane = z_lane * tl.exp(m_run - ref) + tl.where(s >= thr_s, tl.exp(s - ref), 0.0)
            m_run = m_new
            lower = tl.maximum(thr_s, m_run + log_min_p)
            # The running max is a candidate (when it passes top-k): its score is >= it + _NOISE_LO.
            top = tl.maximum(top, tl.where(m_run >= thr_s, m_run + _NOISE_LO, float("-inf")))
        if (tile_max >= lower) & (tile_max > floor) & (tile_max + _NOISE_HI >= top):
            score = tl.where((s >= lower) & (s > floor), s - _log_exp_noise(cols, key), float("-inf"))
            better = score > best
            best = tl.where(better, score, best)
            best_i = tl.where(better, cols, best_i)
            top = tl.maximum(top, tl.max(score, axis=0))
    cv = tl.max(best, axis=0)
    ci = tl.min(tl.where(best == cv, best_i, 2147483647), axis=0)
    return cv, ci, top, m_run, tl.sum(z_lane, axis=0)


@triton.jit
def _chunk_mass_above(x_row, start, vocab, t, v, thr_s, m, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                      SCALE: tl.constexpr):
    """Sum of exp(s - m) over the chunk's tokens with s > v and s >= thr_s."""
    acc = tl.zeros([BLOCK], tl.float32)
    for off in range(0, CHUNK, BLOCK):
        cols = start + off + tl.arange(0, BLOCK)
        s = _tile_scores(x_row, cols, vocab, t, SCALE)
        acc += tl.where((s > v) & (s >= thr_s), tl.exp(s - m), 0.0)
    return tl.sum(acc, axis=0)


@triton.jit
def _row_candidate(cand_v_ptr, cand_i_ptr, cand_s_ptr, base, n_chunks, NC_P2: tl.constexpr):
    """The row's candidate from its chunks' (score, index, s): best score, lowest index on ties.
    Only comparisons, so every kernel that reduces the same partials gets the same answer."""
    j = tl.arange(0, NC_P2)
    jm = j < n_chunks
    cv = tl.load(cand_v_ptr + base + j, mask=jm, other=float("-inf"))
    ci = tl.load(cand_i_ptr + base + j, mask=jm, other=2147483647)
    best = tl.max(cv, axis=0)
    idx = tl.min(tl.where(cv == best, ci, 2147483647), axis=0)
    cs = tl.load(cand_s_ptr + base + j, mask=jm, other=float("-inf"))
    return idx, tl.max(tl.where((cv == best) & (ci == idx), cs, float("-inf")), axis=0)


# n_rows is not specialized (Triton would compile a variant for 1, for multiples of 16 and for
# the rest): the batch size changes from step to step, and a compile in the middle of a run
# stalls that step for a second.
@triton.jit(do_not_specialize=["n_rows", *_FLAGS])
def _filter_scan_kernel(x_ptr, x_stride, temp_ptr, thr_ptr, top_p_ptr, log_min_p_ptr, seed_ptr, offset_ptr,
                        part_m_ptr, part_mi_ptr, part_z_ptr, cand_v_ptr, cand_i_ptr, cand_s_ptr,
                        state_ptr, done_ptr, n_rows, vocab, n_chunks, has_thr, has_top_p, has_min_p, first, last,
                        CHUNK: tl.constexpr, BLOCK: tl.constexpr, SCALE: tl.constexpr):
    """One chunk of one row: its best candidate (and in round 0 its max and mass). Grid (B, chunks)."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    p = row * n_chunks + chunk
    start = chunk * CHUNK
    x_row = x_ptr + row.to(tl.int64) * x_stride
    neg_inf = tl.full([], float("-inf"), tl.float32)
    # (Rows already settled return before touching anything else: most programs of later rounds.)
    if first != 0:
        if tl.load(temp_ptr + row) == 0:
            m_j, m_i = _chunk_argmax(x_row, start, vocab, CHUNK, BLOCK)
            tl.store(part_m_ptr + p, m_j)
            tl.store(part_mi_ptr + p, m_i)
        else:
            _, t, thr_s, _, log_min_p = _row_params(row, temp_ptr, thr_ptr, top_p_ptr, log_min_p_ptr,
                                                    has_thr, 0, has_min_p, SCALE)
            key = _row_key(seed_ptr, offset_ptr, row)
            cv, ci, _, m_j, z = _chunk_candidate(x_row, start, vocab, t, key, thr_s, log_min_p, neg_inf, neg_inf,
                                                 neg_inf, neg_inf, has_top_p, CHUNK, BLOCK, SCALE, True)
            cs = tl.where(cv > float("-inf"), _scaled(tl.load(x_row + ci).to(tl.float32), t, SCALE), float("-inf"))
            tl.store(part_m_ptr + p, m_j)
            tl.store(part_z_ptr + p, z)
            tl.store(cand_v_ptr + p, cv)
            tl.store(cand_i_ptr + p, ci)
            tl.store(cand_s_ptr + p, cs)
    elif tl.load(done_ptr + row) == 0:
        _, t, thr_s, _, log_min_p = _row_params(row, temp_ptr, thr_ptr, top_p_ptr, log_min_p_ptr,
                                                has_thr, 0, has_min_p, SCALE)
        m = tl.load(state_ptr + row)
        floor = tl.load(state_ptr + 2 * n_rows + row)
        lower = tl.maximum(thr_s, m + log_min_p)
        m_j = tl.load(part_m_ptr + p)
        cv = neg_inf
        ci = start
        cs = neg_inf
        # The row's max is a candidate now, so its score bounds the winner's from below; a chunk
        # with nothing above the floor, or that cannot reach the bound, is not even read.
        top = m + _NOISE_LO
        if (m_j > floor) & (m_j >= lower) & (m_j + _NOISE_HI >= top):
            key = _row_key(seed_ptr, offset_ptr, row)
            cv, ci, _, _, _ = _chunk_candidate(x_row, start, vocab, t, key, thr_s, log_min_p, lower, floor,
                                               top, neg_inf, 0, CHUNK, BLOCK, SCALE, False)
            cs = tl.where(cv > float("-inf"), _scaled(tl.load(x_row + ci).to(tl.float32), t, SCALE),
                          float("-inf"))
        tl.store(cand_v_ptr + p, cv)
        tl.store(cand_i_ptr + p, ci)
        tl.store(cand_s_ptr + p, cs)


@triton.jit(do_not_specialize=_FLAGS)
def _filter_mass_kernel(x_ptr, x_stride, temp_ptr, thr_ptr, top_p_ptr, log_min_p_ptr,
                        part_m_ptr, cand_v_ptr, cand_i_ptr, cand_s_ptr, part_s_ptr, state_ptr, done_ptr,
                        vocab, n_chunks, has_thr, has_top_p, has_min_p, first, last,
                        CHUNK: tl.constexpr, BLOCK: tl.constexpr, NC_P2: tl.constexpr, SCALE: tl.constexpr):
    """One chunk's part of S_gt(s_c) for the row's candidate c, where needed. Grid (B, chunks)."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    base = row * n_chunks
    if first != 0:
        active = tl.load(temp_ptr + row) != 0
        j = tl.arange(0, NC_P2)
        m = tl.max(tl.load(part_m_ptr + base + j, mask=j < n_chunks, other=float("-inf")), axis=0)
    else:
        active = tl.load(done_ptr + row) == 0
        m = tl.load(state_ptr + row)
    if active:
        _, t, thr_s, top_p, log_min_p = _row_params(row, temp_ptr, thr_ptr, top_p_ptr, log_min_p_ptr,
                                                    has_thr, 1, has_min_p, SCALE)
        _, cs = _row_candidate(cand_v_ptr, cand_i_ptr, cand_s_ptr, base, n_chunks, NC_P2)
        if _needs_mass(cs, m, top_p, log_min_p):
            mass = tl.full([], 0.0, tl.float32)
            if tl.load(part_m_ptr + base + chunk) > cs:
                x_row = x_ptr + row.to(tl.int64) * x_stride
                mass = _chunk_mass_above(x_row, chunk * CHUNK, vocab, t, cs, thr_s, m, CHUNK, BLOCK, SCALE)
            tl.store(part_s_ptr + base + chunk, mass)


@triton.jit(do_not_specialize=["n_rows", *_FLAGS])
def _filter_decide_kernel(x_ptr, x_stride, temp_ptr, thr_ptr, top_p_ptr, log_min_p_ptr, seed_ptr, offset_ptr,
                          part_m_ptr, part_mi_ptr, part_z_ptr, cand_v_ptr, cand_i_ptr, cand_s_ptr, part_s_ptr,
                          state_ptr, done_ptr, out_ptr, n_rows, vocab, n_chunks, max_iters,
                          has_thr, has_top_p, has_min_p, first, last,
                          CHUNK: tl.constexpr, BLOCK: tl.constexpr, NC_P2: tl.constexpr, SCALE: tl.constexpr):
    """Keeps the row's candidate (writes the token) or raises its floor. Grid (B,).

    last: a row still open runs the rejection loop itself over its whole row (rare after the
    chunked rounds), at most max_iters candidates (then the last one is taken: never reached
    short of NaN logits, since the floor rises past a distinct value each time).
    """
    row = tl.program_id(0)
    base = row * n_chunks
    j = tl.arange(0, NC_P2)
    jm = j < n_chunks
    temp, t, thr_s, top_p, log_min_p = _row_params(row, temp_ptr, thr_ptr, top_p_ptr, log_min_p_ptr,
                                                   has_thr, has_top_p, has_min_p, SCALE)
    open_ = tl.full([], 1, tl.int32)
    token = tl.full([], 0, tl.int32)
    z = tl.full([], 0.0, tl.float32)
    if first != 0:
        pm = tl.load(part_m_ptr + base + j, mask=jm, other=float("-inf"))
        m = tl.max(pm, axis=0)
        if temp == 0:  # the first argmax: the lowest chunk holding the max, its first index
            pmi = tl.load(part_mi_ptr + base + j, mask=jm, other=2147483647)
            token = tl.min(tl.where(pm == m, pmi, 2147483647), axis=0)
            open_ = tl.full([], 0, tl.int32)
            tl.store(out_ptr + row, token.to(tl.int64))
        elif has_top_p != 0:
            pz = tl.load(part_z_ptr + base + j, mask=jm, other=0.0)
            z = tl.sum(tl.where(pm > float("-inf"), pz * tl.exp(pm - m), 0.0), axis=0)
        tl.store(state_ptr + row, m)
        tl.store(state_ptr + n_rows + row, z)
    else:
        open_ = 1 - tl.load(done_ptr + row)
        m = tl.load(state_ptr + row)
        z = tl.load(state_ptr + n_rows + row)
    if open_ != 0:
        token, cs = _row_candidate(cand_v_ptr, cand_i_ptr, cand_s_ptr, base, n_chunks, NC_P2)
        keep = (cs >= m + log_min_p).to(tl.int32)
        if _needs_mass(cs, m, top_p, log_min_p):
            mass = tl.sum(tl.load(part_s_ptr + base + j, mask=jm, other=0.0), axis=0)
            keep = (mass < top_p * z).to(tl.int32)
        if last != 0:
            x_row = x_ptr + row.to(tl.int64) * x_stride
            key = _row_key(seed_ptr, offset_ptr, row)
            lower = tl.maximum(thr_s, m + log_min_p)
            it = tl.full([], 0, tl.int32)
            while (keep == 0) & (it < max_iters):
                floor = cs
                best = tl.full([], float("-inf"), tl.float32)
                top = m + _NOISE_LO  # the row's max is a candidate
                for c in range(0, n_chunks):
                    m_c = tl.load(part_m_ptr + base + c)
                    if (m_c > floor) & (m_c >= lower) & (m_c + _NOISE_HI >= top):
                        cv, ci, top, _, _ = _chunk_candidate(x_row, c * CHUNK, vocab, t, key, thr_s, log_min_p,
                                                             lower, floor, top, m_c, 0, CHUNK, BLOCK, SCALE,
                                                             False)
                        if cv > best:  # strictly: an earlier chunk keeps a tie
                            best = cv
                            token = ci
                cs = _scaled(tl.load(x_row + token).to(tl.float32), t, SCALE)
                keep = tl.full([], 1, tl.int32)
                if _needs_mass(cs, m, top_p, log_min_p):
                    mass = tl.full([], 0.0, tl.float32)
                    for c in range(0, n_chunks):
                        if tl.load(part_m_ptr + base + c) > cs:
                            mass += _chunk_mass_above(x_row, c * CHUNK, vocab, t, cs, thr_s, m, CHUNK, BLOCK,
                                                      SCALE)
                    keep = (mass < top_p * z).to(tl.int32)
                it += 1
            keep = tl.full([], 1, tl.int32)
        if keep != 0:
            tl.store(out_ptr + row, token.to(tl.int64))
            open_ = tl.full([], 0, tl.int32)
        else:
            tl.store(state_ptr + 2 * n_rows + row, cs)
    if first != 0:
        tl.store(done_ptr + row, 1 - open_)
    elif open_ == 0:
        tl.store(done_ptr + row, 1)


def filtered_sample_triton(x: torch.Tensor, temperatures: torch.Tensor, thr: torch.Tensor | None,
                           top_ps: torch.Tensor | None, log_min_ps: torch.Tensor | None, seeds: torch.Tensor,
                           offsets: torch.Tensor, scale: bool = True, rounds: int = 2, chunk: int = 8192,
                           block: int = 1024, max_iters: int = 10_000, poison: bool = False) -> torch.Tensor:
    """Token ids int64 [B] drawn from apply_filters' distribution (greedy rows: first argmax).

    x: fp32, bf16 or fp16 [B, V], unit stride along V. temperatures: fp32 [B], 0 = greedy. With
    `scale` the kernels divide x by the temperature (by 1 on greedy rows), correctly rounded,
    else x is already scaled. thr: fp32 [B] top-k thresholds on x (the k-th largest, -inf = off),
    or None. top_ps: fp32 [B] (1 = off) or None when no row has top-p; log_min_ps: fp32
    [B] = torch.log(min_p) (-inf = off) or None. seeds, offsets: int64 [B]. rounds: chunk-parallel
    rejection rounds after the first candidate (top-p only); chunk, block: powers of two,
    block <= chunk. Fixed launches whatever the data: 3 * (rounds + 1) with top-p, else 2 or 4.
    poison (tests): fill the token ids and the workspace with garbage first, so that a value
    read before it is written shows.
    """
    b, vocab = x.shape
    n_chunks = triton.cdiv(vocab, chunk)
    n = b * n_chunks
    # Every workspace view starts at a multiple of 16 elements: Triton specializes pointers on
    # 16-byte alignment, so offsets that move with the batch size would compile new variants.
    n16, b16 = -(-n // 16) * 16, -(-b // 16) * 16
    fbuf = torch.empty(5 * n16 + 3 * b16, dtype=torch.float32, device=x.device)
    ibuf = torch.empty(2 * n16 + b16, dtype=torch.int32, device=x.device)
    part_m, part_z, cand_v, cand_s, part_s = (fbuf[i * n16:i * n16 + n] for i in range(5))
    state = fbuf[5 * n16:5 * n16 + 3 * b]  # m [B], Z [B], floor [B]
    part_mi, cand_i = (ibuf[i * n16:i * n16 + n] for i in range(2))
    done = ibuf[2 * n16:2 * n16 + b]
    out = torch.empty(b, dtype=torch.int64, device=x.device)
    if poison:
        for buf in (fbuf, ibuf, out):
            buf.fill_(float("nan") if buf.is_floating_point() else -12345)
    has_top_p, has_min_p = top_ps is not None, log_min_ps is not None
    # Without top-p one more round settles every row (its candidates then pass min-p exactly).
    last = rounds if has_top_p else int(has_min_p)
    # Pointers a launch does not read get the temperatures' (fp32 like theirs: the same
    # signature, so the same compiled variant, whichever filters are on).
    ptrs = (temperatures, temperatures if thr is None else thr, temperatures if top_ps is None else top_ps,
            temperatures if log_min_ps is None else log_min_ps)
    # Filters and round as runtime values (_FLAGS): one variant per dtype and `scale` for all.
    flags = (int(thr is not None), int(has_top_p), int(has_min_p))
    for r in range(last + 1):
        rnd = (*flags, int(r == 0), int(r == last))
        _filter_scan_kernel[(b, n_chunks)](
            x, x.stride(0), *ptrs, seeds, offsets, part_m, part_mi, part_z, cand_v, cand_i, cand_s, state, done,
            b, vocab, n_chunks, *rnd, CHUNK=chunk, BLOCK=block, SCALE=scale)
        if has_top_p:
            _filter_mass_kernel[(b, n_chunks)](
                x, x.stride(0), *ptrs, part_m, cand_v, cand_i, cand_s, part_s, state, done, vocab, n_chunks, *rnd,
                CHUNK=chunk, BLOCK=block, NC_P2=triton.next_power_of_2(n_chunks), SCALE=scale)
        _filter_decide_kernel[(b,)](
            x, x.stride(0), *ptrs, seeds, offsets, part_m, part_mi, part_z, cand_v, cand_i, cand_s, part_s,
            state, done, out, b, vocab, n_chunks, max_iters, *rnd, CHUNK=chunk, BLOCK=block,
            NC_P2=triton.next_power_of_2(n_chunks), SCALE=scale)
    return out
