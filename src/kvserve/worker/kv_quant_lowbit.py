"""2- and 4-bit KV cache (``kv_cache_dtype="int4"`` / ``"int2"``), following KIVI.

Source: Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache"
(ICML 2024; github.com/jy-yuan/KIVI). Asymmetric min/max quantization with ``b`` bits
(``qmax = 2^b - 1``): ``scale = (max - min) / qmax``, ``code = round((x - zero) / scale)`` in
``[0, qmax]``, ``x̂ = code · scale + zero``. **Keys are quantized per channel**, each channel's
scale and zero taken over a group of tokens (key outliers sit in fixed channels), **values per
token**, each token's scale and zero taken over a group of :data:`V_GROUP` channels. The most
recent tokens (KIVI's residual) stay in the model dtype until their group fills.

Here a key group is one KV block (``block_size`` tokens, 16 by default):

* A **full block** of one layer's K pool holds, per KV head, the ``block_size × head_dim`` codes
  packed ``8 / b`` to a byte along the channels (channel ``2i`` in the low nibble for int4; channel
  ``4i + j`` at bits ``2j`` for int2), then ``head_dim`` float16 scales and ``head_dim`` float16
  zeros (one per channel, over the block's tokens). A V block holds the same codes, then
  ``block_size × ceil(head_dim / V_GROUP)`` float16 scales and as many zeros (one per token and
  channel group; the last group is smaller when ``V_GROUP`` does not divide ``head_dim``).
  Layout of a pool: :class:`LowBitPool` (``data`` uint8 ``[num_blocks, num_kv_heads,
  block_bytes]``).
* A block that is **not full** (a sequence's last block) is held in a *residual slot*: a
  model-dtype side buffer ``[R, block_size, num_kv_heads, head_dim]`` per layer and K/V. The KV
  manager (:class:`kvserve.core.kv_cache_manager.ResidualSlots`) gives a residual slot to every
  block that is partly written after a step and takes it back after the step that fills the
  block; the map ``block id → residual slot`` (``-1``: none) is shared with the workers. The step
  that fills a block quantizes it from its ``block_size`` model-dtype rows (the residual's rows
  and the step's new ones), so a token's stored K/V never depend on how the block was filled
  (prefill chunks or decode steps, batch composition); in that step and after, readers see the
  block dequantized (:func:`read_map`), as later steps will.
* What a query sees is what it would see decoded alone: the blocks before its own dequantized, its
  own block's rows in the model dtype, unless it is the block's last slot (the step computing it
  fills the block: then dequantized). Decode rows get this from :func:`read_map`; a prefill chunk,
  whose queries span several blocks, gets it from a per-query mask over both copies of its blocks
  (:func:`kvserve.worker.attention.prefill_lowbit`; on the CPU backend in bf16, per-query key
  ranges over the two copies, :func:`kvserve.kernels.cpu_ops.prefill_ranges`). So a request's tokens are the same alone or
  batched, in one prefill chunk or many, and after a preemption (recompute).
* KV compaction (:mod:`kvserve.worker.kv_compressor`, StreamingLLM / SnapKV / H2O): each kept
  token's K/V is read as a query read it (its full block dequantized, a partial block's rows
  from the residual slot: :func:`gather_heads`), the kept rows become KV indices ``0 .. k - 1``,
  every new full block is quantized again from its ``block_size`` rows and a partial last block's
  rows go into its residual slot (:func:`store_compacted`). That depends only on the request's
  own tokens and selection, so it is the same alone or batched and under any chunking.
* Speculative decoding: a verification step writes the K/V of the request's last token and its
  ``k`` drafts, and may fill blocks with rows of drafts that are then rejected. Every block it
  writes holds a residual slot through the step (:meth:`kvserve.core.kv_cache_manager.KVCacheManager.
  allocate_slots`), so the step both quantizes the blocks it fills and keeps their model-dtype rows;
  once the accepted count is known (:meth:`~kvserve.core.kv_cache_manager.KVCacheManager.end_verification`)
  a block full of accepted tokens is sealed (its slot unmapped: its codes were computed from exactly
  the rows decoding would have written), the block of the first rejected draft keeps its slot and
  its accepted rows (the codes the step wrote into it are never read, and the step that fills it
  with accepted tokens quantizes it again), later blocks release theirs. What the verification's
  queries see is what one-token decoding of the accepted prefix would have shown them: a
  verification that fills a block it has earlier rows in runs as a masked chunk
  (:func:`kvserve.worker.attention.prefill_lowbit`), the others as decode rows (:func:`read_map`
  is then right for every row).
* Block copies (:func:`copy_prefix`: a fork's or a beam's copy of a partial block) copy model-dtype
  rows from the source's residual slot into the destination's. The prefix cache shares full
  (quantized) blocks only: a partially matching cached block is not copied (its rows would come back
  dequantized, not as the model-dtype rows a cold run holds), so a hit gives exactly a cold run's tokens.

Error bound (tested in ``tests/worker/test_kv_quant_lowbit.py``): the zero is the group's
minimum rounded *down* to float16 and the scale ``(max - zero) / qmax`` rounded *up* to float16,
so every value of the group lies in ``[zero, zero + qmax · scale]`` and
``|x - x̂| ≤ scale / 2`` per value (plus float32 rounding of ``code · scale + zero`` and the final
rounding of ``x̂`` to the model dtype), with ``scale ≤ (max - min) / qmax · (1 + 2^-10)`` up to
float16's subnormal step. A constant group gets scale 1 (codes 0, ``x̂ = zero``). Values must be
finite and within float16's range (``|x| < 65504``); K/V activations are far below it.

On the CPU (float32 or bfloat16) blocks are quantized and dequantized in C
(:func:`kvserve.kernels.cpu_ops.lowbit_quantize`, :func:`~kvserve.kernels.cpu_ops.lowbit_dequantize`:
the bytes of :func:`quantize_blocks` and the values of :func:`dequantize_blocks` bit for bit);
those two functions are the reference, and what runs elsewhere.

Bytes per token and KV head (``block_size`` 16, ``head_dim`` 64): int4 K 32 + 16, V 32 + 8 = 88
(bf16: 256, ~2.9x); int2 K 16 + 16, V 16 + 8 = 56 (~4.6x); plus the residual slots
(:func:`residual_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from kvserve.kernels import cpu_ops

#: ``kv_cache_dtype`` values of this module and their bits.
BITS = {"int4": 4, "int2": 2}
#: Marker dtypes of the pools' formats (``KVCacheSpec.dtype``, the engine's ``kv_cache_dtype``).
STORAGE = {"int4": torch.uint4, "int2": torch.uint2}
#: Channels per value group (KIVI's group size 32).
V_GROUP = 32
#: Bytes of a float16 scale or zero.
PARAM_BYTES = 2


def is_lowbit(dtype) -> bool:
    """Whether a storage dtype (or a :class:`LowBitPool`) is a 2-/4-bit format."""
    if isinstance(dtype, LowBitPool):
        return True
    return dtype in (torch.uint4, torch.uint2)


def bits_of(dtype: torch.dtype) -> int:
    """4 for ``torch.uint4``, 2 for ``torch.uint2``."""
    return 4 if dtype == torch.uint4 else 2


def num_groups(head_dim: int) -> int:
    """Value groups per token: ``ceil(head_dim / V_GROUP)``."""
    return -(-head_dim // V_GROUP)


def code_bytes(block_size: int, head_dim: int, bits: int) -> int:
    """Bytes of one block's codes of one KV head."""
    return block_size * head_dim * bits // 8


