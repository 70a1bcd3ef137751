"""Micro-benchmark of the SuffixDecoding index: memory per token, append and speculate time.

Usage::

    python -m workflows.bench.suffix_index --tokens 100000 --out suffix_bench.json

The token data imitates a document-editing agent: each session takes a DELEGATE-52 seed
document and runs turns of "prompt (template + document + instruction) -> edited document",
the output becoming the next turn's document. Edits replace, delete, duplicate and move
lines (seeded RNG). Text is tokenized with the local SmolLM2 tokenizer when it is present,
otherwise with a seeded word-hash tokenizer (reported as ``"tokenizer": "word-hash"``).

Measured:

* ``bytes_per_token``: tracemalloc growth while building the history index / tokens indexed;
* ``append_us_per_token``: the same build without tracemalloc (it slows allocation);
* ``speculate_us``: ``SuffixIndex.speculate`` on held-out turns, at random positions of their
  outputs (p50 / p95 / p99), with the mean match length, draft length and accepted length
  (the draft's prefix that equals the true continuation);
* ``propose_us``: ``SuffixDrafter.propose`` (request + history index) while replaying
  held-out turns, one step per accepted block, excluding step 0, and the request-index build
  cost of step 0 per prompt token.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import tracemalloc
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from agentspec.drafters.suffix.automaton import SuffixIndex
from agentspec.drafters.suffix.drafter import SuffixConfig, SuffixDrafter
from agentspec.types import DraftContext, SessionRef, VerifyResult
from workflows.workloads.datasets import data_dir, load_delegate52, load_prompt_template

TOKENIZER_DIR = Path.home() / ".cache" / "agentspec" / "models" / "smollm2-135m-instruct"
Encode = Callable[[str], list[int]]


def load_encoder(path: Path) -> tuple[Encode, str]:
    """The SmolLM2 tokenizer's ``encode`` if it loads, else a word-hash tokenizer."""
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path))
        return (lambda text: list(tok.encode(text, add_special_tokens=False))), path.name
    except Exception:  # no model files: any deterministic word-level ids will do
        def encode(text: str) -> list[int]:
            return [zlib.crc32(w.encode()) % 49_152 for w in text.replace("\n", " \n ").split(" ")]

        return encode, "word-hash"


class EditSimulator:
    """Produces agent turns (prompt + output token lists) from seed documents."""

    def __init__(self, folder: Path, encode: Encode, seed: int) -> None:
        self.rng = random.Random(seed)
        self.encode = encode
        domains = load_delegate52(folder)
        self.template = load_prompt_template(folder)
        self.docs = [d.seed_excerpt for d in domains]
        self.instructions = [e.forward for d in domains for e in d.edits]
        self.pool = [line for doc in self.docs for line in doc.splitlines() if line.strip()]

    def edit(self, doc: str) -> str:
        """Apply 1-4 line edits: replace, delete, duplicate or move a line."""
        lines = doc.splitlines()
        for _ in range(self.rng.randint(1, 4)):
            if len(lines) < 2:
                break
            i = self.rng.randrange(len(lines))
            op = self.rng.random()
            if op < 0.4:
                lines[i] = self.rng.choice(self.pool)
            elif op < 0.6:
                del lines[i]
            elif op < 0.8:
                lines.insert(i, lines[self.rng.randrange(len(lines))])
            else:
                lines.insert(self.rng.randrange(len(lines)), lines.pop(i))
        return "\n".join(lines)

    def session(self, turns: int) -> list[tuple[list[int], list[int]]]:
        """One session: ``turns`` (prompt tokens, output tokens) pairs."""
        doc, out = self.rng.choice(self.docs), []
        for _ in range(turns):
            new = self.edit(doc)
            prompt = (
                self.template.replace("[[INPUT_CONTEXT]]", f"```doc.txt\n{doc}\n```")
                .replace("[[FILE_NAMES]]", "doc.txt")
                .replace("[[EDITING_OPERATION]]", self.rng.choice(self.instructions))
            )
            out.append((self.encode(prompt), self.encode(f"```doc.txt\n{new}\n```")))
            doc = new
        return out


