"""Quickstart: speculative decoding on the embedded model, in-process.

Run: .venv/bin/python examples/quickstart.py
"""

from __future__ import annotations

from agentspec.chat.stream import ResultStream
from agentspec.chat.templates import render_prompt
from agentspec.drafters import PromptLookupDrafter
from agentspec.engine import SpeculativeDecoder
from agentspec.targets.hf import HFTarget


def main() -> None:
    """Ask the embedded model to copy-edit a JSON document, streaming the answer."""
    # SmolLM2-135M-Instruct in the default precision, auto (w8a16 on a CPU; target.dtype):
    # output identical to greedy decoding in it
    target = HFTarget.load()
    tok = target.tokenizer
    engine = SpeculativeDecoder(
        target,
        PromptLookupDrafter(),
        decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
        eos_token_ids=[tok.eos_token_id],
    )
    doc = '{"name": "checkout", "replicas": 3, "region": "eu-west-1", "owner": "payments"}'
    prompt = render_prompt(tok, [{"role": "user", "content": (
        f"Here is config.json:\n```json\n{doc}\n```\nSet replicas to 5 and reply with the "
        "whole updated file in a ```json block."
    )}])
    stream = ResultStream(engine.stream(prompt, max_tokens=120))
    for delta in stream:  # the text as it commits; then the Generation is stream.result
        print(delta, end="", flush=True)
    stats = stream.result.stats
    print(f"\n\n{stats.generated_tokens} tokens, {stats.tokens_per_s:.1f} tok/s, "
          f"{stats.forwards_per_1k:.0f} target forwards per 1,000 tokens, "
          f"accepted-length histogram {stats.accepted_histogram()}")


if __name__ == "__main__":
    main()
