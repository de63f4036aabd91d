"""Runs the model for one scheduled batch on one tensor-parallel rank, and samples.

The runner turns a `ScheduledBatch` into packed input tensors (token ids, positions, KV slot
mapping, block tables), runs the model eagerly or by replaying a captured CUDA graph (decode),
and samples the next token of every sequence on the device. It is device-agnostic: the same
code runs on CPU (torch attention backend) and CUDA (triton / flash_attn backends).

Overlap scheduling: `launch` returns as soon as the step is queued on the device; the sampled
tokens stay in a device buffer (`prev_tokens`), from which the next step takes the input token
of every sequence whose last token the host has not seen yet (StepInput.src_rows), and travel
to the host in the background (`PendingTokens`). The host thus schedules and prepares step n+1
while the GPU runs step n.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import math
import time
from dataclasses import dataclass

import numpy as np

import torch
import torch.distributed as dist

from nanovllm.config import Config
from nanovllm.engine.scheduler import ScheduledBatch
from nanovllm.engine.sequence import Sequence
from nanovllm.layers.attention import Attention, select_backend
from nanovllm.layers.sampler import Sampler, SamplingTensors, pick_candidates
from nanovllm.models.registry import model_class
from nanovllm.sampling_params import is_integer
from nanovllm.utils.context import AttentionMetadata, host_to_device, prefill_metadata
from nanovllm.utils.dist import TPGroup, use_tp_group
from nanovllm.utils.loader import init_dummy, load_model

logger = logging.getLogger("nanovllm")

CPU_KV_CACHE_BYTES = 1 << 30  # automatic KV-cache size on CPU


@contextlib.contextmanager
def preferred_blas(name: str):
    """Make torch's CUDA GEMMs use the BLAS library `name` inside the block, then restore."""
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(name)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def graph_batch_sizes(max_bs: int) -> list[int]:
    """Decode batch sizes to capture: powers of two up to 32, then steps of 32, plus `max_bs`."""
    sizes = [b for b in (1, 2, 4, 8, 16) if b < max_bs] + list(range(32, max_bs, 32))
    return sizes + [max_bs]


