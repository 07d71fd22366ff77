"""Hugging Face transformers: a ``Cache`` that keeps packed foscar codes (not dequantized copies), and an
attention function that decodes through ``foscar.decode``.

    from foscar.integrations.transformers import FoscarCache, register
    register()  # attn_implementation "foscar" (attention and mask interfaces)
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="foscar")
    cache = FoscarCache(bits=4, k_axis="channel", v_axis="token", group_size=64, sink=4, recent=32)
    model.generate(**inputs, **cache_kwargs(model, cache), max_new_tokens=64)   # cache= or past_key_values=

The prompt (a first update of several tokens) is appended to the cache and attended with SDPA over its
own unquantized keys and values, as KIVI-style caches do. Each decode step appends its token and
attends with ``foscar.decode`` over the cache: the quantized tokens read as packed codes, the BF16 sink
and recent windows as they are. A step of up to :data:`MAX_STEP` new tokens after the prompt (assisted
decoding, speculative verification) is one ``foscar.decode`` of ``q [B, q_len, Hq, D]``, causal among the
step's tokens, each as its own one-token step would attend (:mod:`foscar.multitoken`; over a BF16 ring, one that
keeps the step's windows: ``rollback``, :data:`MAX_STEP` by default); longer runs of new tokens (chunked prefill)
attend over the dequantized cache with SDPA. Pages (64 tokens) are added as sequences grow.
"""
from __future__ import annotations

import inspect
import math

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

import foscar

from ..cache import QuantKVCache
from ..errors import InvalidArgumentError, UnsupportedError
from ..format import KVFormat
from ..multitoken import ring_serves
from ..quantize import FP4_QUANTIZERS, QUANTIZERS, check_quantizer

ATTN_IMPL = "foscar"
PAGE = 64
#: The most new tokens after the prompt that one ``foscar.decode`` step takes (speculative verification)
MAX_STEP = 8