def block_bytes(block_size: int, head_dim: int, bits: int, is_key: bool) -> int:
    """Bytes of one block of one KV head in a K (``is_key``) or V pool: codes, then the float16
    scales, then the float16 zeros."""
    params = head_dim if is_key else block_size * num_groups(head_dim)
    return code_bytes(block_size, head_dim, bits) + 2 * PARAM_BYTES * params


def bytes_per_head_token(head_dim: int, block_size: int, bits: int) -> float:
    """Bytes per token and KV head for K and V together (parameters included), averaged over a block."""
    return (block_bytes(block_size, head_dim, bits, True) + block_bytes(block_size, head_dim, bits, False)) / block_size


def check_head_dim(head_dim: int, kv_cache_dtype: str) -> None:
    """int2 packs 4 channels to a byte: ``head_dim`` must be a multiple of 4.

    Raises:
        ValueError: naming ``kv_cache_dtype`` and the model's ``head_dim``.
    """
    if head_dim % 4:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} needs a head_dim divisible by 4, the model's is "
                         f"{head_dim}; use kv_cache_dtype='auto'")


# ---------------------------------------------------------------------------- packing
def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``[..., n]`` codes (uint8, each ``< 2^bits``; ``n`` a multiple of ``8 / bits``) into
    ``[..., n · bits / 8]`` uint8, ``8 / bits`` consecutive codes to a byte, the first lowest."""
    per = 8 // bits
    c = codes.to(torch.uint8).view(*codes.shape[:-1], codes.shape[-1] // per, per)
    out = c[..., 0].clone()
    for j in range(1, per):
        out |= c[..., j] << (bits * j)
    return out


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`: ``[..., m]`` uint8 → ``[..., m · 8 / bits]`` uint8 codes."""
    per = 8 // bits
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).view(*packed.shape[:-1], packed.shape[-1] * per)