def percentiles(samples_s: Sequence[float]) -> dict[str, float]:
    """p50 / p95 / p99 / mean of a list of seconds, in microseconds."""
    xs = sorted(samples_s)
    out = {f"p{q}": round(1e6 * xs[min(len(xs) - 1, q * len(xs) // 100)], 2) for q in (50, 95, 99)}
    out["mean"] = round(1e6 * statistics.fmean(xs), 2)
    return out


def bench_index(turns: list[list[int]], held_out: list[tuple[list[int], list[int]]],
                cfg: SuffixConfig, queries: int, rng: random.Random) -> dict[str, Any]:
    """Memory, append and speculate numbers of one history index over ``turns``."""
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    index = SuffixIndex(cfg.max_depth, cfg.max_tokens)
    for i, turn in enumerate(turns):
        index.append(i, turn)
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    n = index.num_tokens

    index = SuffixIndex(cfg.max_depth, cfg.max_tokens)
    t0 = time.perf_counter()
    for i, turn in enumerate(turns):
        index.append(i, turn)
    append_s = time.perf_counter() - t0

    times, matches, drafts, accepted = [], [], [], []
    for _ in range(queries):
        prompt, output = rng.choice(held_out)
        cut = len(prompt) + rng.randrange(len(output))
        full = prompt + output
        context, truth = full[:cut], full[cut:]
        t0 = time.perf_counter()
        draft, match_len, _ = index.speculate(
            context, cfg.max_tokens, cfg.max_depth, cfg.max_spec_factor, cfg.max_spec_offset,
            cfg.min_token_prob)
        times.append(time.perf_counter() - t0)
        acc = 0
        while acc < len(draft) and acc < len(truth) and draft[acc] == truth[acc]:
            acc += 1
        matches.append(match_len)
        drafts.append(len(draft))
        accepted.append(acc)
    return {
        "tokens_indexed": n,
        "sequences": index.num_sequences,
        "states_per_token": round(index.num_states / n, 3),
        "bytes_per_token": round(used / n, 1),
        "estimated_bytes_per_token": round(index.memory_bytes() / n, 1),
        "append_us_per_token": round(1e6 * append_s / n, 3),
        "speculate_us": percentiles(times),
        "mean_match_len": round(statistics.fmean(matches), 2),
        "mean_draft_len": round(statistics.fmean(drafts), 2),
        "mean_accepted_len": round(statistics.fmean(accepted), 2),
    }


def bench_drafter(turns: list[tuple[list[int], list[int]]],
                  held_out: list[tuple[list[int], list[int]]], cfg: SuffixConfig,
                  max_draft: int) -> dict[str, Any]:
    """Replay held-out turns through a :class:`SuffixDrafter` whose history holds ``turns``."""
    drafter = SuffixDrafter(cfg)
    ref = SessionRef("bench")
    for prompt, output in turns:
        full = prompt + output
        drafter.finish(DraftContext(full, len(prompt), ref, 0))
    step_s, build_s, build_tokens, steps, generated = [], 0.0, 0, 0, 0
    for prompt, output in held_out:
        context: list[int] = list(prompt)
        step = 0
        while len(context) - len(prompt) < len(output):
            ctx = DraftContext(context, len(prompt), ref, step)
            t0 = time.perf_counter()
            draft = drafter.propose(ctx, max_draft)
            dt = time.perf_counter() - t0
            if step == 0:
                build_s += dt
                build_tokens += len(prompt)
            else:
                step_s.append(dt)
            truth = output[len(context) - len(prompt) :]
            acc = 0
            while acc < min(len(draft.tokens), len(truth) - 1) and draft.tokens[acc] == truth[acc]:
                acc += 1
            drafter.observe(ctx, VerifyResult(truth[: acc + 1], acc))
            context.extend(truth[: acc + 1])
            step += 1
        drafter.finish(DraftContext(context, len(prompt), ref, step))
        steps += step
        generated += len(output)
    return {
        "propose_us": percentiles(step_s),
        "request_build_us_per_prompt_token": round(1e6 * build_s / max(1, build_tokens), 3),
        "tokens_per_step": round(generated / max(1, steps), 2),
        "memory_bytes": drafter.stats()["memory_bytes"],
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark, print a table and write the JSON report."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=100_000, help="tokens in the index")
    parser.add_argument("--queries", type=int, default=2_000, help="speculate calls timed")
    parser.add_argument("--replay", type=int, default=4, help="held-out turns replayed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", default=None, help="data folder (default: see datasets)")
    parser.add_argument("--tokenizer", default=str(TOKENIZER_DIR))
    parser.add_argument("--out", default="suffix_bench.json")
    args = parser.parse_args(argv)

    encode, tok_name = load_encoder(Path(args.tokenizer))
    sim = EditSimulator(data_dir(args.data), encode, args.seed)
    history: list[tuple[list[int], list[int]]] = []
    while sum(len(p) + len(o) for p, o in history) < args.tokens:
        history.extend(sim.session(sim.rng.randint(2, 5)))
    held_out = sim.session(args.replay)
    cfg = SuffixConfig()
    rng = random.Random(args.seed + 1)

    report: dict[str, Any] = {"tokenizer": tok_name, "config": cfg.__dict__}
    report["index"] = bench_index([p + o for p, o in history], held_out, cfg, args.queries, rng)
    report["drafter"] = bench_drafter(history, held_out, cfg, max_draft=16)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")

    idx, dr = report["index"], report["drafter"]
    rows = [
        ("tokens indexed", f"{idx['tokens_indexed']:,}"),
        ("bytes / token (tracemalloc)", f"{idx['bytes_per_token']:.0f}"),
        ("append us / token", f"{idx['append_us_per_token']:.2f}"),
        ("speculate us p50 / p95", f"{idx['speculate_us']['p50']:.1f} / "
                                   f"{idx['speculate_us']['p95']:.1f}"),
        ("match / draft / accepted len", f"{idx['mean_match_len']:.1f} / "
                                         f"{idx['mean_draft_len']:.1f} / "
                                         f"{idx['mean_accepted_len']:.1f}"),
        ("drafter propose us p50 / p95", f"{dr['propose_us']['p50']:.1f} / "
                                         f"{dr['propose_us']['p95']:.1f}"),
        ("request build us / prompt token", f"{dr['request_build_us_per_prompt_token']:.2f}"),
        ("replay tokens / step", f"{dr['tokens_per_step']:.2f}"),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
