"""What LLM's calls need only at times (loaded through wiring.py, so a plain generate without a
progress bar loads none of it): the progress bar, and the clean-up of a call cut short."""

from __future__ import annotations

import time

from nanovllm.core.interrupts import deferred_interrupts


def progress_bar(use_tqdm, total: int):
    """The generate() progress bar over `total` completions, or None without one."""
    if not use_tqdm:
        return None
    if not callable(use_tqdm):  # as in vLLM, it may be a callable that makes the bar (tqdm's keywords)
        from tqdm.auto import tqdm as use_tqdm
    return use_tqdm(total=total, desc="Generating", dynamic_ncols=True)


def run_with_progress_bar(llm, total: int, use_tqdm) -> None:
    """Step `llm` until every request has ended, the bar showing prefill and decode tok/s."""
    bar = progress_bar(use_tqdm, total)
    try:
        prefill_tps = decode_tps = 0.0
        while llm.has_unfinished():
            t = time.perf_counter()
            outputs, num_tokens, is_prefill = llm.step()
            dt = max(time.perf_counter() - t, 1e-9)
            if is_prefill:
                prefill_tps = num_tokens / dt
            else:
                decode_tps = num_tokens / dt
            bar.set_postfix(prefill=f"{prefill_tps:.0f}tok/s", decode=f"{decode_tps:.0f}tok/s")
            bar.update(sum(o.finished for o in outputs))
    finally:
        bar.close()


def release_call(llm, seqs) -> None:
    """A generate / stream ended early: abort its unfinished requests, the launched step and
    every request's text state (nobody will read it). A second Ctrl-C waits until this is done."""
    with deferred_interrupts():
        for seq in seqs:
            for sample in seq.samples:
                llm.abort(sample)
        llm.cancel_in_flight()
        for seq in seqs:
            for sample in seq.samples:
                llm.forget_text(sample)
            llm.request_metrics(seq)  # (statistics on: drop its times)
        llm._call_seqs = []