# ---------------------------------------------------------------------------- parameters
def qparams(mn: torch.Tensor, mx: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, zero)`` float16 of groups with float32 minimum ``mn`` and maximum ``mx``: zero =
    ``mn`` rounded down to float16, scale = ``(mx - zero) / qmax`` rounded up to float16 (so that
    ``zero + qmax · scale ≥ mx``); a group whose range is 0 gets scale 1."""
    qmax = float((1 << bits) - 1)
    z = mn.to(torch.float16)
    z = torch.where(z.float() > mn, torch.nextafter(z, torch.full_like(z, float("-inf"))), z)
    rng = mx - z.float()
    s = (rng / qmax).to(torch.float16)
    s = torch.where(s.float() * qmax < rng, torch.nextafter(s, torch.full_like(s, float("inf"))), s)
    s = torch.where(rng > 0, s, torch.ones_like(s))
    return s, z


def _codes(x: torch.Tensor, s: torch.Tensor, z: torch.Tensor, bits: int) -> torch.Tensor:
    """``clamp(round_half_even((x - z) / s), 0, qmax)`` in float32 → uint8."""
    return torch.round((x - z.float()) / s.float()).clamp_(0, (1 << bits) - 1).to(torch.uint8)


def quantize_blocks(x: torch.Tensor, bits: int, is_key: bool) -> torch.Tensor:
    """Quantize whole blocks of K (per channel over the block's tokens) or V (per token over
    groups of :data:`V_GROUP` channels).

    Args:
        x: ``[N, block_size, num_kv_heads, head_dim]`` float32 or bfloat16 (``head_dim % 4 == 0``).
        bits: 4 or 2.
        is_key: K layout (per-channel parameters) or V layout (per-token-group parameters).

    Returns:
        ``[N, num_kv_heads, block_bytes]`` uint8 (module docstring).
    """
    N, bs, kvh, hd = x.shape
    xf = x.float().permute(0, 2, 1, 3)  # [N, kvh, bs, hd]
    if is_key:
        s, z = qparams(xf.amin(2), xf.amax(2), bits)  # [N, kvh, hd]
        codes = _codes(xf, s.unsqueeze(2), z.unsqueeze(2), bits)
    else:
        ng = num_groups(hd)
        pad = ng * V_GROUP - hd
        lo = torch.nn.functional.pad(xf, (0, pad), value=float("inf")).view(N, kvh, bs, ng, V_GROUP)
        hi = torch.nn.functional.pad(xf, (0, pad), value=float("-inf")).view(N, kvh, bs, ng, V_GROUP)
        s, z = qparams(lo.amin(-1), hi.amax(-1), bits)  # [N, kvh, bs, ng]
        se = s.repeat_interleave(V_GROUP, -1)[..., :hd]
        ze = z.repeat_interleave(V_GROUP, -1)[..., :hd]
        codes = _codes(xf, se, ze, bits)
    packed = pack(codes, bits).reshape(N, kvh, -1)
    params = torch.cat([s.reshape(N, kvh, -1), z.reshape(N, kvh, -1)], -1).contiguous().view(torch.uint8)
    return torch.cat([packed, params], -1)


def quantize(x: torch.Tensor, bits: int, is_key: bool) -> torch.Tensor:
    """:func:`quantize_blocks`, on the C kernel where it runs
    (:func:`kvserve.kernels.cpu_ops.lowbit_quantize`: the same bytes, tested bit for bit)."""
    if cpu_ops.lowbit_dequantize_supported(x, x.dtype):
        return cpu_ops.lowbit_quantize(x, bits, is_key)
    return quantize_blocks(x, bits, is_key)


def dequantize_blocks(data: torch.Tensor, bits: int, is_key: bool, block_size: int, head_dim: int,
                      dtype: torch.dtype) -> torch.Tensor:
    """``code · scale + zero`` in float32, rounded to ``dtype``.

    Args:
        data: ``[N, num_kv_heads, block_bytes]`` uint8 blocks (:func:`quantize_blocks`).
        bits, is_key, block_size, head_dim: the layout.
        dtype: the model dtype of the result.

    Returns:
        ``[N, block_size, num_kv_heads, head_dim]`` of ``dtype``.
    """
    N, kvh, _ = data.shape
    bs, hd = block_size, head_dim
    cb = code_bytes(bs, hd, bits)
    codes = unpack(data[..., :cb], bits).view(N, kvh, bs, hd).float()
    params = data[..., cb:].contiguous().view(torch.float16).float()
    P = params.shape[-1] // 2
    s, z = params[..., :P], params[..., P:]
    if is_key:
        s, z = s.view(N, kvh, 1, hd), z.view(N, kvh, 1, hd)
    else:
        ng = num_groups(hd)
        s = s.view(N, kvh, bs, ng).repeat_interleave(V_GROUP, -1)[..., :hd]
        z = z.view(N, kvh, bs, ng).repeat_interleave(V_GROUP, -1)[..., :hd]
    return (codes * s + z).to(dtype).permute(0, 2, 1, 3).contiguous()


def scales(data: torch.Tensor, bits: int, is_key: bool, block_size: int, head_dim: int) -> torch.Tensor:
    """The float32 scale of every value of ``data`` ``[N, num_kv_heads, block_bytes]`` →
    ``[N, block_size, num_kv_heads, head_dim]`` (the bound's ``scale``; for tests and reports)."""
    N, kvh, _ = data.shape
    cb = code_bytes(block_size, head_dim, bits)
    params = data[..., cb:].contiguous().view(torch.float16).float()
    s = params[..., : params.shape[-1] // 2]
    if is_key:
        s = s.view(N, kvh, 1, head_dim).expand(N, kvh, block_size, head_dim)
    else:
        s = s.view(N, kvh, block_size, -1).repeat_interleave(V_GROUP, -1)[..., :head_dim]
    return s.permute(0, 2, 1, 3)


# ---------------------------------------------------------------------------- pools
@dataclass
class LowBitPool:
    """One layer's K or V pool in a 2-/4-bit format.

    Attributes:
        data: ``[num_blocks, num_kv_heads, block_bytes]`` uint8, the full blocks.
        residual: ``[R, block_size, num_kv_heads, head_dim]`` model dtype, the residual slots.
        bits: 4 or 2.
        is_key: K (per-channel) or V (per-token) layout.
        block_size, head_dim: geometry.
    """

    data: torch.Tensor
    residual: torch.Tensor
    bits: int
    is_key: bool
    block_size: int
    head_dim: int

    @property
    def dtype(self) -> torch.dtype:
        """The format's marker dtype (``torch.uint4`` / ``torch.uint2``)."""
        return torch.uint4 if self.bits == 4 else torch.uint2

    @property
    def num_kv_heads(self) -> int:
        return self.data.shape[1]

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(num_blocks, block_size, num_kv_heads, head_dim)``: the logical shape (as a model-dtype pool's)."""
        return (self.data.shape[0], self.block_size, self.data.shape[1], self.head_dim)

    @property
    def device(self) -> torch.device:
        return self.data.device

    def element_size(self) -> int:
        """Bytes per logical element, rounded up (for sizes only; moves use ``data`` and ``residual``)."""
        return 1

    @property
    def model_dtype(self) -> torch.dtype:
        return self.residual.dtype

    def dequantize(self, blocks: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Blocks ``[N]`` int64 → ``[N, block_size, num_kv_heads, head_dim]`` (quantized data only):
        :func:`dequantize_blocks`, on the C kernel where it runs (the same values bit for bit)."""
        dtype = dtype or self.model_dtype
        if cpu_ops.lowbit_dequantize_supported(self.data, dtype):
            return cpu_ops.lowbit_dequantize(self.data, blocks, self.bits, self.is_key, self.block_size,
                                             self.head_dim, dtype)
        return dequantize_blocks(self.data.index_select(0, blocks), self.bits, self.is_key, self.block_size,
                                 self.head_dim, dtype)


def allocate_pools(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                   bits: int, residual_blocks: int, dtype: torch.dtype, device,
                   zeros=None) -> list[tuple[LowBitPool, LowBitPool]]:
    """Per layer ``(K, V)`` :class:`LowBitPool` s, zero-filled (``zeros(shape, dtype)``, default
    ``torch.zeros`` on ``device``)."""
    zeros = zeros or (lambda shape, dt: torch.zeros(shape, dtype=dt, device=device))
    out = []
    for _ in range(num_layers):
        pair = []
        for is_key in (True, False):
            data = zeros((num_blocks, num_kv_heads, block_bytes(block_size, head_dim, bits, is_key)), torch.uint8)
            res = zeros((residual_blocks, block_size, num_kv_heads, head_dim), dtype)
            pair.append(LowBitPool(data, res, bits, is_key, block_size, head_dim))
        out.append(tuple(pair))
    return out


def residual_bytes(num_layers: int, residual_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                   model_dtype: torch.dtype) -> int:
    """Bytes of the residual slots of all layers, K and V."""
    return 2 * num_layers * residual_blocks * block_size * num_kv_heads * head_dim * model_dtype.itemsize


def num_residual_slots(max_num_seqs: int, block_size: int, num_speculative_tokens: int = 0) -> int:
    """Residual slots an engine sets aside: one per running sequence (its partial last block), or,
    with speculative decoding of ``k`` drafts, the at most ``1 + ceil(k / block_size)`` blocks a
    verification of ``k + 1`` rows writes (every block it writes holds a slot until the accepted
    count is known; a verification that finds too few free decodes without drafts that step), plus
    16 spare (forks waiting, slots coming back after the forward)."""
    per_seq = 1 + -(-num_speculative_tokens // block_size)
    return max_num_seqs * per_seq + 16


def read_map(residual_map: torch.Tensor, slot_mapping: torch.Tensor, block_size: int) -> torch.Tensor:
    """The residual map readers use in a step: ``residual_map`` with the blocks this step fills
    (those whose last slot it writes) set to -1, since the write quantizes them (the KV manager
    gives their residual slots back after the step; after a verification step, only to those
    full of accepted tokens). ``[num_blocks]`` int64."""
    filled = slot_mapping[slot_mapping % block_size == block_size - 1] // block_size
    if filled.numel() == 0:
        return residual_map
    out = residual_map.clone()
    out[filled] = -1
    return out


def write(pool: LowBitPool, x: torch.Tensor, slot_mapping: torch.Tensor, residual_map: torch.Tensor) -> None:
    """Store a step's K or V rows: rows of blocks with a residual slot go there; every block whose
    last slot is written is then quantized from its ``block_size`` rows (the residual's, or, for a
    block written whole in this step, the step's own) into ``pool.data``.

    Args:
        pool: the layer's K or V pool.
        x: ``[T, num_kv_heads, head_dim]`` model dtype.
        slot_mapping: ``[T]`` int64 flat slots (``block · block_size + offset``, non-negative;
            a sequence's slots in order).
        residual_map: ``[num_blocks]`` int64, the KV manager's ``block → residual slot`` (-1: none).

    Raises:
        RuntimeError: a row lands in a block that has no residual slot and is not filled in this
            step (the KV manager's books and the step disagree).
    """
    bs = pool.block_size
    blk = slot_mapping // bs
    off = slot_mapping % bs
    rs = residual_map.index_select(0, blk)
    has = rs >= 0
    kvh, hd = x.shape[1], x.shape[2]
    res_flat = pool.residual.view(-1, kvh, hd)
    if bool(has.any()):
        res_flat.index_copy_(0, (rs * bs + off)[has], x[has])
    last = off == bs - 1
    filled = blk[last]
    n = filled.numel()
    if n == 0:
        if not bool(has.all()):
            raise RuntimeError("kv_cache_dtype int4/int2: K/V written into a partial block without a residual slot")
        return
    sf, _ = torch.sort(filled)
    p = torch.searchsorted(sf, blk).clamp_(max=n - 1)
    member = sf.index_select(0, p) == blk
    if not bool((has | member).all()):
        raise RuntimeError("kv_cache_dtype int4/int2: K/V written into a partial block without a residual slot")
    rows = torch.empty((n, bs, kvh, hd), dtype=x.dtype, device=x.device)
    rsf = residual_map.index_select(0, sf)
    hr = rsf >= 0
    if bool(hr.any()):
        rows[hr] = pool.residual.index_select(0, rsf[hr])
    rows.view(-1, kvh, hd).index_copy_(0, (p * bs + off)[member], x[member])
    pool.data.index_copy_(0, sf, quantize(rows, pool.bits, pool.is_key))


def gather(pool: LowBitPool, slots: torch.Tensor, residual_map: torch.Tensor,
           dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """K or V of ``slots`` (any shape, non-negative): the blocks they touch are dequantized once
    each (or read from their residual slot where ``residual_map`` has one) →
    ``[*slots.shape, num_kv_heads, head_dim]`` of ``dtype`` (default: the model dtype)."""
    bs = pool.block_size
    flat = slots.reshape(-1)
    ub, inv = torch.unique(flat // bs, return_inverse=True)
    blocks = pool.dequantize(ub, dtype)
    rs = residual_map.index_select(0, ub)
    hr = rs >= 0
    if bool(hr.any()):
        blocks[hr] = pool.residual.index_select(0, rs[hr]).to(blocks.dtype)
    kvh, hd = blocks.shape[2], blocks.shape[3]
    out = blocks.view(-1, kvh, hd).index_select(0, inv * bs + flat % bs)
    return out.view(*slots.shape, kvh, hd)


def gather_heads(pools: list[LowBitPool], slots: torch.Tensor, residual_map: torch.Tensor,
                 dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Per layer and KV head its own rows (a compaction's per-head selection): layer ``l``'s head
    ``h`` at ``slots[l, h, i]``, read as :func:`gather` reads them (full blocks dequantized, blocks
    with a slot in ``residual_map`` from their residual slot). The layers' blocks are dequantized in
    one call.

    Args:
        pools: one K (or one V) pool per layer, all of one format and geometry.
        slots: ``[num_layers, num_kv_heads, k]`` int64 flat slots (non-negative).
        residual_map: ``[num_blocks]`` int64 ``block → residual slot`` (-1: none).
        dtype: of the result (default: the model dtype).

    Returns:
        ``[num_layers, k, num_kv_heads, head_dim]``.
    """
    p0 = pools[0]
    bs, hd = p0.block_size, p0.head_dim
    L, kvh, k = slots.shape
    ub, inv = torch.unique(slots.reshape(-1) // bs, return_inverse=True)
    U = ub.numel()
    data = torch.stack([p.data.index_select(0, ub) for p in pools])  # [L, U, KVH, bytes]
    blocks = dequantize_blocks(data.view(L * U, kvh, -1), p0.bits, p0.is_key, bs, hd, dtype or p0.model_dtype)
    blocks = blocks.view(L, U, bs, kvh, hd)
    rs = residual_map.index_select(0, ub)
    hr = rs >= 0
    if bool(hr.any()):
        blocks[:, hr] = torch.stack([p.residual.index_select(0, rs[hr]) for p in pools]).to(blocks.dtype)
    flat = blocks.view(L, U * bs, kvh, hd)
    row = inv.view(L, kvh, k) * bs + slots % bs  # [L, KVH, k] rows of flat
    layers = torch.arange(L, device=slots.device).view(L, 1, 1)
    heads = torch.arange(kvh, device=slots.device).view(1, kvh, 1)
    return flat[layers, row, heads].transpose(1, 2)


def store_compacted(pools: list[LowBitPool], rows: torch.Tensor, dst_blocks: torch.Tensor, dst_residual: int) -> None:
    """Write a compaction's kept rows as the first ``k`` slots of ``dst_blocks`` in every layer's
    pool: each full block of ``block_size`` rows quantized into ``data`` (:func:`quantize_blocks`,
    as a step that fills a block quantizes it; the layers in one call), the ``k % block_size`` rows
    of a partial last block into residual slot ``dst_residual`` (model dtype).

    Args:
        pools: one K (or one V) pool per layer, all of one format and geometry.
        rows: ``[num_layers, k, num_kv_heads, head_dim]``, KV indices ``0 .. k - 1``.
        dst_blocks: ``[ceil(k / block_size)]`` int64 block ids.
        dst_residual: the residual slot of ``dst_blocks[-1]`` (used when ``k % block_size``).

    Raises:
        RuntimeError: a partial last block without a residual slot (``dst_residual < 0``).
    """
    p0 = pools[0]
    bs = p0.block_size
    L, k, kvh, hd = rows.shape
    nf = k // bs
    rows = rows.to(p0.model_dtype)
    rest = k - nf * bs
    if rest and dst_residual < 0:
        raise RuntimeError("kv_cache_dtype int4/int2: a compaction's partial last block has no residual slot")
    if nf:
        q = quantize(rows[:, : nf * bs].reshape(L * nf, bs, kvh, hd), p0.bits, p0.is_key).view(L, nf, kvh, -1)
        for p, ql in zip(pools, q):
            p.data.index_copy_(0, dst_blocks[:nf], ql)
    if rest:
        for p, rl in zip(pools, rows):
            p.residual[dst_residual, :rest] = rl[nf * bs :]


def copy_prefix(pool: LowBitPool, src: list[int], dst: list[int], num_tokens: list[int],
                residual_map: torch.Tensor) -> None:
    """Copy slots ``0 .. num_tokens[i] - 1`` of block ``src[i]`` (read from its residual slot or
    dequantized) into the residual slot of block ``dst[i]`` (a partial block: it must have one).
    All sources are read before any destination is written.

    Raises:
        RuntimeError: a destination block without a residual slot.
    """
    dev = pool.data.device
    residual_map = residual_map.to(dev)
    s = torch.tensor(src, dtype=torch.long, device=dev)
    d = torch.tensor(dst, dtype=torch.long, device=dev)
    rows = gather(pool, s.unsqueeze(1) * pool.block_size + torch.arange(pool.block_size, device=dev), residual_map)
    rd = residual_map.index_select(0, d)
    if bool((rd < 0).any()):
        raise RuntimeError(f"kv_cache_dtype int4/int2: a partial-block copy into blocks {dst} without residual slots")
    n = torch.tensor(num_tokens, device=dev)
    keep = torch.arange(pool.block_size, device=dev).unsqueeze(0) < n.unsqueeze(1)  # [M, bs]
    kvh, hd = pool.residual.shape[2], pool.residual.shape[3]
    dst_slots = (rd.unsqueeze(1) * pool.block_size + torch.arange(pool.block_size, device=dev))[keep]
    pool.residual.view(-1, kvh, hd).index_copy_(0, dst_slots, rows[keep].to(pool.residual.dtype))