class ModelRunner:
    """The model, its KV cache and its CUDA graphs on one tensor-parallel rank.

    `launch(batch)` is one engine step on a single rank; with tensor parallelism every rank calls
    `execute(step)`, then either every rank samples its vocabulary shard (StepInput.sampling)
    or rank 0 samples the gathered logits (see engine/parallel.py).
    """

    def __init__(self, config: Config):
        self.config = config
        hf = config.hf_config
        t0 = time.perf_counter()
        self.device = torch.device("cuda", torch.cuda.current_device()) if config.device == "cuda" \
            else torch.device("cpu")
        self.dtype = config.dtype
        self.block_size = config.kvcache_block_size
        self.world_size = config.tensor_parallel_size
        self.rank = dist.get_rank() if self.world_size > 1 else 0
        group = dist.group.WORLD if self.world_size > 1 else None
        fused_norm = copy_engine = None
        if self.world_size > 1 and self.device.type == "cuda" and config.custom_all_reduce:
            from nanovllm.utils.dist import CopyEngineAllReduce, FusedAllReduceNorm

            fused_norm = FusedAllReduceNorm.create(group, self.device, config.dtype, hf.hidden_size)
            if fused_norm is not None:  # it owns the group's symmetric-memory rendezvous
                # Up to 128 MiB per buffer half (16k rows of Qwen3-8B); longer prefill steps use NCCL.
                max_rows = min(config.max_num_batched_tokens, (128 << 20) // (hf.hidden_size * config.dtype.itemsize))
                copy_engine = CopyEngineAllReduce.create(group, self.device, config.dtype, hf.hidden_size, max_rows)
        self.tp = TPGroup(self.rank, self.world_size, group, fused_norm, copy_engine)
        self.pin = self.device.type == "cuda"
        self.max_blocks_per_seq = math.ceil(config.max_model_len / self.block_size)

        # Build the parameters directly in the target dtype on the device (no fp32 copy first).
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device), use_tp_group(self.tp):
                self.model = model_class(hf)(hf, max_positions=config.max_model_len)
        finally:
            torch.set_default_dtype(default_dtype)
        if config.load_format == "dummy":
            init_dummy(self.model, config.seed)
        else:
            load_model(self.model, config.model)
        t_weights = time.perf_counter()
        self.backend = select_backend(config.device, self.block_size, config.attention_backend)
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        for layer in self.attn_layers:
            layer.backend = self.backend
        self.sampler = Sampler()
        self._splits: dict[tuple[int, int], int] = {}
        self.num_kv_heads = self.attn_layers[0].num_kv_heads
        self.head_dim = self.attn_layers[0].head_dim

        self.kv_cache = None
        self.num_blocks = self._allocate_kv_cache()
        t_kv = time.perf_counter()
        max_rows = max(config.max_num_seqs, 1)
        self.decode_buffers = DecodeBuffers(max_rows, self.max_blocks_per_seq, self.block_size, self.device, self.pin)
        # The last step's sampled tokens, one row per scheduled sequence, kept on the device for
        # the next step's inputs; two pinned host copies alternate so that reading step n's
        # tokens never races with step n+1 writing its own.
        self.prev_tokens = torch.zeros(max_rows, dtype=torch.int32, device=self.device)
        self._host_tokens = [torch.zeros(max_rows, dtype=torch.int32, pin_memory=self.pin) for _ in range(2)]
        self._token_events = [torch.cuda.Event() if self.pin else None for _ in range(2)]
        self._flip = 0
        self._sampling_cache = None  # (key, SamplingTensors) of the last step, see _sampling_tensors
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.decode_blas = config.decode_blas
        # The torch backend loops over sequences on the host: nothing a graph could replay.
        if self.device.type == "cuda" and not config.enforce_eager and self.backend.name != "torch":
            self._capture_cuda_graphs()
        # Where the cold start goes (bench.py reports it).
        self.startup_seconds = {"model": round(t_weights - t0, 2), "kv_cache": round(t_kv - t_weights, 2),
                                "cuda_graphs": round(time.perf_counter() - t_kv, 2)}
        logger.info("model runner ready: %s seconds", self.startup_seconds)

    # ------------------------------------------------------------------ KV cache
    def kv_bytes_per_block(self) -> int:
        layers = len(self.attn_layers)
        return 2 * layers * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def _allocate_kv_cache(self) -> int:
        cfg = self.config
        per_block = self.kv_bytes_per_block()
        if cfg.num_kvcache_blocks > 0:
            num_blocks = cfg.num_kvcache_blocks
        elif self.device.type == "cpu":
            num_blocks = max(CPU_KV_CACHE_BYTES // per_block, self.max_blocks_per_seq)
        else:
            num_blocks = self._blocks_from_gpu_budget(per_block)
        if self.world_size > 1:
            # Every rank must hold the same blocks: agree on the smallest cache.
            agreed = torch.tensor([num_blocks], dtype=torch.int64, device=self.device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.tp.group)
            num_blocks = int(agreed.item())
        if num_blocks < 1:
            raise RuntimeError("no GPU memory left for the KV cache: lower max_num_batched_tokens or "
                               "raise gpu_memory_utilization")
        self.kv_cache = torch.empty(2, len(self.attn_layers), num_blocks, self.block_size, self.num_kv_heads,
                                    self.head_dim, dtype=self.dtype, device=self.device)
        for i, layer in enumerate(self.attn_layers):
            layer.k_cache = self.kv_cache[0, i]
            layer.v_cache = self.kv_cache[1, i]
        logger.info("KV cache: %d blocks x %d tokens (%.2f GiB)", num_blocks, self.block_size,
                    num_blocks * per_block / 2**30)
        return num_blocks

    def _blocks_from_gpu_budget(self, per_block: int) -> int:
        """KV blocks that fit in gpu_memory_utilization of the GPU, counting only our own use.

        Our use = weights + the activation peak of a warm-up prefill at max_num_batched_tokens
        + the peak of the largest decode batch: its forward (what the CUDA-graph pool holds),
        its logits, and room for sampling with a full-vocabulary sort (top-p, the worst case).
        Other processes' memory is not charged to us, but we never take more than is free.
        """
        cfg = self.config
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        self._warmup(min(cfg.max_num_batched_tokens, cfg.max_num_seqs * cfg.max_model_len), cfg.max_model_len)
        prefill_peak = torch.cuda.max_memory_allocated() - base
        torch.cuda.reset_peak_memory_stats()
        self._warmup(cfg.max_num_seqs, 1)
        # Sampling is not run here (that would compile its kernels inside the cold start): its
        # worst case, a full-vocabulary sort for top-p, holds about fp32 logits + sorted values +
        # int64 indices + a cumulative sum per row, ~24 bytes per logit (2.7 GB measured at 512 rows).
        sampler_peak = cfg.max_num_seqs * cfg.hf_config.vocab_size * 24 if self.rank == 0 else 0
        decode_peak = torch.cuda.max_memory_allocated() - base + sampler_peak
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        # The all-reduce paths' symmetric memory comes from its own allocator, outside these counts.
        held = base + self.tp.symmetric_memory_bytes()
        budget = total * self.config.gpu_memory_utilization - held - prefill_peak - decode_peak
        headroom = free - prefill_peak - decode_peak - (256 << 20)
        return int(min(budget, headroom) // per_block)

    @torch.inference_mode()
    def _warmup(self, num_tokens: int, seq_len: int) -> None:
        """One eager forward over `num_tokens` tokens in sequences of `seq_len`, without a KV
        cache, plus logits of each sequence's last token, to measure memory."""
        num_tokens = max(1, num_tokens)
        seq_len = min(num_tokens, seq_len)
        lens = [seq_len] * (num_tokens // seq_len) + ([num_tokens % seq_len] if num_tokens % seq_len else [])
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        pos = torch.cat([torch.arange(n, device=self.device) for n in lens])
        meta = prefill_metadata(lens, lens, torch.full((num_tokens,), -1, dtype=torch.int32), None, self.device)
        hidden = self.model(ids, pos, meta)
        last = torch.tensor(lens, device=self.device).cumsum(0) - 1
        self.model.compute_logits(hidden[last])

    # ------------------------------------------------------------------ inputs
    def _to_device(self, data, dtype) -> torch.Tensor:
        # A list or numpy array, through pinned memory: from pageable memory a host-to-device
        # copy waits for the GPU to drain its queue, which would undo overlap scheduling.
        return host_to_device(data, dtype, self.device, self.pin)

    def prepare_prefill(self, step: "StepInput"):
        """Packed prefill inputs: token ids, positions, metadata, and each sequence's last row."""
        bs = self.block_size
        q_lens = np.fromiter(map(len, step.token_ids), dtype=np.int64, count=len(step.token_ids))
        starts = np.asarray(step.start_pos, dtype=np.int64)
        k_lens = starts + q_lens
        cu_q = np.cumsum(q_lens)
        # Position of every packed token, and the block-table row it belongs to, without a
        # Python loop over tokens (a prefill step can hold 16k of them).
        seq_idx = np.repeat(np.arange(len(q_lens)), q_lens)
        positions = np.arange(int(cu_q[-1])) - np.repeat(cu_q - q_lens - starts, q_lens)
        width = max(map(len, step.block_tables))
        tables = np.full((len(q_lens), width), -1, dtype=np.int64)
        for i, row in enumerate(step.block_tables):
            tables[i, :len(row)] = row
        slots = tables[seq_idx, positions // bs] * bs + positions % bs
        q_list, k_list = q_lens.tolist(), k_lens.tolist()
        has_prefix = k_list != q_list
        table_tensor = self._to_device(tables, torch.int32) if has_prefix else None
        slot_mapping = self._to_device(slots, torch.int32)
        meta = prefill_metadata(q_list, k_list, slot_mapping, table_tensor, self.device, self.pin)
        ids = self._to_device(list(itertools.chain.from_iterable(step.token_ids)), torch.long)
        return ids, self._to_device(positions, torch.long), meta, self._to_device(cu_q - 1, torch.long)

    def prepare_decode(self, step: "StepInput", padded_bs: int):
        """Decode inputs padded to `padded_bs` rows (a captured graph's batch size), as views of the
        runner's decode buffers (the very tensors the CUDA graphs were captured with)."""
        ids, pos, slots, ctx, src, tables = self.decode_buffers.load(step, padded_bs)
        ids = self._decode_ids(ids, src)
        kv_lens = None
        if self.backend.name == "torch":
            kv_lens = [p + 1 for p in step.start_pos] + [0] * (padded_bs - len(step.start_pos))
        meta = AttentionMetadata(
            is_prefill=False, slot_mapping=slots, context_lens=ctx, block_tables=tables,
            query_lens=kv_lens and [min(k, 1) for k in kv_lens], kv_lens=kv_lens,
            num_splits=self._num_splits(padded_bs, tables.size(1)))
        return ids, pos, meta

    def _decode_ids(self, ids: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """Input token per row: the host's, or (src >= 0) the previous step's sampled token that
        is still on the device. Part of the captured decode graph, so it costs no launches."""
        return torch.where(src >= 0, self.prev_tokens.index_select(0, src.clamp(min=0)), ids)

    def _num_splits(self, batch_size: int, width: int) -> int:
        """KV splits of the Triton decode kernel for this batch shape (fixed per captured graph)."""
        if self.backend.name != "triton":
            return 1
        key = (batch_size, width)
        if key not in self._splits:
            from nanovllm.kernels.paged_decode import choose_num_splits

            sms = torch.cuda.get_device_properties(self.device).multi_processor_count
            self._splits[key] = choose_num_splits(batch_size, self.num_kv_heads, width, num_sms=sms)
        return self._splits[key]

    def prepare_sampling(self, seqs: list[Sequence], eos_token_ids: frozenset[int]):
        """Sampling tensors for `seqs` (+ the min_tokens suppression pairs)."""
        offsets = [len(s) for s in seqs]
        t = self._sampling_tensors([s.seq_id for s in seqs], offsets, lambda: SamplingTensors.build(
            [s.params for s in seqs], [s.seed for s in seqs], offsets, self.device, pin_memory=self.pin))
        rows, cols = [], []
        for i, s in enumerate(seqs):
            banned = suppressed_tokens(s, eos_token_ids)
            rows.extend([i] * len(banned))
            cols.extend(banned)
        suppress = (self._to_device(rows, torch.long), self._to_device(cols, torch.long)) if rows else None
        return t, suppress

    def _sampling_tensors(self, key, offsets: list[int], build) -> SamplingTensors:
        """`build()`, or the last step's tensors with new offsets when `key` (what fixes the
        per-row parameters) is unchanged: consecutive decode steps usually sample the same rows
        with the same parameters, and then only the offsets (sequence lengths) change."""
        cached = self._sampling_cache
        if cached is not None and cached[0] == key:
            t = dataclasses.replace(cached[1], offsets=self._to_device(offsets, torch.long))
        else:
            t = build()
        self._sampling_cache = (key, t)
        return t

    # ------------------------------------------------------------------ execution
    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, eos_token_ids: frozenset[int] = frozenset()) -> "PendingTokens":
        """Queue one step and its sampling on the device; the tokens arrive via the result."""
        return self.sample(self.execute(StepInput.from_batch(batch)), batch.seqs, eos_token_ids)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: frozenset[int],
               check=None) -> "PendingTokens":
        """The next token of each sequence from its logits row (rank 0 only), left in
        `prev_tokens` for the next step and copied to the host without blocking."""
        t, suppress = self.prepare_sampling(seqs, eos_token_ids)
        n = len(seqs)
        self.prev_tokens[:n].copy_(self.sampler(logits, t, suppress))
        return self.publish_tokens(n, check)

    def publish_tokens(self, n: int, check=None) -> "PendingTokens":
        """Start copying the step's sampled tokens (`prev_tokens[:n]`) to the host (`check`:
        see PendingTokens)."""
        self._flip ^= 1
        host, event = self._host_tokens[self._flip], self._token_events[self._flip]
        host[:n].copy_(self.prev_tokens[:n], non_blocking=self.pin)
        if event is not None:
            event.record()
        return PendingTokens(host, n, event, check)

    @torch.inference_mode()
    def execute(self, step: "StepInput") -> torch.Tensor | None:
        """The model part of a step, which every tensor-parallel rank runs: logits of each
        sequence's last new token (rank 0) or None (other ranks); with `step.sampling`, the
        sampled tokens instead (every rank, also left in `prev_tokens`)."""
        n = len(step.token_ids)
        if step.src_rows is not None and self.world_size > 1 and step.sync_prev:
            # Only rank 0 sampled the previous step: hand its tokens to every rank, on the device.
            dist.broadcast(self.prev_tokens, src=0, group=self.tp.group)
        if step.is_prefill:
            if step.src_rows is not None:
                raise RuntimeError("internal error: a prefill step got a token that is still on the device")
            ids, pos, meta, last = self.prepare_prefill(step)
            hidden = self.model(ids, pos, meta)[last]
        else:
            graph_bs = next((b for b in self.graph_sizes if b >= n), None) if self.graphs else None
            if graph_bs is None:
                ids, pos, meta = self.prepare_decode(step, n)
                hidden = self.model(ids, pos, meta)
            else:
                hidden = self._replay(step, graph_bs)[:n]
        if step.sampling is not None:
            return self._sample_on_every_rank(hidden, step.sampling)
        return self.model.compute_logits(hidden)

    def _sample_on_every_rank(self, hidden: torch.Tensor, rows: "RowSampling") -> torch.Tensor:
        """Tensor parallelism, rows without top-k/top-p/min-p or suppressed tokens: each rank
        offers its vocabulary shard's best candidate per row and every rank picks the same
        tokens from all candidates. Sends two numbers per row and rank instead of gathering
        [rows, vocab] logits on rank 0 (39 MB per decode step of Qwen3 at batch 256), and the
        next step needs no broadcast of the tokens."""
        key = ("rows", rows.temperatures, rows.seeds)  # never equal to prepare_sampling's id list
        t = self._sampling_tensors(key, rows.offsets, lambda: SamplingTensors.temperature_only(
            rows.temperatures, rows.seeds, rows.offsets, self.device, self.pin))
        logits, first_id = self.model.compute_logit_shard(hidden)
        scores, ids = self.sampler.candidates(logits, t, first_id)
        # One collective for both: float64 holds the fp32 scores and the token ids exactly.
        every = self.tp.all_gather(torch.stack([scores.double(), ids.double()]))  # [ranks, 2, rows]
        tokens = pick_candidates(every[:, 0], every[:, 1].long())
        self.prev_tokens[:len(tokens)].copy_(tokens)
        return tokens

    def shutdown(self, synchronize: bool = True) -> None:
        """Release the KV cache, graphs and weights (GPU memory goes back to the allocator).
        synchronize=False when a kernel may never finish (a TP peer died and NCCL's abort hung):
        then the memory stays cached rather than wait for the device."""
        self.graphs.clear()
        self.graph_hidden = None
        for layer in self.attn_layers:
            layer.k_cache = layer.v_cache = torch.tensor([])
        self.kv_cache = None
        self.model = None
        if self.device.type == "cuda" and synchronize:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    @torch.inference_mode()
    def check_score_input(self, token_ids: list[int]) -> None:
        """score()'s input checks, on the caller's rank before any rank starts (a worker that
        raised would take the whole tensor-parallel group down)."""
        n = len(token_ids)
        if not 0 < n <= self.config.max_model_len:
            raise ValueError(f"score() needs 1 to max_model_len={self.config.max_model_len} tokens, got {n}")
        vocab = self.config.hf_config.vocab_size
        if not all(is_integer(t) and 0 <= t < vocab for t in token_ids):
            raise ValueError(f"score() needs token ids in [0, {vocab})")

    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Teacher-forced logits [len(token_ids), vocab] (fp32; None on ranks other than 0) of one
        sequence, without touching the KV cache. Used to check the model against a reference."""
        self.check_score_input(token_ids)
        n = len(token_ids)
        meta = prefill_metadata([n], [n], torch.full((n,), -1, dtype=torch.int32), None, self.device)
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        hidden = self.model(ids, torch.arange(n, device=self.device), meta)
        logits = self.model.compute_logits(hidden)
        return None if logits is None else logits.float()

    # ------------------------------------------------------------------ CUDA graphs
    @torch.inference_mode()
    def _capture_cuda_graphs(self) -> None:
        """Capture decode for fixed batch sizes; a step replays the smallest that fits."""
        max_bs = min(self.config.max_num_seqs, 512)
        self.graph_sizes = graph_batch_sizes(max_bs)
        width = self.max_blocks_per_seq
        dev = self.device
        self.graph_hidden = torch.zeros(max_bs, self.config.hf_config.hidden_size, dtype=self.dtype, device=dev)
        buffers = self.decode_buffers
        with preferred_blas(self.decode_blas):
            self._capture_each(buffers, width)
        logger.info("captured CUDA graphs for decode batch sizes %s (%s)", self.graph_sizes, self.decode_blas)

    def _capture_each(self, buffers: "DecodeBuffers", width: int) -> None:
        """One graph per size in self.graph_sizes, all sharing one memory pool."""
        pool = None
        for bs in reversed(self.graph_sizes):  # largest first, so smaller graphs reuse its pool
            ids, pos, slots, ctx, src, tables = buffers.views(bs)
            meta = AttentionMetadata(is_prefill=False, slot_mapping=slots, context_lens=ctx, block_tables=tables,
                                     num_splits=self._num_splits(bs, width))
            # Any valid context works for capture: one token in block 0 (slot -1: nothing stored).
            slots.fill_(-1)
            ctx.fill_(1)
            src.fill_(-1)
            tables.fill_(0)
            self.model(self._decode_ids(ids, src), pos, meta)  # warm-up outside the graph (Triton compiles, cuBLAS plans)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                self.graph_hidden[:bs] = self.model(self._decode_ids(ids, src), pos, meta)
            pool = graph.pool() if pool is None else pool
            self.graphs[bs] = graph
            torch.cuda.synchronize()

    def _replay(self, step: "StepInput", bs: int) -> torch.Tensor:
        self.decode_buffers.load(step, bs)  # writes straight into the graph's input tensors
        self.graphs[bs].replay()
        return self.graph_hidden[:bs]


class DecodeBuffers:
    """All decode inputs of up to `max_bs` sequences in one flat int32 buffer, pinned on the host
    and mirrored on the device, so a decode step costs two small host-to-device copies.

    Layout: token ids | positions | slot mapping | context lens | source rows | block tables
    [max_bs, width]. Each field's first `bs` rows are contiguous, so CUDA graphs captured on
    `views(bs)` read the current step's inputs in place. Source row i >= 0 means: take row i's
    token from the previous step's sampled tokens on the device (see ModelRunner._decode_ids).
    """

    NUM_ROW_FIELDS = 5

    def __init__(self, max_bs: int, width: int, block_size: int, device, pin: bool):
        self.max_bs, self.width, self.block_size = max_bs, width, block_size
        size = max_bs * (self.NUM_ROW_FIELDS + width)
        self.host = torch.zeros(size, dtype=torch.int32, pin_memory=pin)
        self.device = torch.zeros(size, dtype=torch.int32, device=device)
        self._host_fields = self._split(self.host.numpy())
        self._device_fields = self._split(self.device)
        self._small = self.NUM_ROW_FIELDS * max_bs  # the per-sequence fields, copied whole (a few KiB)
        self._copied = torch.cuda.Event() if pin else None

    def _split(self, flat):
        m, k = self.max_bs, self.NUM_ROW_FIELDS
        return tuple(flat[i * m:(i + 1) * m] for i in range(k)) + (flat[k * m:].reshape(m, self.width),)

    def views(self, bs: int):
        """(ids, positions, slots, context_lens, src_rows, block_tables) device views for `bs` rows."""
        return tuple(f[:bs] for f in self._device_fields)

    def load(self, step: "StepInput", bs: int):
        """Fill the first `bs` rows from `step` (rows past its sequences are padding: slot -1,
        context 0) and copy them to the device; returns `views(bs)`."""
        n = len(step.token_ids)
        if bs > self.max_bs or n > bs:
            raise ValueError(f"decode batch of {n} (padded {bs}) exceeds the buffers' {self.max_bs} rows")
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy must be done before we overwrite
        ids, pos, slots, ctx, src, tables = self._host_fields
        ids[:n] = [t[0] for t in step.token_ids]
        pos[:n] = step.start_pos
        src[:n] = -1 if step.src_rows is None else step.src_rows
        # Block tables as one fancy-indexed write instead of a Python loop over rows.
        lens = np.fromiter(map(len, step.block_tables), dtype=np.int64, count=n)
        flat = np.fromiter(itertools.chain.from_iterable(step.block_tables), dtype=np.int32, count=int(lens.sum()))
        rows = np.repeat(np.arange(n), lens)
        cols = np.arange(len(flat)) - np.repeat(np.cumsum(lens) - lens, lens)
        tables[:bs] = -1
        tables[rows, cols] = flat
        p = pos[:n]
        slots[:n] = tables[np.arange(n), p // self.block_size] * self.block_size + p % self.block_size
        ctx[:n] = p + 1
        ids[n:bs] = 0
        pos[n:bs] = 0
        slots[n:bs] = -1
        ctx[n:bs] = 0
        src[n:bs] = -1
        # Two copies: the small fields, and only the block-table rows in use (the full table can
        # be megabytes with small blocks and a long max_model_len).
        end = self._small + bs * self.width
        self.device[:self._small].copy_(self.host[:self._small], non_blocking=True)
        self.device[self._small:end].copy_(self.host[self._small:end], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        return self.views(bs)


class PendingTokens:
    """Sampled tokens on their way to the host; `result()` waits for them (and only for them).

    check: with tensor parallelism, raises once a peer died; then the wait polls the event and
    calls it meanwhile and after, since a dead peer's collectives may never finish, or finish
    (aborted) with garbage in the tokens."""

    def __init__(self, host: torch.Tensor, n: int, event, check=None):
        self._host, self._n, self._event, self._check = host, n, event, check

    def result(self) -> list[int]:
        if self._event is not None:
            if self._check is None:
                self._event.synchronize()
            else:
                while not self._event.query():
                    self._check()
                    time.sleep(0)  # lets the watchdog thread run
        if self._check is not None:
            self._check()
        return self._host[:self._n].tolist()


@dataclass
class StepInput:
    """What every tensor-parallel rank needs to run one step: plain lists, cheap to pickle.

    token_ids[i]: the new tokens of sequence i (decode: just its last token); start_pos[i]: how
    many of its tokens are already in the KV cache; block_tables[i]: its KV blocks; src_rows
    (decode only, None when all tokens are known): for each sequence, the row of the previous
    step's sampled tokens that holds its input token, or -1 to use token_ids.
    """

    is_prefill: bool
    token_ids: list[list[int]]
    start_pos: list[int]
    block_tables: list[list[int]]
    src_rows: list[int] | None = None
    sampling: "RowSampling | None" = None  # sample on every rank (tensor parallelism)
    sync_prev: bool = True  # src_rows' tokens are on rank 0 only: broadcast them first

    @classmethod
    def from_batch(cls, batch: ScheduledBatch) -> "StepInput":
        seqs = batch.seqs
        src = None
        if batch.is_prefill:
            tokens = [s.token_ids[s.num_cached_tokens:s.num_cached_tokens + n]
                      for s, n in zip(seqs, batch.num_new_tokens)]
        else:
            tokens = [[s.token_ids[-1]] for s in seqs]
        if any(s.pending_row >= 0 for s in seqs):
            src = [s.pending_row for s in seqs]
        return cls(batch.is_prefill, tokens, [s.num_cached_tokens for s in seqs],
                   [s.block_table for s in seqs], src)


@dataclass
class RowSampling:
    """What every tensor-parallel rank needs to sample its vocabulary shard, for rows whose
    filters are off (sampler.filters_off) and that suppress nothing: per-row temperature, seed
    and offset, as rank 0's prepare_sampling would use them."""

    temperatures: list[float]
    seeds: list[int]
    offsets: list[int]

    @classmethod
    def from_seqs(cls, seqs: list[Sequence]) -> "RowSampling":
        return cls([float(s.params.temperature) for s in seqs], [s.seed for s in seqs], [len(s) for s in seqs])


def suppressed_tokens(seq: Sequence, eos_token_ids: frozenset[int]) -> set[int]:
    """Tokens `seq` may not sample yet (before min_tokens): its stop ids and, unless it
    ignores EOS, the EOS tokens."""
    if seq.num_completion_tokens >= seq.params.min_tokens:
        return set()
    return set(seq.params.stop_ids) | (set() if seq.params.ignore_eos else set(eos_token_ids))