class FoscarLayer(CacheLayerMixin):
    """One attention layer's foscar cache."""

    is_compileable = False
    is_sliding = False

    @property
    def is_croppable(self) -> bool:
        """Whether :meth:`crop` can take tokens off (assisted decoding asks before its first crop): a cache
        without a BF16 recent ring, or whose ring keeps tokens to take back (``KVFormat.rollback``)."""
        fmt = (self.cache.fmt if self.is_initialized
               else KVFormat(head_dim=max(64, self.fmt_kwargs["group_size"]), **self.fmt_kwargs))
        return not fmt.recent_capacity or fmt.rollback > 0

    def __init__(self, fmt_kwargs: dict, quantizer: str = "minmax", backend: str = "auto", key_mean: str | None = None,
                 tensor_scales=None, key_weights: str | None = None):
        super().__init__()
        self.fmt_kwargs, self.quantizer, self.backend, self.key_mean = fmt_kwargs, quantizer, backend, key_mean
        self.tensor_scales, self.key_weights = tensor_scales, key_weights
        self.prompt = None  # key_weights="prefill": the prompt's keys and values until its queries are seen
        self.cache: QuantKVCache | None = None
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, T, D = key_states.shape
        fmt = KVFormat(head_dim=D, **self.fmt_kwargs)
        self.cache = QuantKVCache.empty(fmt, B, H, max_len=max(T, 1) + PAGE, page_size=PAGE,
                                        window_dtype=torch.bfloat16 if key_states.dtype != torch.float16
                                        else torch.float16, device=key_states.device, key_mean=self.key_mean,
                                        tensor_scales=self.tensor_scales)
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    def _ensure_room(self, extra: int) -> None:
        """Double the pages per sequence (never less than needed) when ``extra`` more tokens would not fit."""
        cache = self.cache
        per = cache.page_table.block_table.shape[1]
        need = math.ceil((self.length + extra) / PAGE)
        if need <= per:
            return
        new_per = max(need, 2 * per)
        B, H = cache.batch_size, cache.num_kv_heads
        grown = QuantKVCache.empty(cache.fmt, B, H, max_len=new_per * PAGE, page_size=PAGE,
                                   window_dtype=cache.window_dtype, device=cache.device)
        old_ids = cache.page_table.block_table.long().reshape(-1)
        new_ids = grown.page_table.block_table[:, :per].long().reshape(-1)
        for name in ("k_codes", "v_codes", "k_params", "v_params"):
            getattr(grown, name)[new_ids] = getattr(cache, name)[old_ids]
        grown.tensor_scales.copy_(cache.tensor_scales)
        for name in ("k_sink", "v_sink", "k_recent", "v_recent"):
            getattr(grown, name).copy_(getattr(cache, name))
        grown.seq_lens.copy_(cache.seq_lens)
        grown.ring_from.copy_(cache.ring_from)
        grown.k_mean, grown.k_mean_pending, grown.k_weights = cache.k_mean, cache.k_mean_pending, cache.k_weights
        self.cache = grown

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        T = key_states.shape[-2]
        prior = self.length
        self._ensure_room(T)
        if prior == 0 and self.key_weights == "prefill":  # written once the attention has seen the queries
            self.prompt = (key_states, value_states)
            self.length += T
            keys = key_states.detach().clone()
            keys._foscar_prompt_of = self
            return keys, value_states
        foscar.append(self.cache, key_states, value_states, quantizer=self.quantizer)  # Triton on a GPU
        self.length += T
        if prior == 0:  # the prompt: SDPA over its own keys and values
            return key_states, value_states
        if T <= MAX_STEP and ring_serves(self.cache.fmt, T):  # a decode step: the attention function reads
            keys = key_states.detach().clone()  # the cache through the tag
            keys._foscar_layer = self
            return keys, value_states
        k, v = self.cache.dequantize(torch.float32)  # several tokens after the prompt: dequantized, SDPA
        return k.to(key_states.dtype), v.to(value_states.dtype)

    def write_prompt(self, query: torch.Tensor) -> None:
        """The prompt's keys and values written with the keys' codes rounded for its queries ``query [B, Hq,
        T, D]`` (:func:`foscar.key_weights.query_moments`, the cache's weights from now on)."""
        from ..key_weights import query_moments
        (k, v), self.prompt = self.prompt, None
        try:
            self.cache.set_key_weights(query_moments(query.detach(), self.cache.num_kv_heads))
            foscar.append(self.cache, k, v, quantizer=self.quantizer)  # the PyTorch write path
        except Exception:  # refused: the layer as it was before the prompt
            self.cache.set_key_weights(None)
            self.length -= k.shape[-2]
            raise

    def attend(self, q: torch.Tensor, scaling: float | None) -> torch.Tensor:
        """A decode step's attention of ``q [B, Hq, D]`` (or a step's ``[B, q_len, Hq, D]``, the step's tokens
        already appended) over this layer's cache (:func:`foscar.decode`)."""
        return foscar.decode(q, self.cache, sm_scale=scaling, backend=self.backend)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.cache, self.length, self.is_initialized = None, 0, False

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` tokens (transformers' convention: a negative count), as
        assisted decoding does with the rejected candidates: :meth:`foscar.QuantKVCache.rewind` (the lengths go
        back, the next appends write over them; a BF16 recent ring takes back as many as its format's
        ``rollback`` after appends of that many)."""
        if tokens_to_remove > 0:
            raise InvalidArgumentError("tokens_to_remove", "a negative count of tokens to remove (or 0)",
                                       tokens_to_remove)
        n = -tokens_to_remove
        if n == 0 or not self.is_initialized:
            return
        if n > self.length:
            raise InvalidArgumentError("tokens_to_remove", f"at most the {self.length} tokens cached", n)
        self.cache.rewind(n)
        self.length -= n

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise UnsupportedError("beam search", "FoscarCache does not reorder sequences yet")


class FoscarCache(Cache):
    """A transformers ``Cache`` of foscar-quantized layers: ``bits``, ``k_axis``, ``v_axis``, ``group_size``,
    ``sink``, ``recent``, ``rotation``, ``rotation_seed``, ``scheme`` and ``rollback`` as in :class:`foscar.KVFormat`
    (``rollback``: :data:`MAX_STEP` by default, so that a ring takes back a verification step's drafts; ``group_size``:
    64, or an FP4 scheme's block); ``key_mean="prefill"`` centres each layer's keys by its prompt's mean
    (:mod:`foscar.centring`); ``key_weights="prefill"`` rounds each layer's key codes for the scores of its prompt's
    queries (:mod:`foscar.key_weights`: the prompt written after its attention has seen them, and every later key
    with the same weights, through the PyTorch write path); ``quantizer`` as in :func:`foscar.quantize_kv`; ``tensor_scales``: NVFP4's per-tensor
    scales of every layer's K and V (default 1); ``backend`` as in :func:`foscar.decode`."""

    def __init__(self, *, bits: int = 4, k_axis: str = "token", v_axis: str = "token", group_size: int | None = None,
                 sink: int = 0, recent: int = 0, rotation: str | None = None, rotation_seed: int | None = None,
                 key_mean: str | None = None, quantizer: str = "minmax", backend: str = "auto",
                 scheme: str = "affine", tensor_scales=None, key_weights: str | None = None,
                 rollback: int = MAX_STEP):
        if group_size is None:
            from ..fp4 import SPECS
            group_size = SPECS[scheme].block if scheme in SPECS else 64
        fmt = KVFormat(bits=bits, head_dim=max(64, group_size), group_size=group_size, k_axis=k_axis, v_axis=v_axis,
                       sink=sink, recent=recent, rotation=rotation, rotation_seed=rotation_seed,
                       scheme=scheme, rollback=rollback)  # fail now, not at the first layer, on a bad format
        if tensor_scales is not None:
            from ..fp4 import check_tensor_scales
            tensor_scales = check_tensor_scales(fmt, tensor_scales, "cpu").tolist()
        self.tensor_scales = tensor_scales
        self.fmt_kwargs = dict(bits=bits, group_size=group_size, k_axis=k_axis, v_axis=v_axis, sink=sink, recent=recent,
                               rotation=rotation, rotation_seed=rotation_seed, scheme=scheme, rollback=rollback)
        if key_mean not in (None, "prefill"):
            raise InvalidArgumentError("key_mean", "None or 'prefill' (each layer's prompt keys' mean)", repr(key_mean))
        if key_weights not in (None, "prefill"):
            raise InvalidArgumentError("key_weights", "None or 'prefill' (each layer's prompt queries)",
                                       repr(key_weights))
        if key_weights is not None and fmt.is_fp4:
            raise UnsupportedError(f"key_weights with scheme={scheme!r}", "query-weighted rounding takes the affine "
                                   "formats' grids")
        check_quantizer(quantizer, FP4_QUANTIZERS if fmt.is_fp4 else QUANTIZERS,
                        f" (scheme={scheme!r})" if fmt.is_fp4 else "")
        self.quantizer, self.backend, self.key_mean, self.key_weights = quantizer, backend, key_mean, key_weights
        super().__init__(layers=None, layer_class_to_replicate=self._layer)

    def _layer(self) -> FoscarLayer:
        return FoscarLayer(self.fmt_kwargs, self.quantizer, self.backend, self.key_mean, self.tensor_scales,
                           self.key_weights)


def foscar_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs):
    """The attention function of ``attn_implementation="foscar"``: decode steps through ``foscar.decode``
    over the layer's packed cache, everything else through SDPA. Returns ``[B, T, Hq, D]``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    prompt_of = getattr(key, "_foscar_prompt_of", None)
    if prompt_of is not None:  # key_weights="prefill": the prompt's keys rounded for its queries
        prompt_of.write_prompt(query)
    layer = getattr(key, "_foscar_layer", None)
    if layer is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    T = query.shape[2]
    if attention_mask is not None and not _is_step_mask(attention_mask, T, layer.length):
        raise UnsupportedError("attention_mask", "padded batches are not supported by the foscar decode yet")
    if T == 1:
        return layer.attend(query[:, :, 0, :], scaling).to(query.dtype)[:, None], None
    return layer.attend(query.transpose(1, 2).contiguous(), scaling).to(query.dtype), None


def _is_step_mask(mask: torch.Tensor, T: int, length: int) -> bool:
    """Whether ``mask [B, 1, T, >= length]`` (bool: True attends; else additive: 0 attends) is the causal mask
    of a step of ``T`` tokens that end a sequence of ``length``: token ``j`` sees the first
    ``length - T + 1 + j`` keys, nothing else (no padding)."""
    allowed = mask if mask.dtype == torch.bool else mask == 0
    pos = torch.arange(allowed.shape[-1], device=mask.device)
    limit = length - T + 1 + torch.arange(T, device=mask.device)
    expected = pos[None, :] < limit[:, None]  # [T, kv]
    return bool((allowed[..., -T:, :] == expected).all())


def register() -> None:
    """Register ``attn_implementation="foscar"`` with transformers (attention function and SDPA masks)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    AttentionInterface.register(ATTN_IMPL, foscar_attention)
    AttentionMaskInterface.register(ATTN_IMPL, sdpa_mask)


__all__ = ["ATTN_IMPL", "FoscarCache", "FoscarLayer", "cache_kwargs", "foscar_attention", "perplexity", "register",
           "token_agreement"]


def cache_kwargs(model, cache: Cache) -> dict:
    """``{keyword: cache}`` for ``model(...)`` and ``model.generate(...)``: transformers renamed
    ``past_key_values`` to ``cache`` during 5.x, and an older version silently ignores ``cache=`` (it
    builds its own BF16 cache), so the keyword is read from the model's own signature."""
    forward = getattr(model, "forward", None)
    if not callable(forward):
        raise InvalidArgumentError("model", "a transformers model (with a forward method)", type(model).__name__)
    params = inspect.signature(forward).parameters
    return {"cache" if "cache" in params else "past_key_values": cache}


# --------------------------------------------------------------------------------------------
# Measuring a cache on a model: greedy agreement and perplexity
# --------------------------------------------------------------------------------------------
@torch.no_grad()
def teacher_forced_logits(model, ids: torch.Tensor, cache: Cache | None = None, prefix: int = 1) -> torch.Tensor:
    """The next-token logits ``[1, n - prefix, vocab]`` of positions ``prefix .. n - 1`` of ``ids [1, n]``:
    ``prefix`` tokens prefilled into ``cache`` (``None``: transformers' own BF16 DynamicCache), then one
    token per step, so every later position is predicted by a decode step over the cache."""
    from transformers import DynamicCache
    cache = DynamicCache() if cache is None else cache
    kw = cache_kwargs(model, cache)
    out = model(ids[:, :prefix], use_cache=True, **kw)
    logits = [out.logits[:, -1]]
    for t in range(prefix, ids.shape[1] - 1):
        out = model(ids[:, t: t + 1], use_cache=True, **kw)
        logits.append(out.logits[:, -1])
    return torch.stack(logits, dim=1)


def perplexity(model, ids: torch.Tensor, cache: Cache | None = None, prefix: int = 1) -> float:
    """Perplexity of ``ids [1, n]`` with teacher forcing (:func:`teacher_forced_logits`)."""
    logp = torch.log_softmax(teacher_forced_logits(model, ids, cache, prefix).float(), dim=-1)
    target = ids[:, prefix:]
    nll = -logp.gather(-1, target[..., None]).squeeze(-1).mean()
    return float(torch.exp(nll))


def token_agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fraction of the first ``min(len)`` generated positions where two greedy generations agree."""
    n = min(a.numel(), b.numel())
    return float((a.flatten()[:n] == b.flatten()[:n]).float().mean()) if n else 1.0
